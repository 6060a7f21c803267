"""Output files written by forked children while the parent goes on (figures, trace.json).

A run's outputs are independent files built from data already in memory: each is handed to a forked
child (the data is shared copy-on-write, nothing is pickled), so writing them takes the time of the
slowest instead of the sum, and overlaps whatever the parent does next (the next backend, the report).
`wait()` joins every child; a child that failed is redone in the parent, so a file is never silently
missing. Where fork is missing, only one CPU is usable, or SERVETWIN_SERIAL_OUTPUT=1, jobs run inline.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


def parallel_ok() -> bool:
    if not hasattr(os, "fork") or os.environ.get("SERVETWIN_SERIAL_OUTPUT") == "1":
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return cpus > 1


@dataclass(slots=True)
class _Job:
    key: str
    fn: Callable[..., Any]
    args: tuple
    path: str
    pid: Optional[int] = None
    result: Any = None


@dataclass(slots=True)
class OutputJobs:
    """Start with `submit(key, fn, args, path)` (fn writes `path`, returns what the caller wants back);
    `wait()` returns {key: result} (the path, for a forked job that wrote it)."""
    parallel: bool = field(default_factory=parallel_ok)
    jobs: list[_Job] = field(default_factory=list)

    def submit(self, key: str, fn: Callable[..., Any], args: tuple, path: str) -> None:
        job = _Job(key, fn, args, path)
        self.jobs.append(job)
        if os.path.exists(path):  # a file left by an earlier run must not pass for this job's
            os.remove(path)
        if not self.parallel:
            job.result = fn(*args)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: one file, then leave without the parent's atexit/cleanup
            code = 1
            try:
                fn(*args)
                code = 0
            finally:
                os._exit(code)
        job.pid = pid

    def wait(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for job in self.jobs:
            if job.pid is not None:
                _, status = os.waitpid(job.pid, 0)
                job.pid = None
                ok = os.waitstatus_to_exitcode(status) == 0
                job.result = (job.path if os.path.exists(job.path) else None) if ok else job.fn(*job.args)
            out[job.key] = job.result
        self.jobs = []
        return out
