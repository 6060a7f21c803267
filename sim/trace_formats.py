"""The request-trace formats people publish, mapped onto servetwin's trace fields.

servetwin's fields: `arrival_s` (seconds since the first request), `prompt_tokens`, `output_tokens`, and
optionally `prefix_group` / `prefix_tokens`, or `hash_ids` (a request's prompt as a list of block hash ids).

| format | file | arrival | prompt | output | other |
|---|---|---|---|---|---|
| `azure` (Azure LLM inference traces 2023/2024) | CSV | `TIMESTAMP` (a datetime) | `ContextTokens` | `GeneratedTokens` | |
| `burstgpt` (BurstGPT) | CSV | `Timestamp` (s) | `Request tokens` | `Response tokens` | `Model`, `Total tokens`, `Log Type` ignored; failed requests (0 response tokens) skipped |
| `mooncake` (Mooncake / Kimi traces) | JSONL | `timestamp` (ms) | `input_length` | `output_length` | `hash_ids`: one id per 512-token block |
| `servetwin` | CSV / JSONL | `arrival_s` | `prompt_tokens` | `output_tokens` | `prefix_group`, `prefix_tokens`, `hash_ids` |

`format: auto` (the default) picks the format whose columns the file has (Mooncake: with `hash_ids`). Any other file maps its own
columns: `columns: {arrival_s: ts, prompt_tokens: n_in, output_tokens: n_out}` with `time_unit: s | ms |
us | datetime`. Arrival times are shifted so that the first request arrives at 0.
"""
from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import check_tokens

FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "prefix_group", "prefix_tokens", "hash_ids")
REQUIRED = ("arrival_s", "prompt_tokens", "output_tokens")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "datetime": None}


@dataclass(slots=True, frozen=True)
class TraceFormat:
    name: str
    columns: dict[str, str]  # servetwin field -> the file's column
    time_unit: str
    hash_block_tokens: Optional[int] = None  # tokens behind one hash id
    skip_zero_output: bool = False  # rows with 0 output tokens are failed requests, not requests


KNOWN_FORMATS: dict[str, TraceFormat] = {
    "azure": TraceFormat("azure", {"arrival_s": "TIMESTAMP", "prompt_tokens": "ContextTokens",
                                   "output_tokens": "GeneratedTokens"}, "datetime"),
    "burstgpt": TraceFormat("burstgpt", {"arrival_s": "Timestamp", "prompt_tokens": "Request tokens",
                                         "output_tokens": "Response tokens"}, "s", skip_zero_output=True),
    "mooncake": TraceFormat("mooncake", {"arrival_s": "timestamp", "prompt_tokens": "input_length",
                                         "output_tokens": "output_length", "hash_ids": "hash_ids"}, "ms",
                            hash_block_tokens=512),
}
FORMAT_NAMES = ("auto", "servetwin", *KNOWN_FORMATS)


def accepted_columns() -> str:
    """The column sets every format accepts, for an error message."""
    parts = [f"{name}: {', '.join(f.columns[k] for k in REQUIRED)}" for name, f in KNOWN_FORMATS.items()]
    return "; ".join(parts + ["servetwin: arrival_s (or arrival_time, timestamp), prompt_tokens (or prompt_len, "
                              "input_length), output_tokens (or output_len, output_length)"])


def detect_format(columns: list[str]) -> Optional[str]:
    """The known format whose columns the file has (None: servetwin's own names). Mooncake is recognised
    by `hash_ids` as well: its `timestamp` / `input_length` / `output_length` alone are also servetwin
    aliases (with `timestamp` in seconds, where Mooncake's is in milliseconds: say `format: mooncake`)."""
    have = set(columns)
    for name, f in KNOWN_FORMATS.items():
        if set(f.columns.values()) <= have:
            return name
    return None


def parse_datetime(value: Any, where: str) -> float:
    """Seconds since the epoch of an ISO-like datetime; Azure's 7 fractional digits are cut to 6."""
    text = str(value).strip().replace("T", " ")
    head, _, frac = text.partition(".")
    zone = ""
    for sep in ("+", "Z"):
        if sep in frac:
            frac, _, rest = frac.partition(sep)
            zone = sep + rest if sep == "+" else "+00:00"
    frac = (frac + "000000")[:6] if frac else ""
    try:
        t = dt.datetime.fromisoformat(head + (f".{frac}" if frac else "") + zone)
    except ValueError:
        raise ConfigError(f"{where}", f"not a datetime, got {value!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


def _number(value: Any, where: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}", f"must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ConfigError(f"{where}", f"must be finite, got {value!r}")
    return x


def parse_hash_ids(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, str):  # a CSV cell holding a JSON list
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"{where}", f"must be a list of integers, got {value!r}") from None
    if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in value):
        raise ConfigError(f"{where}", f"must be a list of integers, got {value!r}")
    return tuple(value)


def normalize_row(where: str, row: dict[str, Any], fmt: TraceFormat) -> Optional[dict[str, Any]]:
    """One raw row of a file in `fmt` -> the row in servetwin's field names (arrival_s in seconds, not yet
    shifted to start at 0); None for a failed request the format skips."""
    new: dict[str, Any] = {}
    scale = TIME_UNITS[fmt.time_unit]
    for field, col in fmt.columns.items():
        value = row.get(col)
        if value in (None, ""):
            if field in REQUIRED:
                raise ConfigError(f"{where}.{col}", f"required column is empty or missing")
            continue
        if field == "arrival_s":
            value = (parse_datetime(value, f"{where}.{col}") if scale is None
                     else _number(value, f"{where}.{col}") * scale)
        elif field == "hash_ids":
            value = parse_hash_ids(value, f"{where}.{col}")
        elif field in ("prompt_tokens", "output_tokens"):  # bounded under the file's own column name
            check_tokens(_number(value, f"{where}.{col}"), f"{where}.{col}")
        new[field] = value
    if fmt.skip_zero_output and _number(new["output_tokens"], f"{where}.{fmt.columns['output_tokens']}") == 0:
        return None
    return new


def mapped_format(columns: dict[str, Any], time_unit: str, hash_block_tokens: Optional[int], path: str) -> TraceFormat:
    """A user's column mapping (`columns: {arrival_s: ts, ...}`) as a format."""
    for key, col in columns.items():
        if key not in FIELDS:
            raise ConfigError(f"{path}.columns.{key}", f"unknown field (allowed: {', '.join(FIELDS)})")
        if not isinstance(col, str) or not col:
            raise ConfigError(f"{path}.columns.{key}", f"must be a column name, got {col!r}")
    missing = [k for k in REQUIRED if k not in columns]
    if missing:
        raise ConfigError(f"{path}.columns.{missing[0]}", f"required (map {', '.join(REQUIRED)} to the file's columns)")
    if time_unit not in TIME_UNITS:
        raise ConfigError(f"{path}.time_unit", f"must be one of {', '.join(TIME_UNITS)}, got {time_unit!r}")
    return TraceFormat("columns", dict(columns), time_unit, hash_block_tokens)
