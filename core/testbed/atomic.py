"""Atomic file writes: write under a temporary name beside the target, rename it into place.

A reader (or a later run) sees either the old file, no file, or the complete new one: never a
truncated file, whatever stops the writer (Ctrl-C, a full disk, an exception). The temporary file
lives in the target's folder so the final `os.replace` is a same-filesystem rename (atomic on POSIX).
"""
from __future__ import annotations

import contextlib
import os
import uuid
from typing import IO, Callable, Iterator

TMP_MARK = ".tmp-"  # temporary names: .NAME.tmp-XXXXXXXX (hidden, recognisable, cleaned on failure)

# Callbacks told each final path before a file is renamed into place (innermost last). An output folder
# lists its files this way before they exist (`experiments/run/run_folder.py`), so an output phase cut
# short leaves no file the folder's list lacks; forked writers inherit the list.
_placing_hooks: list[Callable[[str], None]] = []


@contextlib.contextmanager
def announcing_writes(hook: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, `hook(final path)` is called before every atomic write here renames its
    file into place (nested: the innermost hook alone)."""
    _placing_hooks.append(hook)
    try:
        yield
    finally:
        _placing_hooks.remove(hook)


def _place(tmp: str, path: str) -> None:
    if _placing_hooks:
        _placing_hooks[-1](os.path.abspath(path))
    os.replace(tmp, path)


def temp_path(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}{TMP_MARK}{uuid.uuid4().hex[:8]}")


def _discard(tmp: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """`open(path, mode)` whose result appears at `path` only if the `with` block completes."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode: atomic_open writes whole files ('w' or 'wb'), got {mode!r}")
    tmp = temp_path(path)
    try:
        binary = mode == "wb"
        with open(tmp, "xb" if binary else "x", encoding=None if binary else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        _place(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def atomic_write_with(path: str, writer: Callable[[str], None]) -> None:
    """For writers that take a path (`DataFrame.to_parquet`, `Figure.savefig`): `writer(tmp)`, then
    rename. Writers that infer a format from the file name must be told the format explicitly."""
    tmp = temp_path(path)
    try:
        writer(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _place(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def staged_folder(out_dir: str) -> Iterator[str]:
    """A hidden temporary folder inside `out_dir` for writers that write several files by path
    (plots). When the block completes, each file in it is renamed into `out_dir` (one atomic rename
    per file); whatever stops the block, the stage is removed and `out_dir` gets no partial file."""
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    os.makedirs(out_dir, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".stage{TMP_MARK}", dir=out_dir)
    try:
        yield stage
        for name in sorted(os.listdir(stage)):
            _place(os.path.join(stage, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
