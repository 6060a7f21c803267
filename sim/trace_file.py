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
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import MAX_TRACE_FILE_BYTES, check_file_size, check_tokens, decode_utf8, load_json_text
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
    # bounded before anything of that length is built (a prompt of 10^10 tokens asked numpy for 74.5 GiB)
    prompt = check_tokens(int_at_least(_int(vals["prompt_tokens"], f"{where}.prompt_tokens"), 1,
                                       f"{where}.prompt_tokens"), f"{where}.prompt_tokens")
    output = check_tokens(int_at_least(_int(vals["output_tokens"], f"{where}.output_tokens"), 1,
                                       f"{where}.output_tokens"), f"{where}.output_tokens")
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


def _read_rows(p: Path, field_path: str) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(where, row) of every request line, and the column names found. The file's size is checked before
    it is read; bad UTF-8, a line nested too deep and an oversized CSV field are errors naming the line."""
    check_file_size(p, field_path, MAX_TRACE_FILE_BYTES)
    rows: list[tuple[str, dict[str, Any]]] = []
    columns: dict[str, None] = {}
    with open(p, "rb") as f:
        data = f.read(MAX_TRACE_FILE_BYTES + 1)
    text = decode_utf8(data, p, field_path)  # a leading BOM (spreadsheets write one) is dropped
    del data
    if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                row = load_json_text(line, "this line", f"{p}:{lineno}")
                if not isinstance(row, dict):
                    raise ConfigError(f"{p}:{lineno}", "each line must be a JSON object")
                columns.update(dict.fromkeys(row))
                rows.append((f"{p}:{lineno}", row))
        return rows, list(columns)
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        columns.update(dict.fromkeys(reader.fieldnames or []))
        for row in reader:
            rows.append((f"{p}:{reader.line_num}", row))
    except csv.Error as e:  # e.g. a field over csv's 131072-character limit: not a trace
        raise ConfigError(f"{p}:{reader.line_num}", f"not a valid CSV line ({e})") from None
    return rows, list(columns)


def _shown_columns(found: list[str]) -> str:
    """The columns found, for an error: only when they look like column names (a file that is not a
    trace, e.g. /proc/self/environ or a secret, is not echoed into the message or a CI log)."""
    if found and len(found) <= 32 and all(len(c) <= 64 and c.replace("_", "").replace(" ", "").replace("-", "")
                                          .isalnum() for c in found if isinstance(c, str)):
        return ", ".join(c for c in found if isinstance(c, str))
    return "(none that look like column names: is it a CSV with a header line, or JSONL?)"


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
    rows, found = _read_rows(p, field_path)
    if columns:
        spec = mapped_format(columns, time_unit, hash_block_tokens, base)
    else:
        name = detect_format(found) if fmt == "auto" else (None if fmt == "servetwin" else fmt)
        spec = KNOWN_FORMATS.get(name) if name else None
        if spec is None and not all(any(a in found for a in _ALIASES[k]) for k in _REQUIRED):
            raise ConfigError(f"{field_path}", f"{p} has columns {_shown_columns(found)}; accepted: "
                             f"{accepted_columns()}; or map yours with {base}.columns")
        if spec is not None and not {spec.columns[k] for k in _REQUIRED} <= set(found):
            raise ConfigError(f"{field_path}", f"{p} has columns {_shown_columns(found)}, not the {spec.name} "
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
