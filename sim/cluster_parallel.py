"""A routing cluster's engines simulated by several worker processes at once, with the one-process run's results.

Why it can be exact: in a cluster without P/D roles, DP ranks, KV events to the router or KV connectors, engines
touch each other only through the router. A request's instance is picked at its arrival from the router's own
state - what it routed, its in-flight counts and charges, which each request's first token and end release -
and from the endpoints' scraped metrics. So each worker (a forked process) simulates the engines of its own
instances (`owner`: instance i to worker i % n) and a replica of everything above them: the arrival process,
the router with its random draws, the scrapes of its own instances. The workers meet before a routing decision
(`WorkerLink.exchange`): each sends what its engines did since the last meeting that the router reads (first
tokens, ends, rejections, aborts, in their order) and its instances' last scraped metrics, and applies the
others'. The router's updates from them are sums and removals by request, so their order between meetings does
not matter, and every replica makes the same decision. A pick the router proves from what every replica shares
(its `forced_pick`: round robin, random, llm-d's single sticky endpoint) needs no meeting; the decision table
then takes its scores from the worker that owns the endpoint. A request routed to another worker's instance is booked here
(in-flight counts, charges) but simulated there; its done event is a `RemoteDone`. A stage ladder's wait for
its stage's requests (`all_of`) is a meeting too: each worker reports when its last one finished; the stage
ends at the latest of those times, in every worker.

A worker's event queue holds its engines' events and the replicated processes' (arrivals, scrapes), each in
the one-process run's relative order: a meeting happens at the routing event's place in that order, so each
worker has then processed exactly the events the one-process run processed before it. What differs is which
other events share a float time with an engine's step boundary: an engine settles before its next step when
another event is due at the same time (`Simulation._settle`), so where another worker's engine has an event
at exactly that float time, the settled engine's next events are made later in the instant. That changes no
engine's decisions; it could only reorder two events that are also due at exactly the same later time. With
arrival and step times drawn from continuous distributions no such pair occurs: the tests
(tests/sim/test_sim_cluster_parallel.py) and `benchmarks/outputs_identical.py` (both routing ladders,
byte for byte) compare with the one-process run.

After the run every worker's clock runs on to the cluster's end, and each ships its engines' results (packed
recorders, counts, front-end summaries; one message per engine) to worker 0 through its results pipe; worker 0
writes the outputs. A worker that fails sends its traceback instead, and worker 0
raises it; worker 0 failing closes the pipes, and the others exit.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import simpy

from servetwin.core.pipe_messages import ONE_WRITE, recv_message, send_message
from servetwin.sim.arrivals import Gamma, Offline, Poisson, StageLadder, TraceArrivals
from servetwin.sim.sim_time import call_at

MAX_WORKERS = 8
_OPEN_ARRIVALS = (Offline, Poisson, Gamma, TraceArrivals, StageLadder)  # (none waits for a single request)


class RemoteDone(simpy.Event):
    """The done event of a request another worker simulates: never triggered in this worker (a stage's wait
    for it is a meeting, `ArrivalEnv.all_of`)."""


def partition_blockers(cluster: Any) -> list[str]:
    """Why `cluster` (a ClusterSimulation) cannot be split over workers; [] when it can."""
    reasons = []
    if not hasattr(os, "fork"):
        reasons.append("no fork() on this platform")
    if len(cluster.instances) < 2:
        reasons.append("one instance")
    if cluster.pd is not None:
        reasons.append("prefill/decode roles (a request crosses instances)")
    if any(len(inst.ranks) > 1 or inst.lockstep for inst in cluster.instances):
        reasons.append("data-parallel ranks (their balancer, or MoE lockstep across endpoints)")
    if getattr(cluster.router, "wants_kv_events", False):
        reasons.append("a router fed by the engines' KV events")
    if cluster.max_time_s is not None:
        reasons.append("max_time_s")
    if type(cluster.arrival) not in _OPEN_ARRIVALS:
        reasons.append(f"{type(cluster.arrival).__name__} arrivals (a client waits for its own requests)")
    for inst in cluster.instances:
        for sim in inst.ranks:
            sched, executor = sim.engine.scheduler, sim.engine.executor
            if (getattr(sched, "connector", None) is not None or getattr(executor, "kv_worker", None) is not None
                    or sim.pipeline is not None or sim.fast_forward):
                reasons.append(f"instance {inst.name}: a KV connector, pipeline stages or the decode fast-forward")
                return reasons
    return reasons


AUTO_MIN_REQUESTS = 1000  # "auto" splits runs of at least this many requests (a fork and the shipment cost ~0.1-1 s)


def workers_for(cluster: Any, requested: int | str) -> int:
    """How many workers run `cluster`: `requested` (an int, or "auto": 2 where the machine has two CPUs for
    this process and the run has `AUTO_MIN_REQUESTS`), 1 where `partition_blockers` finds a reason, at most one
    per instance."""
    if requested == "auto":
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # (not Linux)
            cpus = os.cpu_count() or 1
        requested = 2 if cpus >= 2 and len(cluster.requests) >= AUTO_MIN_REQUESTS else 1
    n = min(int(requested), MAX_WORKERS, len(cluster.instances))
    return n if n > 1 and not partition_blockers(cluster) else 1


class WorkerFailed(RuntimeError):
    """Another worker of a partitioned cluster run failed (its traceback in the message) or vanished."""


@dataclass(slots=True)
class WorkerLink:
    """Worker `index` of `n`: its pipes (`reads[j]` from worker j, `writes[j]` to it) and what it owes the others:
    `outbox`, its engines' router events since the last meeting, in their order (`ClusterSimulation._apply_remote`
    reads them)."""
    index: int
    n: int
    reads: dict[int, int]
    writes: dict[int, int]
    outbox: list[tuple[str, str, Any]]
    # the results pipes (apart from the meetings', so that an interrupted meeting cannot garble them): worker 0
    # reads worker j's at results[j]; worker j writes its own at results[0]
    results: dict[int, int]

    def owns(self, instance_index: int) -> bool:
        return instance_index % self.n == self.index

    def exchange(self, kind: str, payload: Any) -> list[Any]:
        """Send `payload` to every other worker and return theirs (in worker order); both sides must be at the same
        meeting (`kind`)."""
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        senders = []
        for j, fd in self.writes.items():
            if len(data) <= ONE_WRITE:  # (the pipe holds it whole: written at once)
                if not _sent(fd, data):
                    self._gone(j, kind)
            else:  # (a large message from a thread: every worker writes first, then reads)
                t = threading.Thread(target=_sent, args=(fd, data), daemon=True)
                t.start()
                senders.append(t)
        out = [self.receive(j, kind) for j in sorted(self.reads)]
        for t in senders:
            t.join()
        return out

    def receive(self, j: int, kind: str) -> Any:
        data = recv_message(self.reads[j])
        if data is None:
            self._gone(j, kind)
        got, payload = pickle.loads(data)
        if got == "error":
            raise WorkerFailed(f"cluster worker {j} failed:\n{payload}")
        if got != kind:
            raise WorkerFailed(f"cluster worker {j} is at a {got!r} meeting, worker {self.index} at {kind!r}")
        return payload

    def _gone(self, j: int, kind: str) -> None:
        """Worker j's end of a meeting's pipe closed: it failed (worker 0 raises the traceback it sent on its results
        pipe) or was killed."""
        if self.index == 0:
            self.result_of(j)
        raise WorkerFailed(f"cluster worker {j} exited without a word at a {kind!r} meeting (killed? out of memory?)")

    def send_result(self, kind: str, payload: Any) -> None:
        """A worker's words to worker 0 after its run: ("part", a part of its shipment) ..., ("end", None), or
        ("error", its traceback)."""
        send_message(self.results[0], pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def result_of(self, j: int) -> dict[str, Any]:
        """Worker 0: worker j's shipment (its first part, with "engines": {key: EngineRun} from the parts after it);
        raises WorkerFailed with its traceback when it failed."""
        shipped: Optional[dict[str, Any]] = None
        while True:
            data = recv_message(self.results[j])
            if data is None:
                raise WorkerFailed(f"cluster worker {j} exited without its results (killed? out of memory?)")
            kind, payload = pickle.loads(data)
            if kind == "error":
                raise WorkerFailed(f"cluster worker {j} failed:\n{payload}")
            if kind == "end":
                return shipped
            if shipped is None:
                shipped = {**payload, "engines": {}}
            else:
                key, run = payload
                shipped["engines"][key] = run

    def close(self) -> None:
        for fd in [*self.reads.values(), *self.writes.values(), *self.results.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.reads, self.writes, self.results = {}, {}, {}


class ArrivalEnv:
    """The environment as a worker's arrival process sees it: SimPy's, but `all_of` (a stage ladder's wait for its
    stage's requests, some of them `RemoteDone`s) fires when the last of them finished in any worker: each worker
    meets the others when its own are done (`stage_end`)."""

    def __init__(self, env: simpy.Environment, stage_end: Callable[[simpy.Event], None]) -> None:
        self._env = env
        self._stage_end = stage_end

    @property
    def now(self) -> float:
        return self._env.now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def all_of(self, events: Sequence[simpy.Event]) -> simpy.Event:
        # (a meeting even where every event is this worker's: the others cannot know that, and meet)
        local = [e for e in events if not isinstance(e, RemoteDone)]
        out = self._env.event()
        self._env.all_of(local).callbacks.append(lambda _e: self._stage_end(out))
        return out


def end_together(env: simpy.Environment, out: simpy.Event, t_local: float, t_others: Sequence[float]) -> None:
    """`out` fires at the latest of the workers' times (each worker's own last done, `t_local` here and now)."""
    t = max([t_local, *t_others])
    call_at(env, t, lambda _e: out.succeed())


# -- the run ----------------------------------------------------------------------------------------
def run_partitioned(cluster: Any, n: int) -> Any:
    """`cluster.run()` over `n` forked workers (this process is worker 0); returns worker 0's ClusterResult with
    every worker's engines in it. Interrupted (Ctrl-C): every worker's engines as they were, then
    KeyboardInterrupt, as the one-process run leaves them."""
    import gc  # noqa: PLC0415

    pipes = {(i, j): os.pipe() for i in range(n) for j in range(n) if i != j}  # (i, j): i writes, j reads
    results = {w: _wide(os.pipe()) for w in range(1, n)}
    sys.stdout.flush()
    sys.stderr.flush()
    # (the heap at the fork - engines, workload, prompts - kept out of every worker's collections until the run
    # ends: a full collection would scan it again and write each object's header, copying the pages the workers
    # share)
    gc.freeze()
    children: dict[int, int] = {}
    for w in range(1, n):
        pid = os.fork()
        if pid == 0:
            _child(cluster, _link(w, n, pipes, results))  # never returns
        children[w] = pid
    link = _link(0, n, pipes, results)
    ok = interrupted = False
    try:
        try:
            cluster.run_here(link)
        except KeyboardInterrupt:
            interrupted = True
            for pid in children.values():  # (they ignore SIGINT: this one decides, and tells them once)
                _signal(pid, STOP_SIGNAL)
        shipped = {w: link.result_of(w) for w in children}
        ok = True
    finally:
        gc.unfreeze()
        link.close()
        for pid in children.values():
            if not ok:
                _signal(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    result = cluster.adopt(shipped, interrupted)
    if interrupted:
        raise KeyboardInterrupt
    return result


STOP_SIGNAL = signal.SIGUSR1  # worker 0 to the others: stop where you are, ship what you have


def _stop(_signum: int, _frame: Any) -> None:
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)  # (once)
    raise KeyboardInterrupt


def _wide(fds: tuple[int, int]) -> tuple[int, int]:
    """(speed: a results pipe of 1 MiB, not 64 KiB: a shipment of ~100 MB in fewer wake-ups; best effort)"""
    try:
        import fcntl  # noqa: PLC0415

        fcntl.fcntl(fds[1], getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass
    return fds


def _sent(fd: int, data: bytes) -> bool:
    """`send_message`; False where the reader is gone (a broken pipe: its reads report why)."""
    try:
        send_message(fd, data)
    except BrokenPipeError:
        return False
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _link(w: int, n: int, pipes: dict[tuple[int, int], tuple[int, int]],
          results: dict[int, tuple[int, int]]) -> WorkerLink:
    """Worker w's ends of the pipes; the other ends closed in its process."""
    reads, writes, mine = {}, {}, {}
    for (i, j), (r, wr) in pipes.items():
        if j == w:
            reads[i] = r
        else:
            os.close(r)
        if i == w:
            writes[j] = wr
        else:
            os.close(wr)
    for j, (r, wr) in results.items():
        if w == 0:
            mine[j] = r
            os.close(wr)
        elif j == w:
            mine[0] = wr
            os.close(r)
        else:
            os.close(r)
            os.close(wr)
    return WorkerLink(w, n, reads, writes, [], mine)


