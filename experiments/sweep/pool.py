"""Map point configs to results: one small interface, two implementations (a local process pool, Ray).

A *point* is one run of one experiment config (a sweep point, one seed of it, one probe of a capacity
search). Sweeps and capacity searches build `PointTask`s and hand them to a pool:

    with make_pool(jobs=4) as pool:                # or make_pool(ray=True / ray="ray://head:10001")
        map_with_retries(pool, tasks, on_result, retries=2)

`pool.map(tasks, on_result)` runs every task and calls `on_result(task, result)` in the driver as each
one finishes; on Ctrl-C the queued tasks are cancelled, the running ones stop and report what they
have, and KeyboardInterrupt is re-raised once every result is in. Both pools run `execute_task`, so
the same config and seed give the same summary wherever it ran.

`write="all"` tasks produce a full run folder (the `servetwin run` layout) at `task.out_dir`: the local
pool writes it there directly; a Ray worker writes it in a temporary folder that travels back as a
tar archive and is unpacked there by the driver, so a sweep folder looks the same however it ran.
`write="summary"` tasks (capacity probes) write nothing and return the summary only.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

WRITE_MODES = ("all", "summary")


@dataclass(slots=True)
class PointTask:
    key: str  # unique within one map call (a sweep point's folder name, "probe load=8 seed=1", ...)
    raw: dict[str, Any]  # the point's full validated config (paths absolute), no sweep
    base_dir: str
    write: str = "all"  # "all": a run folder at out_dir; "summary": nothing written
    out_dir: Optional[str] = None  # on the driver's machine
    meta: dict[str, Any] = field(default_factory=dict)  # the caller's bookkeeping (point, seed, load)


@dataclass(slots=True)
class PointResult:
    status: str  # ok | error | interrupted | not run
    summary: Optional[dict[str, Any]] = None  # the run's combined summary (summary.json)
    error: Optional[str] = None
    wall_s: float = 0.0
    host: str = ""
    pid: int = 0
    attempts: int = 1


class PointPool(Protocol):
    description: str
    workers: int

    def map(self, tasks: list[PointTask], on_result: Callable[[PointTask, PointResult], None]) -> None: ...

    def close(self) -> None: ...


# -- one task ------------------------------------------------------------------------------------
_interrupted_once = False
_stop_event = None  # local pool: set by the parent after Ctrl-C, so queued tasks are skipped


def _sigint_once(signum, frame) -> None:
    global _interrupted_once
    if _interrupted_once:
        return  # the terminal and the parent may both forward Ctrl-C: stop once, then finish writing
    _interrupted_once = True
    raise KeyboardInterrupt


def _read_summary(out_dir: Optional[str]) -> Optional[dict]:
    path = os.path.join(out_dir, "summary.json") if out_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def execute_task(task: PointTask, out_dir: Optional[str], in_worker: bool = False,
                 signals: bool = False) -> PointResult:
    """Run one task; never raises, except KeyboardInterrupt when run in the driver's own process
    (`in_worker=False`, after writing what ran). `signals`: install the Ctrl-C handler (a pool process)."""
    global _interrupted_once
    from servetwin.experiments.run.experiment import run_experiment, run_summary  # noqa: PLC0415
    from servetwin.experiments.config.schema import validate_config  # noqa: PLC0415

    where = {"host": socket.gethostname(), "pid": os.getpid()}
    if _stop_event is not None and _stop_event.is_set():
        return PointResult("not run", **where)
    if signals:
        _interrupted_once = False
        signal.signal(signal.SIGINT, _sigint_once)
    t0 = time.perf_counter()
    logf = None
    try:
        if task.write == "all":
            os.makedirs(out_dir, exist_ok=True)
            logf = open(os.path.join(out_dir, "run.log"), "w")

        def log(msg: str) -> None:
            if logf is not None:
                logf.write(msg + "\n")
                logf.flush()

        exp = validate_config(task.raw, task.base_dir, task.raw.get("name", "point"))
        if task.write == "all":
            from servetwin.experiments.run.run_folder import RunFolder  # noqa: PLC0415

            # the driver owns (and cleared) the tree; a point's folder keeps only its own log (a retry
            # replaces what the failed attempt left)
            with RunFolder(out_dir, overwrite=True, keep=("run.log",)) as folder:
                combined = run_experiment(exp, out_dir, progress=False, log=log, folder=folder)
        else:
            combined = run_summary(exp, log)
            if combined["interrupted"]:
                raise KeyboardInterrupt
        return PointResult("ok", combined, wall_s=time.perf_counter() - t0, **where)
    except KeyboardInterrupt:
        if not in_worker:
            raise
        return PointResult("interrupted", _read_summary(out_dir), wall_s=time.perf_counter() - t0, **where)
    except Exception as e:  # noqa: BLE001  (a failing point must not lose the others)
        return PointResult("error", error=f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - t0, **where)
    finally:
        if logf is not None:
            logf.close()
        if signals:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def map_with_retries(pool: PointPool, tasks: list[PointTask], on_result: Callable[[PointTask, PointResult], None],
                     retries: int = 0, log: Optional[Callable[[str], None]] = None) -> None:
    """`pool.map`, rerunning a task whose run raised or whose worker died up to `retries` more times;
    the last attempt's result is reported (with `attempts`)."""
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"--retries: must be an integer >= 0, got {retries!r}")
    pending, attempt = list(tasks), 1
    while pending:
        again: list[PointTask] = []

        def done(task: PointTask, result: PointResult, attempt: int = attempt) -> None:
            result.attempts = attempt
            if result.status == "error" and attempt <= retries:
                if log is not None:
                    log(f"  {task.key}: attempt {attempt} failed ({result.error}); retrying")
                again.append(task)
            else:
                on_result(task, result)

        pool.map(pending, done)
        pending, attempt = again, attempt + 1


