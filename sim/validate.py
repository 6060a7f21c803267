"""Small helpers that validate config dictionaries and name the bad field by its path.

Every error is a `ConfigError` (a `ValueError`) carrying the dotted field path, e.g.
`"workload.arrival.rate: must be > 0, got -1"`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from servetwin.core.config_error import ConfigError


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def check_mapping(cfg: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{path}", f"must be a mapping, got {type(cfg).__name__}")
    return cfg


def check_keys(cfg: Mapping[str, Any], allowed: Iterable[str], path: str,
               required: Iterable[str] = ()) -> None:
    """Unknown keys and missing required keys are errors naming the field."""
    allowed = set(allowed)
    for key in cfg:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}", f"unknown field (allowed: {', '.join(sorted(allowed))})")
    for key in required:
        if key not in cfg:
            raise ConfigError(f"{path}.{key}", "required field is missing")


def as_float(value: Any, path: str) -> float:
    """A finite real number; numeric strings are accepted (YAML 1.1 reads `1e9` as a string)."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}", f"must be a number, got {_fmt(value)}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{path}", f"must be a number, got {_fmt(value)}") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{path}", f"must be a finite number, got {_fmt(value)}")
    return float(value)


def as_int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}", f"must be an integer, got {_fmt(value)}")
    return value


def positive(value: Any, path: str) -> float:
    x = as_float(value, path)
    if x <= 0:
        raise ConfigError(f"{path}", f"must be > 0, got {_fmt(value)}")
    return x


def non_negative(value: Any, path: str) -> float:
    x = as_float(value, path)
    if x < 0:
        raise ConfigError(f"{path}", f"must be >= 0, got {_fmt(value)}")
    return x


def int_at_least(value: Any, low: int, path: str) -> int:
    x = as_int(value, path)
    if x < low:
        raise ConfigError(f"{path}", f"must be >= {low}, got {_fmt(value)}")
    return x


def one_of(value: Any, allowed: Iterable[str], path: str) -> str:
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{path}", f"must be one of {', '.join(map(repr, allowed))}, got {_fmt(value)}")
    return value
