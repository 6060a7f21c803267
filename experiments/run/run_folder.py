"""An output folder that never lies: one writer at a time, no stale files, the summary written last.

The protocol every folder-writing command (`run`, `sweep`, `compare`) follows:

1. `acquire()` before any work: create the folder if needed and take an exclusive `flock` on it
   (a second run into the same folder fails at once, exit 2 naming the flag); a non-empty folder is
   refused unless `overwrite` (its contents are left as they are), and even with `overwrite` unless
   servetwin wrote it (`owned_files`): `-o . --overwrite` in a repository is refused, not wiped.
2. the run does its work; if it fails here (a bad engine setting, a model that is not there), the
   folder is as it was (a folder this run created is removed again).
3. `begin()` right before the first file is written: with `overwrite`, the old summary goes first,
   then every other file an earlier run wrote; files servetwin did not write (a notebook the user
   saved there) stay. A fresh marker (`MARKER`) starts the list of what this run writes.
4. every file goes through `write_json` / `write_text` / `write_with` or another atomic write of
   `core.testbed.atomic` (temporary name, then rename), the summary file last: its presence and its
   `interrupted` flag are the truth about the folder. Each file's name is appended to the marker
   *before* it is renamed into place (`atomic.announcing_writes`, inherited by forked writers), so an
   output phase cut short (SIGTERM between two files) leaves no file the marker lacks, and a later
   `--overwrite` knows exactly what is ours.

A folder reached through a symlink gets the same rules (the target is checked, never wiped blindly).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
from typing import Any, Callable, Optional

from servetwin.core.testbed.atomic import TMP_MARK, announcing_writes, atomic_open, atomic_write_text, atomic_write_with
from servetwin.experiments.config.schema import ConfigError, ensure_output_dir

MARKER = ".servetwin-written"  # one relative path a line: the files servetwin wrote into this folder
_MARKER_HEADER = "# servetwin wrote these files here; `--overwrite` removes only them (experiments/run/run_folder.py)\n"
# what a folder written before the marker existed may hold to count as servetwin's: its first file,
# config.yaml, and only kinds of file servetwin writes (a notebook, .git, a script: not ours -> refused)
_OLD_FIRST_FILE = "config.yaml"
_OLD_KINDS = (".json", ".md", ".csv", ".parquet", ".png", ".yaml", ".log")
MAX_MARKER_BYTES = 256 * 1024 * 1024  # a marker's size (a 10M-request sweep lists far fewer files)
_REMOVE_PROGRESS_EVERY = 20_000  # files removed by --overwrite between progress lines


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
        self._owned: Optional[list[str]] = []  # what an earlier run wrote here (cleared by begin)
        self._announcing = contextlib.ExitStack()
        self._announced: set[str] = set()  # names this process appended to the marker

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
            raise ConfigError(self.flag, f"{self.path} is not empty ({_shown(existing)}); pass --overwrite to "
                              "replace what servetwin wrote there, or choose another folder")
        try:
            self._owned = owned_files(self.path, self.keep) if existing else []
        except ConfigError:  # a marker no reader should open
            self.release()
            raise
        if self._owned is None:
            self.release()
            raise ConfigError(self.flag, _not_ours(self.path))
        self._announcing.enter_context(announcing_writes(self._announce))
        return self

    def _announce(self, path: str) -> None:
        """An atomic write is about to rename `path` into place: list it in the marker first (never
        `begin` here: a forked writer's copy of this object may predate the parent's `begin`)."""
        rel = os.path.relpath(path, os.path.abspath(self.path))
        if rel == MARKER or rel.startswith(".." + os.sep) or rel == ".." or "\n" in rel:
            return
        self._append_marker([rel])

    def release(self) -> None:
        if self._fd is None:
            return
        self._announcing.close()
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
        # the summary first: no moment where an old summary vouches for new files
        owned = sorted(self._owned, key=lambda r: r != summary_name)
        real_root = os.path.realpath(self.path)
        for k, rel in enumerate(owned, start=1):
            _remove_owned(self.path, rel, real_root)
            if k % _REMOVE_PROGRESS_EVERY == 0:
                print(f"{self.flag} --overwrite: removed {k:,}/{len(owned):,} files an earlier run wrote",
                      file=sys.stderr, flush=True)
        atomic_write_text(os.path.join(self.path, MARKER), _MARKER_HEADER + "".join(f"{k}\n" for k in sorted(self.keep)))

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
        self.own(rel)
        return os.path.join(self.path, rel)

    def own(self, *rels: str) -> None:
        """Add files to the marker without listing them as this run's output (a point's run.log, which
        the point's worker writes): a later `--overwrite` removes them too. One append per call
        (O_APPEND: forked writers add their lines whole); never follows a link, never waits on a FIFO."""
        if not self._begun:
            self.begin()
        self._append_marker(rels)

    def _append_marker(self, rels) -> None:
        new = [r for r in rels if r not in self._announced]
        if not new:
            return
        fd = os.open(os.path.join(self.path, MARKER),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        try:
            os.write(fd, "".join(f"{r}\n" for r in new).encode("utf-8", "surrogateescape"))
        finally:
            os.close(fd)
        self._announced.update(new)

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


def owned_files(path: str, keep: set[str] = frozenset()) -> Optional[list[str]]:
    """The files (relative paths) an earlier servetwin run wrote into `path`, which `--overwrite` may
    remove; None when the folder is not servetwin's. A folder with a marker (and each subfolder with its
    own: a sweep's points) owns exactly the files listed there, anything else in it is the user's and
    stays. A folder from before the marker is servetwin's only if it holds config.yaml and nothing but
    the kinds of file servetwin writes; else None (refused, never guessed)."""
    marked, unmarked = [], []
    for folder, dirs, files in os.walk(path):  # never follows a symlinked folder out of `path`
        rel_folder = os.path.relpath(folder, path)
        if MARKER in files:
            marked.extend(os.path.normpath(os.path.join(rel_folder, r)) for r in _marker_lines(folder))
            marked.append(os.path.normpath(os.path.join(rel_folder, MARKER)))
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            rel = os.path.normpath(os.path.join(rel_folder, name))
            if TMP_MARK in name and name.startswith("."):
                marked.append(rel)  # an interrupted atomic write's temporary file: ours by its name
            elif rel not in keep and name != MARKER:
                unmarked.append(rel)
    if os.path.exists(os.path.join(path, MARKER)):
        return sorted(set(marked))
    old = [r for r in unmarked if r not in marked]
    if _not_old_servetwin(path, old):
        return None
    return sorted(set(marked) | set(old))


def _not_old_servetwin(path: str, files: list[str]) -> str:
    """Why a folder without a marker is not an older servetwin's output folder ('' when it is one)."""
    foreign = [r for r in files if not r.endswith(_OLD_KINDS) or os.path.islink(os.path.join(path, r))]
    if foreign:
        return f"it holds files servetwin never writes: {_shown(foreign)}"
    if _OLD_FIRST_FILE not in files:
        return f"it has no {_OLD_FIRST_FILE}, the first file every servetwin run writes"
    return ""


