"""Bounds on untrusted input, shared by every reader (config YAML, scenario JSON, traces, model configs,
HTTP bodies): nesting depth, file size, and reading a file as text without ever echoing its content.

Each bound is checked before the expensive step it protects (a file's size before it is read, a
document's nesting before a recursive walk), and a violation is a `ConfigError` naming the field or
file, never a `RecursionError` / `MemoryError` / `UnicodeDecodeError` traceback. The numbers are far
above any real input: a real experiment YAML nests 5 levels, a chat request 6, a model config 4.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Optional

from servetwin.core.config_error import ConfigError

MAX_NESTING_DEPTH = 64  # containers inside containers (JSON / YAML / scenario / trace line / HTTP body)
MAX_DOCUMENT_NODES = 1_000_000  # YAML nodes after alias expansion (a real config has a few hundred)
MAX_CONFIG_FILE_BYTES = 16 * 1024 * 1024  # experiment YAML, scenario JSON, model config.json, hardware YAML
MAX_TRACE_FILE_BYTES = 512 * 1024 * 1024  # a request trace (CSV / JSONL); rows are held in memory
MAX_TOKENS_PER_REQUEST = 1 << 24  # prompt or output tokens of one synthetic / traced request (16.7M)
# what vLLM wrote (importers: profiler traces, bench results, server logs): a file, or what a .gz inflates to.
# 256 MB of JSON parses to well under 2 GB (the Chrome trace reader keeps only the step ranges).
MAX_IMPORT_FILE_BYTES = 256 * 1024 * 1024
MAX_IMPORT_NUMBER = 1 << 53  # any count or microsecond figure of an imported file (exact in a float64)
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20


def nesting_depth(value: Any, limit: int = MAX_NESTING_DEPTH) -> int:
    """Depth of nested lists / dicts in `value` (a scalar is 0), walked without recursion; stops and
    returns `limit + 1` as soon as the depth passes `limit`."""
    deepest = 0
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return deepest


def check_depth(value: Any, where: str, limit: int = MAX_NESTING_DEPTH) -> Any:
    """`value`, or a `ConfigError` at `where` when it nests deeper than `limit`."""
    if nesting_depth(value, limit) > limit:
        raise ConfigError(where, f"nested more than {limit} levels deep")
    return value


def check_file_size(path: str | os.PathLike, where: str, limit: int) -> None:
    """Refuse a file larger than `limit` bytes before it is read, and what is not a regular file
    (`/proc/self/mem`, a FIFO, a device: their size says nothing and reading them may block or fail)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(where, f"file not found: {path}") from None
    except OSError as e:
        raise ConfigError(where, f"cannot read {path}: {e.strerror or type(e).__name__}") from None
    import stat  # noqa: PLC0415

    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(where, f"{path} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode) or str(os.path.realpath(path)).startswith(("/proc/", "/sys/", "/dev/")):
        raise ConfigError(where, f"{path} is not a regular file")
    if st.st_size > limit:
        raise ConfigError(where, f"{path} is {st.st_size} bytes, more than the limit of {limit} bytes")


def read_text(path: str | os.PathLike, where: str, limit: int = MAX_CONFIG_FILE_BYTES) -> str:
    """The file's text (UTF-8, a leading BOM dropped), size-checked first. Errors name `where` and the
    file and say what is wrong (a byte offset for bad UTF-8), never quoting the content."""
    check_file_size(path, where, limit)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(where, f"cannot read {path}: {e.strerror or type(e).__name__}") from None
    if len(data) > limit:
        raise ConfigError(where, f"{path} is more than the limit of {limit} bytes")
    return decode_utf8(data, path, where)


def read_bytes(path: str | os.PathLike, where: str, limit: int = MAX_IMPORT_FILE_BYTES) -> bytes:
    """The file's bytes, inflated when it is gzip (told by its first bytes, not its name): the regular-file
    and size checks come before it is opened (a FIFO, a folder, `/dev/zero` behind a symlink are refused,
    never read), and gzip is inflated in chunks, refused as soon as it passes `limit` (a bomb never reaches
    memory). The one reader of every importer (`servetwin import ...`, `calibrate --from-vllm`,
    `compare --measured`)."""
    check_file_size(path, where, limit)
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            data = _inflate(f, path, where, limit) if head == _GZIP_MAGIC else f.read(limit + 1)
    except OSError as e:
        raise ConfigError(where, f"cannot read {path}: {e.strerror or type(e).__name__}") from None
    if len(data) > limit:
        raise ConfigError(where, f"{path} is more than the limit of {limit} bytes")
    return data


def _inflate(f: Any, path: Any, where: str, limit: int) -> bytes:
    import gzip  # noqa: PLC0415
    import zlib  # noqa: PLC0415

    parts, total = [], 0
    try:
        with gzip.GzipFile(fileobj=f, mode="rb") as z:
            while chunk := z.read(_CHUNK):
                total += len(chunk)
                if total > limit:
                    raise ConfigError(where, f"{path} inflates to more than the limit of {limit} bytes "
                                             "(a decompression bomb, or a trace too large to import whole)")
                parts.append(chunk)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ConfigError(where, f"{path} is not a readable gzip file (truncated?): {_short(e)}") from None
    return b"".join(parts)


def read_head(path: str | os.PathLike, where: str, size: int = 4096) -> bytes:
    """The first `size` bytes of a file (inflated when gzip), after the same checks as `read_bytes`: what
    a reader needs to tell a file's kind without reading it whole."""
    import gzip  # noqa: PLC0415
    import zlib  # noqa: PLC0415

    check_file_size(path, where, 1 << 62)
    try:
        with open(path, "rb") as f:
            head = f.read(size)
            if head[:2] != _GZIP_MAGIC:
                return head
            f.seek(0)
            with gzip.GzipFile(fileobj=f, mode="rb") as z:
                return z.read(size)
    except (EOFError, zlib.error, gzip.BadGzipFile):
        return head  # a damaged gzip: its reader names it
    except OSError as e:
        raise ConfigError(where, f"cannot read {path}: {e.strerror or type(e).__name__}") from None


def printable(text: Any, limit: int = 200) -> str:
    """`text` safe to echo to a terminal: control characters (ESC, BEL, CR, C1 ...) shown as escapes,
    never sent raw (a file could set the terminal title or clear the screen), cut to `limit` characters."""
    s = str(text)
    if len(s) > limit:
        s = s[:limit - 3] + "..."
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in s)