def _child(cluster: Any, link: WorkerLink) -> None:
    """A worker other than 0: its engines' run, then their results (or the traceback) to worker 0; exits."""
    import gc  # noqa: PLC0415

    code = 1
    try:
        gc.freeze()  # (as worker 0 did before the fork: also what this worker made since)
        # (a Ctrl-C reaches every process of the terminal's group: worker 0 takes it and sends STOP_SIGNAL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(STOP_SIGNAL, _stop)
        cluster.on_complete = cluster.on_reject = None  # (worker 0's progress: it hears of them at meetings)
        interrupted = False
        try:
            cluster.run_here(link)
        except KeyboardInterrupt:  # (worker 0 was interrupted: it gets the engines as they are)
            interrupted = True
        for part in cluster.shipment(interrupted):
            link.send_result("part", part)
        link.send_result("end", None)
        code = 0
    except BaseException:  # noqa: BLE001 (everything goes to worker 0, which raises it)
        try:
            link.send_result("error", traceback.format_exc())
        except OSError:
            pass
    finally:
        os._exit(code)


__all__ = ["AUTO_MIN_REQUESTS", "RemoteDone", "WorkerLink", "WorkerFailed", "ArrivalEnv", "partition_blockers", "workers_for",
           "run_partitioned", "end_together", "MAX_WORKERS"]
