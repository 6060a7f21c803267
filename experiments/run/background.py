"""Output files written by forked children while the parent goes on (figures, trace.json).

A run's outputs are independent files built from data already in memory: each is handed to a forked
child (the data is shared copy-on-write, nothing is pickled), so writing them takes the time of the
slowest instead of the sum, and overlaps whatever the parent does next (the next backend, the report).
`wait()` joins every child; a child that failed is redone in the parent, so a file is never silently
missing. Where fork is missing, only one CPU is usable, or SERVETWIN_SERIAL_OUTPUT=1, jobs run inline.

`Prewarmed` is a forked child started before the backends run: it imports the plotting stack (~0.6 s of
CPU, a fifth of a 10,000-request simulation) on a spare CPU while the simulation runs, then waits for one
job (a function and its data, pickled through a pipe) and sends back its result. The figures are still
drawn after the simulation, from its data; only the import is off the critical path.
"""
from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from servetwin.core.pipe_messages import recv_message, send_message


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Every object alive at entry kept out of the cyclic GC until exit (`gc.freeze`, undone after).

    For the output phase after a long simulation: its tables and summaries allocate enough to trigger
    full collections, each a pass over the simulation's millions of objects (~0.3 s for the 16-engine
    routing ladder's) that are all still in use, and a pass writes every object's header: it would copy
    each page a forked writer still shares (`OutputJobs`). Objects made inside are collected as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


BACKGROUND_NICE = 5  # a background job's niceness: about a third of a normal process's CPU share when both wait


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

    def submit(self, key: str, fn: Callable[..., Any], args: tuple, path: str, background: bool = False) -> None:
        """`background`: the child lowers its CPU priority (`BACKGROUND_NICE`), so that on a machine with
        fewer CPUs than jobs the work the run waits on longest (the parent's own, a job submitted later
        that can only start then) takes the CPUs first."""
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
            # no cyclic GC here: a collection writes to every object's header, copying every page of
            # the shared heap (the child lives for one file)
            gc.disable()
            try:
                if background:
                    os.nice(BACKGROUND_NICE)
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


class Prewarmed:
    """One job for a forked child that ran `warm()` (imports) while the parent went on.

    `submit(fn, args)` pickles the job to the child (from a thread: the pipe holds 64 KiB and the child
    may still be importing); `result()` returns `fn(*args)` computed by the child, or by the parent when
    the child failed or was never started (no fork, one CPU): the caller always gets the job done.
    `close()` ends a child that got no job (a run that failed before writing). The child ignores Ctrl-C
    while it waits (the parent decides what an interrupt means: an interrupted run still writes its
    figures) and takes it normally once it works."""

    def __init__(self, warm: Callable[[], Any], parallel: Optional[bool] = None) -> None:
        self.pid: Optional[int] = None
        self._job: Optional[tuple] = None
        self._sender: Optional[threading.Thread] = None
        if not (parallel_ok() if parallel is None else parallel):
            return
        job_r, job_w = os.pipe()
        res_r, res_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(job_w)
            os.close(res_r)
            _child(warm, job_r, res_w)
        os.close(job_r)
        os.close(res_w)
        self.pid, self._job_w, self._res_r = pid, job_w, res_r

    @property
    def running(self) -> bool:
        return self.pid is not None

    def submit(self, fn: Callable[..., Any], args: tuple) -> None:
        self._job = (fn, args)
        if self.pid is None:
            return
        try:
            data = pickle.dumps(self._job, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # something unpicklable in the job: result() does it here
            self.close()
            return

        def send() -> None:
            try:
                send_message(self._job_w, data)
            except OSError:  # the child died: result() redoes the job
                pass
            finally:
                os.close(self._job_w)

        self._sender = threading.Thread(target=send, name="prewarmed-submit", daemon=True)
        self._sender.start()

    def result(self) -> Any:
        if self._job is None:
            raise RuntimeError("Prewarmed.result: nothing was submitted")
        fn, args = self._job
        if self.pid is None:
            return fn(*args)
        try:
            data = recv_message(self._res_r)
        finally:
            os.close(self._res_r)
            self._sender.join()
            ok = self._reap()
        if ok and data:
            return pickle.loads(data)
        return fn(*args)  # the child failed: the parent does the job, nothing is silently missing

    def close(self) -> None:
        """End a child that is still waiting (no job, or the caller gave up)."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if self._sender is None:
            os.close(self._job_w)
        os.close(self._res_r)
        self._reap()

    def _reap(self) -> bool:
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        return os.waitstatus_to_exitcode(status) == 0


def _child(warm: Callable[[], Any], job_r: int, res_w: int) -> None:
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        warm()
        data = recv_message(job_r)
        if data:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            fn, args = pickle.loads(data)
            del data  # (~150 MB for 100,000 requests: not held while the job runs)
            send_message(res_w, pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL))
        code = 0
    except BaseException:
        if os.environ.get("SERVETWIN_DEBUG_OUTPUT") == "1":  # the parent redoes the job; say why here
            import traceback  # noqa: PLC0415

            traceback.print_exc()
    finally:
        os._exit(code)
