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
import dataclasses
import heapq
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import MAX_TRACE_FILE_BYTES, check_file_size, check_tokens, load_json_text
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


class _Rows:
    """The request lines of a trace file, streamed: (where, row) one at a time, never the whole file in
    memory (a 10M-line CSV held as rows took 6.5 GB). `columns`: the CSV header, or the first JSON line's
    keys. Bad UTF-8, a line nested too deep and an oversized CSV field are errors naming the line."""

    def __init__(self, p: Path, field_path: str) -> None:
        check_file_size(p, field_path, MAX_TRACE_FILE_BYTES)  # a FIFO or device is refused before opening
        self.p, self.field_path = p, field_path
        self.jsonl = p.suffix.lower() in (".jsonl", ".json", ".ndjson")
        self.f = open(p, "rb")
        self.lineno = 0
        self.reader = None if self.jsonl else csv.DictReader(self._lines())
        self.first: Optional[tuple[str, dict[str, Any]]] = None
        if self.jsonl:
            self.first = next(self._json_rows(), None)
            self.columns = list(self.first[1]) if self.first else []
        else:
            self.columns = list(self._csv(lambda: self.reader.fieldnames) or [])

    def _lines(self):
        """Each line decoded on its own: a bad byte is named by its line, however far into the file."""
        for raw in self.f:
            self.lineno += 1
            try:
                yield raw.decode("utf-8-sig" if self.lineno == 1 else "utf-8")  # a spreadsheet's BOM dropped
            except UnicodeDecodeError as e:
                raise ConfigError(self.field_path, f"{self.p} is not UTF-8 text (invalid byte on line "
                                                   f"{self.lineno}, offset {e.start}; a binary file?)") from None

    def _csv(self, step):
        try:
            return step()
        except csv.Error as e:  # e.g. a field over csv's 131072-character limit: not a trace
            raise ConfigError(f"{self.p}:{self.reader.line_num}", f"not a valid CSV line ({e})") from None

    def _json_rows(self):
        for line in self._lines():
            if line.strip():
                where = f"{self.p}:{self.lineno}"
                row = load_json_text(line, "this line", where)
                if not isinstance(row, dict):
                    raise ConfigError(where, "each line must be a JSON object")
                yield where, row

    def __iter__(self):
        if self.jsonl:
            if self.first is not None:
                yield self.first
            yield from self._json_rows()
            return
        while True:
            row = self._csv(lambda: next(self.reader, None))
            if row is None:
                return
            yield f"{self.p}:{self.reader.line_num}", row

    def close(self) -> None:
        self.f.close()


def _shown_columns(found: list[str]) -> str:
    """The columns found, for an error: only when they look like column names (a file that is not a
    trace, e.g. /proc/self/environ or a secret, is not echoed into the message or a CI log)."""
    if found and len(found) <= 32 and all(len(c) <= 64 and c.replace("_", "").replace(" ", "").replace("-", "")
                                          .isalnum() for c in found if isinstance(c, str)):
        return ", ".join(c for c in found if isinstance(c, str))
    return "(none that look like column names: is it a CSV with a header line, or JSONL?)"


def load_trace(path: str | Path, field_path: str = "workload.arrival.path", fmt: str = "auto",
               columns: Optional[dict[str, str]] = None, time_unit: str = "s",
               hash_block_tokens: Optional[int] = None, limit: Optional[int] = None,
               log: Optional[Callable[[str], None]] = None) -> list[TraceRecord]:
    """The trace's records; `fmt` is auto (by the columns), servetwin, azure, burstgpt or mooncake, or a
    `columns` mapping with `time_unit` (`servetwin.sim.trace_formats`). `limit`: keep only the `limit`
    earliest (a run of `requests: N` uses no more; every line is still checked). `log`: a progress line
    every PROGRESS_EVERY_LINES lines (default: stderr)."""
    from servetwin.sim.trace_formats import (FORMAT_NAMES, KNOWN_FORMATS, accepted_columns,  # noqa: PLC0415
                                             detect_format, mapped_format)

    base = field_path.rsplit(".", 1)[0]
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{field_path}", f"trace file not found: {p}")
    if fmt not in FORMAT_NAMES:
        raise ConfigError(f"{base}.format", f"must be one of {', '.join(FORMAT_NAMES)}, got {fmt!r}")
    rows = _Rows(p, field_path)
    try:
        found = rows.columns
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
        records, lines, skipped = _earliest(rows, spec, limit, log or _log_progress, p)
    finally:
        rows.close()
    if skipped:
        logging.getLogger("servetwin").warning("%s: skipped %d failed requests (0 output tokens)", p, skipped)
    if not records:
        raise ConfigError(f"{field_path}", f"trace file {p} holds no requests")
    if spec is not None:  # a published format's times start at its first request
        t0 = records[0].arrival_s
        records = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in records]
    return records


PROGRESS_EVERY_LINES = 250_000  # a 10M-line trace reads for minutes on a loaded machine: a line per 250k


def _log_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _earliest(rows: Iterable[tuple[str, dict[str, Any]]], spec: Any, limit: Optional[int],
              log: Callable[[str], None], p: Path) -> tuple[list[TraceRecord], int, int]:
    """Every line checked, the `limit` earliest records kept (all without a limit), sorted by arrival
    stably (ties keep file order): memory bounded by the requests the run uses, not the file's lines.
    Returns (records, lines read, failed requests skipped)."""
    from servetwin.sim.trace_formats import normalize_row  # noqa: PLC0415

    kept: list[tuple[float, int, TraceRecord]] = []  # a max-heap of the earliest, by (-arrival, -index)
    skipped = lines = 0
    for lines, (where, row) in enumerate(rows, start=1):
        if spec is not None:
            row = normalize_row(where, row, spec)
            if row is None:
                skipped += 1
                continue
        record = _record(row, where)
        if limit is None:
            kept.append((record.arrival_s, lines, record))
        elif len(kept) < limit:
            heapq.heappush(kept, (-record.arrival_s, -lines, record))
        elif (-record.arrival_s, -lines) > kept[0][:2]:
            heapq.heapreplace(kept, (-record.arrival_s, -lines, record))
        if lines % PROGRESS_EVERY_LINES == 0:
            log(f"workload: read {lines:,} lines of {p}" + (f" (keeping the {limit:,} earliest)" if limit else ""))
    if limit is None:
        kept.sort(key=lambda k: (k[0], k[1]))
        return [r for _, _, r in kept], lines, skipped
    kept.sort(key=lambda k: (-k[0], -k[1]))
    return [r for _, _, r in kept], lines, skipped
