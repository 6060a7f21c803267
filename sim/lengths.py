"""Token-length distributions for workloads (prompt, output, shared-prefix suffix lengths).

Every distribution draws integers from a numpy `Generator`, rounds to the nearest integer and clips
to `min_value` (1 for prompt/output lengths, 0 allowed for a shared-prefix suffix).

Config forms (`parse_length_dist`): an integer (fixed), or a mapping with `type`:
- `fixed`: `value`
- `uniform`: `low`, `high` (inclusive integers)
- `normal`: `mean`, `std` (clipped below at min_value)
- `lognormal`: `mean` and either `sigma` (of the underlying normal) or `cv` (std/mean of the
  lengths); mu = ln(mean) - sigma^2/2, sigma^2 = ln(1 + cv^2)
- `empirical`: `values` (a list) or `path` (a text file, one length per line, `#` comments),
  sampled uniformly with replacement
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.sim.validate import (as_float, as_int, check_keys, check_mapping, int_at_least, non_negative, positive)


@runtime_checkable
class LengthDist(Protocol):
    min_value: int

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray: ...

    @property
    def mean(self) -> float: ...


def _finish(x: np.ndarray, min_value: int) -> np.ndarray:
    return np.maximum(np.rint(x), min_value).astype(np.int64)


@dataclass(slots=True, frozen=True)
class Fixed:
    value: int
    min_value: int = 1

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.full(size, max(self.value, self.min_value), dtype=np.int64)

    @property
    def mean(self) -> float:
        return float(max(self.value, self.min_value))


@dataclass(slots=True, frozen=True)
class Uniform:
    low: int
    high: int
    min_value: int = 1

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return _finish(rng.integers(self.low, self.high + 1, size=size), self.min_value)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2.0


@dataclass(slots=True, frozen=True)
class Normal:
    mean_: float
    std: float
    min_value: int = 1

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return _finish(rng.normal(self.mean_, self.std, size=size), self.min_value)

    @property
    def mean(self) -> float:
        return self.mean_  # before clipping


@dataclass(slots=True, frozen=True)
class LogNormal:
    mean_: float
    sigma: float
    min_value: int = 1

    @classmethod
    def from_cv(cls, mean: float, cv: float, min_value: int = 1) -> "LogNormal":
        return cls(mean, math.sqrt(math.log1p(cv * cv)), min_value)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        mu = math.log(self.mean_) - self.sigma ** 2 / 2.0
        return _finish(rng.lognormal(mu, self.sigma, size=size), self.min_value)

    @property
    def mean(self) -> float:
        return self.mean_  # before rounding


@dataclass(slots=True, frozen=True)
class Empirical:
    values: tuple[int, ...]
    min_value: int = 1

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return _finish(rng.choice(np.asarray(self.values), size=size, replace=True), self.min_value)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))


def read_lengths_file(path: str | Path, field_path: str) -> tuple[int, ...]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{field_path}", f"file not found: {p}")
    values: list[int] = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if text:
                values.append(int_at_least(_num(text, f"{p}:{lineno}"), 0, f"{p}:{lineno}"))
    if not values:
        raise ConfigError(f"{field_path}", f"{p} holds no lengths")
    return tuple(values)


def _num(text: str, where: str) -> int:
    try:
        return as_int(float(text), where)
    except ValueError:
        raise ConfigError(f"{where}", f"not an integer length: {text!r}") from None


_FIELDS = {
    "fixed": ({"value"}, {"value"}),
    "uniform": ({"low", "high"}, {"low", "high"}),
    "normal": ({"mean", "std"}, {"mean", "std"}),
    "lognormal": ({"mean", "sigma", "cv"}, {"mean"}),
    "empirical": ({"values", "path"}, set()),
}


def parse_length_dist(cfg: Any, path: str, min_value: int = 1) -> LengthDist:
    """Build a distribution from its config, with errors naming `path` and the field."""
    if isinstance(cfg, int) and not isinstance(cfg, bool):
        return Fixed(int_at_least(cfg, min_value, path), min_value)
    cfg = check_mapping(cfg, path)
    kind = cfg.get("type")
    if kind not in _FIELDS:
        raise ConfigError(f"{path}.type", f"must be one of {', '.join(map(repr, _FIELDS))}, got {kind!r}")
    allowed, required = _FIELDS[kind]
    check_keys(cfg, allowed | {"type"}, path, required=sorted(required))
    if kind == "fixed":
        return Fixed(int_at_least(cfg["value"], min_value, f"{path}.value"), min_value)
    if kind == "uniform":
        low = int_at_least(cfg["low"], min_value, f"{path}.low")
        high = int_at_least(cfg["high"], low, f"{path}.high")
        return Uniform(low, high, min_value)
    if kind == "normal":
        return Normal(as_float(cfg["mean"], f"{path}.mean"), non_negative(cfg["std"], f"{path}.std"),
                      min_value)
    if kind == "lognormal":
        mean = positive(cfg["mean"], f"{path}.mean")
        if ("sigma" in cfg) == ("cv" in cfg):
            raise ConfigError(f"{path}", "give exactly one of 'sigma' or 'cv'")
        if "sigma" in cfg:
            return LogNormal(mean, non_negative(cfg["sigma"], f"{path}.sigma"), min_value)
        return LogNormal.from_cv(mean, non_negative(cfg["cv"], f"{path}.cv"), min_value)
    # empirical
    if ("values" in cfg) == ("path" in cfg):
        raise ConfigError(f"{path}", "give exactly one of 'values' or 'path'")
    if "path" in cfg:
        values = read_lengths_file(cfg["path"], f"{path}.path")
    else:
        raw = cfg["values"]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise ConfigError(f"{path}.values", "must be a non-empty list of lengths")
        values = tuple(int_at_least(v, 0, f"{path}.values[{i}]") for i, v in enumerate(raw))
    return Empirical(values, min_value)