def bounded_number(value: Any, where: str, low: float = 0.0, high: float = MAX_IMPORT_NUMBER,
                   integer: bool = False, low_open: bool = False) -> float:
    """A number of an untrusted document, checked before any arithmetic (an int of 400 digits would
    overflow numpy / pyarrow, `1e400` parses as inf): finite, in [low, high] (`low_open`: > low),
    whole when `integer`. A `ConfigError` at `where` otherwise, the value shown cut."""
    span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where, f"must be a number in {span}, got {_short_repr(value)}")
    # an int is compared as an int (10**400 would overflow float()), a float checked for inf / nan
    v = float(value) if low <= value <= high else math.nan
    if not math.isfinite(v) or (low_open and v <= low):
        raise ConfigError(where, f"must be a finite number in {span}, got {_short_repr(value)}")
    if integer and not v.is_integer():
        raise ConfigError(where, f"must be an integer in {span}, got {_short_repr(value)}")
    return v


def _short_repr(value: Any, limit: int = 40) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** limit:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def decode_utf8(data: bytes, path: Any, where: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(where, f"{path} is not UTF-8 text (invalid byte at offset {e.start}; a binary "
                                 "file?)") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        shown = dup if len(dup) <= 60 else dup[:57] + "..."
        raise ValueError(f"duplicate key {shown!r}")
    return out


def load_json_text(text: str, path: Any, where: str, limit: int = MAX_NESTING_DEPTH, unique_keys: bool = False,
                   object_hook: Optional[Callable[[dict], Any]] = None) -> Any:
    """`json.loads` for untrusted text: nesting, huge integers and syntax errors are `ConfigError`s at
    `where` that name `path` and the position, never the text itself. `unique_keys`: a key given twice
    in one object is an error (json keeps the last one silently). `object_hook`: json's, each object
    replaced by what it returns as it is parsed (a reader that keeps a few keys of millions of objects)."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys if unique_keys else None, object_hook=object_hook)
    except RecursionError:
        raise ConfigError(where, f"{path} is nested more than {limit} levels deep") from None
    except json.JSONDecodeError as e:
        raise ConfigError(where, f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # an integer over sys.get_int_max_str_digits() digits, a duplicate key
        text = "an integer of too many digits" if "digits" in str(e) else _short(e)
        raise ConfigError(where, f"{path} is not valid JSON ({text})") from None
    if nesting_depth(value, limit) > limit:
        raise ConfigError(where, f"{path} is nested more than {limit} levels deep")
    return value


def load_json_file(path: str | os.PathLike, where: str, max_bytes: int = MAX_CONFIG_FILE_BYTES,
                   unique_keys: bool = False) -> Any:
    return load_json_text(read_text(path, where, max_bytes), path, where, unique_keys=unique_keys)


def read_import_text(path: str | os.PathLike, where: str, limit: int = MAX_IMPORT_FILE_BYTES) -> str:
    """An importer's file as text: `read_bytes` (checks, size and inflated-size limits), then UTF-8."""
    data = read_bytes(path, where, limit)
    return decode_utf8(data, path, where)


def _short(e: BaseException, limit: int = 120) -> str:
    """An exception's text, cut (a parser's message may quote the input)."""
    text = str(e).split("\n", 1)[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_tokens(value: int, where: str, limit: Optional[int] = None) -> int:
    """A token count checked against `limit` (default MAX_TOKENS_PER_REQUEST) before anything of that
    size is built."""
    limit = MAX_TOKENS_PER_REQUEST if limit is None else limit
    if value > limit:
        raise ConfigError(where, f"{int(value)} tokens is more than the limit of {limit}")
    return value


__all__ = ["MAX_NESTING_DEPTH", "MAX_DOCUMENT_NODES", "MAX_CONFIG_FILE_BYTES", "MAX_TRACE_FILE_BYTES",
           "MAX_TOKENS_PER_REQUEST", "MAX_IMPORT_FILE_BYTES", "MAX_IMPORT_NUMBER", "nesting_depth", "check_depth",
           "check_file_size", "read_text", "read_bytes", "read_head", "read_import_text", "printable",
           "bounded_number", "decode_utf8", "load_json_text", "load_json_file", "check_tokens"]
