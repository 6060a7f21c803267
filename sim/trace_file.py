"""Read a request trace: CSV (with a header) or JSONL, one request per line.

Fields (aliases in brackets): `arrival_s` [arrival_time, timestamp], `prompt_tokens` [prompt_len,
input_length], `output_tokens` [output_len, output_length], optional `prefix_group` [group] and
`prefix_tokens` (length of the shared prefix; `prompt_tokens` includes it). Records are returned
sorted by arrival time, stably (ties keep file order).
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.sim.validate import int_at_least, non_negative

_ALIASES = {
    "arrival_s": ("arrival_s", "arrival_time", "timestamp"),
    "prompt_tokens": ("prompt_tokens", "prompt_len", "input_length"),
    "output_tokens": ("output_tokens", "output_len", "output_length"),
    "prefix_group": ("prefix_group", "group"),
    "prefix_tokens": ("prefix_tokens",),
}
_REQUIRED = ("arrival_s", "prompt_tokens", "output_tokens")


@dataclass(slots=True, frozen=True)
class TraceRecord:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: Optional[str] = None
    prefix_tokens: int = 0


def _pick(row: dict[str, Any], name: str) -> Any:
    for alias in _ALIASES[name]:
        value = row.get(alias)
        if value not in (None, ""):
            return value
    return None


def _record(row: dict[str, Any], where: str) -> TraceRecord:
    vals = {name: _pick(row, name) for name in _ALIASES}
    for name in _REQUIRED:
        if vals[name] is None:
            raise ConfigError(f"{where}.{name}", "required field is missing")
    arrival = non_negative(vals["arrival_s"], f"{where}.arrival_s")
    prompt = int_at_least(_int(vals["prompt_tokens"], f"{where}.prompt_tokens"), 1,
                          f"{where}.prompt_tokens")
    output = int_at_least(_int(vals["output_tokens"], f"{where}.output_tokens"), 1,
                          f"{where}.output_tokens")
    group = None if vals["prefix_group"] is None else str(vals["prefix_group"])
    prefix = 0
    if vals["prefix_tokens"] is not None:
        prefix = int_at_least(_int(vals["prefix_tokens"], f"{where}.prefix_tokens"), 0,
                              f"{where}.prefix_tokens")
    if prefix and group is None:
        raise ConfigError(f"{where}.prefix_group", "required when prefix_tokens > 0")
    if prefix > prompt:
        raise ConfigError(f"{where}.prefix_tokens", f"{prefix} exceeds prompt_tokens {prompt}")
    return TraceRecord(arrival, prompt, output, group, prefix)


def _int(value: Any, where: str) -> int:
    if isinstance(value, str):
        try:
            f = float(value)
        except ValueError:
            raise ConfigError(f"{where}", f"must be an integer, got {value!r}") from None
        if not f.is_integer():
            raise ConfigError(f"{where}", f"must be an integer, got {value!r}")
        return int(f)
    return value


def load_trace(path: str | Path, field_path: str = "workload.arrival.path") -> list[TraceRecord]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{field_path}", f"trace file not found: {p}")
    records: list[TraceRecord] = []
    with open(p, encoding="utf-8", newline="") as f:
        if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConfigError(f"{p}:{lineno}", f"invalid JSON: {exc}") from None
                    if not isinstance(row, dict):
                        raise ConfigError(f"{p}:{lineno}", "each line must be a JSON object")
                    records.append(_record(row, f"{p}:{lineno}"))
        else:
            for lineno, row in enumerate(csv.DictReader(f), 2):
                records.append(_record(row, f"{p}:{lineno}"))
    if not records:
        raise ConfigError(f"{field_path}", f"trace file {p} holds no requests")
    order = sorted(range(len(records)), key=lambda i: records[i].arrival_s)
    return [records[i] for i in order]
