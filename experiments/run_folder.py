"""An output folder that never lies: one writer at a time, no stale files, the summary written last.

The protocol every folder-writing command (`run`, `sweep`, `compare`) follows:

1. `acquire()` before any work: create the folder if needed and take an exclusive `flock` on it
   (a second run into the same folder fails at once, exit 2 naming the flag); a non-empty folder is
   refused unless `overwrite` (its contents are left as they are).
2. the run does its work; if it fails here (a bad engine setting, a model that is not there), the
   folder is as it was (a folder this run created is removed again).
3. `begin()` right before the first file is written: with `overwrite`, the old summary goes first,
   then everything else (old backends' folders, plots) - files this run writes are written anew.
4. every file goes through `write_json` / `write_text` / `write_with` (temporary name, then rename),
   the summary file last: its presence and its `interrupted` flag are the truth about the folder.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from typing import Any, Callable, Optional

from servetwin.core.testbed.atomic import atomic_open, atomic_write_with
from servetwin.experiments.schema import ConfigError, ensure_output_dir


def _json_default(o: Any) -> Any:
    import numpy as np  # noqa: PLC0415

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


class RunFolder:
    def __init__(self, path: str, flag: str = "-o/--output", overwrite: bool = False,
                 keep: tuple[str, ...] = ()) -> None:
        self.path = path
        self.flag = flag
        self.overwrite = overwrite
        self.keep = set(keep)  # names the caller wrote itself before handing the folder over (run.log)
        self.written: list[str] = []  # paths relative to the folder, in write order
        self._fd: Optional[int] = None
        self._created = False
        self._begun = False

    # -- ownership -----------------------------------------------------------------------------
    def acquire(self) -> "RunFolder":
        self._created = ensure_output_dir(self.path, self.flag)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(self.flag, f"{self.path} is being written by another run right now; "
                              "wait for it or choose another folder") from None
        self._fd = fd
        existing = sorted(set(os.listdir(self.path)) - self.keep)
        if existing and not self.overwrite:
            self.release()
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            raise ConfigError(self.flag, f"{self.path} is not empty ({shown}); pass --overwrite to replace "
                              "its contents, or choose another folder")
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        if self._created and not self._begun:  # failed before writing: leave no trace
            try:
                os.rmdir(self.path)
            except OSError:
                pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunFolder":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def begin(self, summary_name: str = "summary.json") -> None:
        """Clear what an earlier run left (with overwrite), right before this run's first file."""
        if self._begun:
            return
        if self._fd is None:
            raise RuntimeError("RunFolder.begin: acquire() the folder first")
        self._begun = True
        summary = os.path.join(self.path, summary_name)
        if os.path.lexists(summary):  # first: no moment where an old summary vouches for new files
            os.unlink(summary)
        for name in sorted(os.listdir(self.path)):
            if name in self.keep:
                continue
            p = os.path.join(self.path, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)

    # -- writing -------------------------------------------------------------------------------
    def file(self, rel: str) -> str:
        """Absolute path of `rel` inside the folder, its parent folders created."""
        if not self._begun:
            self.begin()
        path = os.path.join(self.path, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def subdir(self, rel: str) -> str:
        """Absolute path of the folder `rel` inside this one, created (the run's first write clears first)."""
        if not self._begun:
            self.begin()
        path = os.path.join(self.path, rel)
        os.makedirs(path, exist_ok=True)
        return path

    def record(self, rel: str) -> str:
        """Note a file written complete (by this class, or renamed into place by the caller)."""
        self.written.append(rel)
        return os.path.join(self.path, rel)

    def write_json(self, rel: str, data: Any) -> str:
        with atomic_open(self.file(rel)) as f:
            json.dump(data, f, indent=2, default=_json_default)
        return self.record(rel)

    def write_text(self, rel: str, text: str) -> str:
        with atomic_open(self.file(rel)) as f:
            f.write(text)
        return self.record(rel)

    def write_with(self, rel: str, writer: Callable[[str], None]) -> str:
        """`writer(temporary path)` (to_parquet, savefig with an explicit format), then rename."""
        atomic_write_with(self.file(rel), writer)
        return self.record(rel)

    def describe(self) -> str:
        """What was written, for the CLI's last line (`config.yaml, report.md, sim/ (5 files), ...`)."""
        top, sub = [], {}
        for rel in self.written:
            head, _, rest = rel.partition(os.sep)
            if rest:
                sub[head] = sub.get(head, 0) + 1
            else:
                top.append(rel)
        parts = top + [f"{d}/ ({n} file{'s' if n != 1 else ''})" for d, n in sub.items()]
        return ", ".join(parts) if parts else "nothing"


def folder_summary_state(path: str, summary_name: str = "summary.json") -> Optional[dict]:
    """The summary a folder holds (None when absent or unreadable): what an interrupted run can claim."""
    try:
        with open(os.path.join(path, summary_name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