def _marker_lines(folder: str) -> list[str]:
    """The marker's paths that stay inside `folder` (a hand-edited `../x` or `/etc/x` is ignored). A
    marker that is no regular file (a symlink to /dev/zero, a FIFO) or past MAX_MARKER_BYTES is refused,
    never read: `--overwrite` would hang or fill memory on it."""
    path = os.path.join(folder, MARKER)
    try:
        st = os.lstat(path)
    except OSError:
        return []
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError("--overwrite", f"{path} is not a regular file (a link, FIFO or device); servetwin "
                                         "writes its marker as a plain file: remove it, or choose another folder")
    if st.st_size > MAX_MARKER_BYTES:
        raise ConfigError("--overwrite", f"{path} is {st.st_size} bytes, more than the limit of {MAX_MARKER_BYTES} "
                                         "bytes for a marker: remove it, or choose another folder")
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = [ln.rstrip("\n") for ln in f]
    except OSError:
        return []
    safe = []
    for ln in lines:
        rel = os.path.normpath(ln) if ln and not ln.startswith("#") else ""
        if rel and not os.path.isabs(rel) and rel != ".." and not rel.startswith(".." + os.sep):
            safe.append(rel)
    return safe


def _remove_owned(root: str, rel: str, real_root: Optional[str] = None) -> None:
    """Remove one file servetwin wrote (a symlink: the link, never its target), then the folders it
    leaves empty up to `root`; a path whose folder resolves outside `root` is left alone."""
    full = os.path.join(root, rel)
    real_root = real_root or os.path.realpath(root)
    parent = os.path.realpath(os.path.dirname(full))
    if parent != real_root and not parent.startswith(real_root + os.sep):
        return
    if os.path.isdir(full) and not os.path.islink(full):
        return  # the marker names files; a folder of that name is not one
    try:
        os.unlink(full)
    except FileNotFoundError:
        pass
    folder = os.path.dirname(full)
    while os.path.realpath(folder) != real_root:
        try:
            os.rmdir(folder)  # only when empty: a user's file in it keeps it
        except OSError:
            return
        folder = os.path.dirname(folder)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _not_ours(path: str) -> str:
    real = os.path.realpath(path)
    where = path if real == os.path.abspath(path) else f"{path} (-> {real})"
    files = [os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names]
    return (f"{where} was not written by servetwin (no {MARKER} marker, and {_not_old_servetwin(path, files)}); "
            "--overwrite only replaces servetwin's own output folders: choose another folder")


def folder_summary_state(path: str, summary_name: str = "summary.json") -> Optional[dict]:
    """The summary a folder holds (None when absent or unreadable): what an interrupted run can claim."""
    try:
        with open(os.path.join(path, summary_name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