# -- the local pool -------------------------------------------------------------------------------
def _worker_init(stop_event=None) -> None:
    global _stop_event
    _stop_event = stop_event
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # idle workers ignore Ctrl-C; a running point handles it


def _pool_execute(task: PointTask) -> PointResult:
    return execute_task(task, task.out_dir, in_worker=True, signals=True)


class LocalPool:
    """`jobs` spawn worker processes (jobs=1: in the driver's process, no pool)."""

    def __init__(self, jobs: int = 1) -> None:
        if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
            raise ValueError(f"-j/--jobs: must be an integer >= 1, got {jobs!r}")
        self.workers = jobs
        self.description = f"local pool ({jobs} worker{'s' if jobs > 1 else ''})" if jobs > 1 else "in process"
        self._ex: Optional[ProcessPoolExecutor] = None
        self._stop = None

    def __enter__(self) -> "LocalPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _executor(self) -> ProcessPoolExecutor:
        if self._ex is None:
            ctx = multiprocessing.get_context("spawn")
            self._stop = ctx.Event()
            self._ex = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx, initializer=_worker_init,
                                           initargs=(self._stop,))
        return self._ex

    def map(self, tasks: list[PointTask], on_result: Callable[[PointTask, PointResult], None]) -> None:
        if self.workers == 1 or len(tasks) <= 1 and self._ex is None:
            for task in tasks:
                try:
                    on_result(task, execute_task(task, task.out_dir))
                except KeyboardInterrupt:
                    on_result(task, PointResult("interrupted", _read_summary(task.out_dir), host=socket.gethostname(),
                                                pid=os.getpid()))
                    raise
            return
        ex = self._executor()
        futures = {ex.submit(_pool_execute, t): t for t in tasks}
        reported: set = set()

        def report(fut, result: PointResult) -> None:
            reported.add(fut)
            on_result(futures[fut], result)

        try:
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    try:
                        report(fut, fut.result())
                    except Exception as e:  # noqa: BLE001  (a crashed worker)
                        report(fut, PointResult("error", error=f"{type(e).__name__}: {e}"))
        except KeyboardInterrupt:
            self._stop.set()
            for fut in futures:
                fut.cancel()
            for proc in list(getattr(ex, "_processes", {}).values()):
                try:  # running points stop and write what they have (idle workers ignore it)
                    os.kill(proc.pid, signal.SIGINT)
                except (ProcessLookupError, OSError):
                    pass
            for fut in futures:
                if fut in reported:
                    continue
                if fut.cancelled():
                    report(fut, PointResult("not run"))
                    continue
                try:
                    report(fut, fut.result(timeout=120))
                except Exception as e:  # noqa: BLE001
                    report(fut, PointResult("interrupted", error=f"{type(e).__name__}: {e}"))
            raise

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None


def host_summary(results: list[PointResult]) -> list[str]:
    """One line per host: how many points ran there and their wall time."""
    by_host: dict[str, list[float]] = {}
    for r in results:
        if r.host:
            by_host.setdefault(r.host, []).append(r.wall_s)
    lines = []
    for host, walls in sorted(by_host.items()):
        lines.append(f"{host}: {len(walls)} point(s), wall {sum(walls):.1f}s in all "
                     f"(mean {sum(walls) / len(walls):.2f}s, max {max(walls):.2f}s)")
    return lines


