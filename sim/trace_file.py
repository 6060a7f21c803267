"""Read a request trace: CSV (with a header) or JSONL, one request per line.

Fields (aliases in brackets): `arrival_s` [arrival_time, timestamp], `prompt_tokens` [prompt_len,
input_length], `output_tokens` [output_len, output_length], optional `prefix_group` [group] and
`prefix_tokens` (length of the shared prefix; `prompt_tokens` includes it), or `hash_ids` (the prompt's
block hash ids: equal ids are equal token blocks). Published formats (Azure, BurstGPT, Mooncake) and
any column mapping: `servetwin.sim.trace_formats` (docs/workloads.md). Records are returned sorted by
arrival time, stably (ties keep file order).
"""
from __future__ import annotations

import csv
import json
import logging
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
    hash_ids: Optional[tuple[int, ...]] = None


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
            raise ConfigError(f"{where}.{name}", f"required field is missing")
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
        raise ConfigError(f"{where}.prefix_group", f"required when prefix_tokens > 0")
    if prefix > prompt:
        raise ConfigError(f"{where}.prefix_tokens", f"{prefix} exceeds prompt_tokens {prompt}")
    hash_ids = row.get("hash_ids")
    if hash_ids is not None and group is not None:
        raise ConfigError(f"{where}.hash_ids", f"give either hash_ids or prefix_group, not both")
    return TraceRecord(arrival, prompt, output, group, prefix,
                       None if hash_ids is None else _hash_ids(hash_ids, f"{where}.hash_ids"))


def _hash_ids(value: Any, where: str) -> tuple[int, ...]:
    from servetwin.sim.trace_formats import parse_hash_ids  # noqa: PLC0415

    return value if isinstance(value, tuple) else parse_hash_ids(value, where)


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


def _read_rows(p: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(where, row) of every request line, and the column names found."""
    rows: list[tuple[str, dict[str, Any]]] = []
    columns: dict[str, None] = {}
    with open(p, encoding="utf-8", newline="") as f:
        if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConfigError(f"{p}:{lineno}", f"invalid JSON: {exc}") from None
                    if not isinstance(row, dict):
                        raise ConfigError(f"{p}:{lineno}", f"each line must be a JSON object")
                    columns.update(dict.fromkeys(row))
                    rows.append((f"{p}:{lineno}", row))
        else:
            reader = csv.DictReader(f)
            columns.update(dict.fromkeys(reader.fieldnames or []))
            rows = [(f"{p}:{lineno}", row) for lineno, row in enumerate(reader, 2)]
    return rows, list(columns)


def load_trace(path: str | Path, field_path: str = "workload.arrival.path", fmt: str = "auto",
               columns: Optional[dict[str, str]] = None, time_unit: str = "s",
               hash_block_tokens: Optional[int] = None) -> list[TraceRecord]:
    """The trace's records; `fmt` is auto (by the columns), servetwin, azure, burstgpt or mooncake, or a
    `columns` mapping with `time_unit` (`servetwin.sim.trace_formats`)."""
    from servetwin.sim.trace_formats import (FORMAT_NAMES, KNOWN_FORMATS, accepted_columns,  # noqa: PLC0415
                                             detect_format, mapped_format, normalize)

    base = field_path.rsplit(".", 1)[0]
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{field_path}", f"trace file not found: {p}")
    if fmt not in FORMAT_NAMES:
        raise ConfigError(f"{base}.format", f"must be one of {', '.join(FORMAT_NAMES)}, got {fmt!r}")
    rows, found = _read_rows(p)
    if columns:
        spec = mapped_format(columns, time_unit, hash_block_tokens, base)
    else:
        name = detect_format(found) if fmt == "auto" else (None if fmt == "servetwin" else fmt)
        spec = KNOWN_FORMATS.get(name) if name else None
        if spec is None and not all(any(a in found for a in _ALIASES[k]) for k in _REQUIRED):
            raise ConfigError(f"{field_path}", f"{p} has columns {', '.join(found) or '(none)'}; accepted: "
                             f"{accepted_columns()}; or map yours with {base}.columns")
        if spec is not None and not {spec.columns[k] for k in _REQUIRED} <= set(found):
            raise ConfigError(f"{field_path}", f"{p} has columns {', '.join(found) or '(none)'}, not the {spec.name} "
                             f"columns {', '.join(spec.columns[k] for k in _REQUIRED)}")
    if spec is not None:
        rows, skipped = normalize(rows, spec)
        if skipped:
            logging.getLogger("servetwin").warning("%s: skipped %d failed requests (0 output tokens)", p, skipped)
    records = [_record(row, where) for where, row in rows]
    if not records:
        raise ConfigError(f"{field_path}", f"trace file {p} holds no requests")
    order = sorted(range(len(records)), key=lambda i: records[i].arrival_s)
    return [records[i] for i in order]
