"""Arrival processes: when requests reach the engine.

Open-loop processes (`Offline`, `Poisson`, `Gamma`, `TraceArrivals`) fix every arrival time in
advance (`times(n, rng)`; the workload builder writes them into `WorkloadRequest.arrival_s`) and
replay them in the simulation. `ClosedLoop` needs completion feedback: each of N clients submits a
request, waits for it to finish, thinks, and submits the next; arrival times are set at run time. So
does `StageLadder` (inference-perf's multi-stage load): a stage starts when the previous one drained.

Every process exposes `process(env, requests, submit, rng)`, a SimPy generator the simulation loop
starts; `submit(request)` hands a request to the engine and returns an event that fires when the
request finishes. Open-loop processes submit requests with equal arrival times in input order,
without yielding in between.
"""
from __future__ import annotations

import math

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import numpy as np
import simpy

from servetwin.core.config_error import ConfigError
from servetwin.sim.trace_file import TraceRecord, load_trace
from servetwin.sim.validate import check_keys, check_mapping, int_at_least, non_negative, one_of, positive

if TYPE_CHECKING:
    from servetwin.sim.workload import WorkloadRequest

Submit = Callable[["WorkloadRequest"], simpy.Event]


@runtime_checkable
class ArrivalProcess(Protocol):
    closed_loop: bool

    def process(self, env: simpy.Environment, requests: Sequence["WorkloadRequest"], submit: Submit,
                rng: np.random.Generator) -> Generator[simpy.Event, Any, None]: ...


class _OpenLoop:
    closed_loop = False

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def process(self, env: simpy.Environment, requests: Sequence["WorkloadRequest"], submit: Submit,
                rng: np.random.Generator) -> Generator[simpy.Event, Any, None]:
        """Submit each request at its `arrival_s` (requests must be sorted by it)."""
        for req in requests:
            delay = req.arrival_s - env.now
            if delay > 0:
                yield env.timeout(delay)
            elif delay < 0 and not np.isclose(delay, 0.0):
                raise ConfigError("arrivals", f"request {req.request_id} arrives at {req.arrival_s} s, "
                                 f"before the previous one (requests must be sorted by arrival_s)")
            submit(req)


@dataclass(slots=True, frozen=True)
class Offline(_OpenLoop):
    """Every request at t = 0."""

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(n)


@dataclass(slots=True, frozen=True)
class Poisson(_OpenLoop):
    """Exponential inter-arrival gaps with mean 1/rate; the first request arrives after one gap."""
    rate: float

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.cumsum(rng.exponential(1.0 / self.rate, size=n))


@dataclass(slots=True, frozen=True)
class Gamma(_OpenLoop):
    """Gamma inter-arrival gaps: mean 1/rate, coefficient of variation cv (cv = 1 is Poisson)."""
    rate: float
    cv: float

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        shape = 1.0 / (self.cv * self.cv)
        return np.cumsum(rng.gamma(shape, 1.0 / (self.rate * shape), size=n))


@dataclass(slots=True, frozen=True)
class TraceArrivals(_OpenLoop):
    """Arrival times (and lengths, used by the workload builder) from a trace file."""
    path: str
    records: tuple[TraceRecord, ...]
    hash_block_tokens: int = 512  # tokens behind one of a record's hash_ids

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.array([r.arrival_s for r in self.records[:n]], dtype=float)


@dataclass(slots=True, frozen=True)
class ClosedLoop:
    """N clients; each submits, waits for completion, thinks (fixed or exponential), repeats."""
    clients: int
    think_time_s: float = 0.0
    think: str = "fixed"  # "fixed" | "exponential"
    closed_loop = True

    def process(self, env: simpy.Environment, requests: Sequence["WorkloadRequest"], submit: Submit,
                rng: np.random.Generator) -> Generator[simpy.Event, Any, None]:
        """Start the clients (client 0 first) and return when every request has been submitted."""
        queue = iter(requests)
        clients = [env.process(self._client(env, queue, submit, rng)) for _ in range(self.clients)]
        yield env.all_of(clients)

    def _client(self, env: simpy.Environment, queue: Any, submit: Submit,
                rng: np.random.Generator) -> Generator[simpy.Event, Any, None]:
        for req in queue:
            req.arrival_s = env.now
            yield submit(req)
            think = self.think_time_s
            if self.think == "exponential" and think > 0:
                think = float(rng.exponential(think))
            if think > 0:
                yield env.timeout(think)


@dataclass(slots=True, frozen=True)
class Stage:
    rate: float
    duration_s: float

    @property
    def count(self) -> int:
        return int(self.rate * self.duration_s)  # inference-perf: num_requests = int(rate * duration)


@dataclass(slots=True, frozen=True)
class StageLadder:
    """inference-perf's multi-stage Poisson load (kubernetes-sigs/inference-perf, `loadgen/load_generator.py`
    `run_stage`, `loadgen/load_timer.py`): stage k enqueues int(rate x duration) requests, timed from
    `start_offset_s` after the enqueue (`start_time = perf_counter() + 1`) by exponential gaps rescaled to
    sum to the stage's duration; the next stage starts only when every request of this one has finished,
    which the load generator sees on its `poll_s` tick (`while finished < n: sleep(1)`). Stages therefore
    do not overlap; the engines' caches carry over from one stage to the next. Arrival times are set at
    run time (like a closed loop)."""
    stages: tuple[Stage, ...]
    start_offset_s: float = 1.0
    poll_s: float = 1.0
    closed_loop = True

    def stage_counts(self) -> list[int]:
        return [s.count for s in self.stages]

    def process(self, env: simpy.Environment, requests: Sequence["WorkloadRequest"], submit: Submit,
                rng: np.random.Generator) -> Generator[simpy.Event, Any, None]:
        queue = iter(requests)
        for stage in self.stages:
            enqueued = env.now
            n = stage.count
            gaps = rng.exponential(1.0 / stage.rate, size=n)
            times = enqueued + self.start_offset_s + np.cumsum(gaps * (stage.duration_s / gaps.sum()))
            done = []
            for t, req in zip(times, queue):
                if t > env.now:
                    yield env.timeout(float(t) - env.now)
                req.arrival_s = env.now
                done.append(submit(req))
            yield env.all_of(done)
            ticks = math.ceil((env.now - enqueued) / self.poll_s - 1e-9)
            wait = enqueued + ticks * self.poll_s - env.now
            if wait > 0:
                yield env.timeout(wait)


ARRIVAL_TYPES = ("offline", "poisson", "gamma", "closed_loop", "trace", "stages")


def _parse_ladder(cfg: Any, path: str) -> StageLadder:
    check_keys(cfg, {"type", "stages", "start_offset_s", "poll_s"}, path, required=["stages"])
    raw = cfg["stages"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path}.stages", "must be a non-empty list of {rate, duration_s}")
    stages = []
    for i, st in enumerate(raw):
        st = check_mapping(st, f"{path}.stages[{i}]")
        check_keys(st, {"rate", "duration_s"}, f"{path}.stages[{i}]", required=["rate", "duration_s"])
        stage = Stage(positive(st["rate"], f"{path}.stages[{i}].rate"),
                      positive(st["duration_s"], f"{path}.stages[{i}].duration_s"))
        if stage.count < 1:
            raise ConfigError(f"{path}.stages[{i}]", "rate x duration_s must be at least 1 request")
        stages.append(stage)
    return StageLadder(tuple(stages), non_negative(cfg.get("start_offset_s", 1.0), f"{path}.start_offset_s"),
                       positive(cfg.get("poll_s", 1.0), f"{path}.poll_s"))


RATE_NEEDS_A_PROCESS = ("{what}, so there is no rate to change: give a process instead, e.g. --set "
                        "'workload.arrival={{type: poisson, rate: 32}}' (a workload file keeps its lengths and order, "
                        "the process draws the send times)")


def parse_arrival(cfg: Any, path: str = "workload.arrival", trace_limit: Optional[int] = None) -> ArrivalProcess:
    """Build an arrival process from `{type: ..., ...}` with errors naming the field path. `trace_limit`:
    a trace keeps only that many earliest records (the run's `requests`)."""
    if cfg is None:
        return Offline()
    cfg = check_mapping(cfg, path)
    if "rate" in cfg and cfg.get("type") in (None, "offline", "trace"):  # `--set workload.arrival.rate=R`
        raise ConfigError(f"{path}.rate", RATE_NEEDS_A_PROCESS.format(
            what="every request is sent at t = 0 (a request rate of inf)" if cfg.get("type") == "offline"
            else "the times come from a trace"))
    kind = one_of(cfg.get("type"), ARRIVAL_TYPES, f"{path}.type")
    if kind == "offline":
        check_keys(cfg, {"type"}, path)
        return Offline()
    if kind == "poisson":
        check_keys(cfg, {"type", "rate"}, path, required=["rate"])
        return Poisson(positive(cfg["rate"], f"{path}.rate"))
    if kind == "gamma":
        check_keys(cfg, {"type", "rate", "cv"}, path, required=["rate", "cv"])
        return Gamma(positive(cfg["rate"], f"{path}.rate"), positive(cfg["cv"], f"{path}.cv"))
    if kind == "stages":
        return _parse_ladder(cfg, path)
    if kind == "closed_loop":
        check_keys(cfg, {"type", "clients", "think_time_s", "think"}, path, required=["clients"])
        return ClosedLoop(int_at_least(cfg["clients"], 1, f"{path}.clients"),
                          non_negative(cfg.get("think_time_s", 0.0), f"{path}.think_time_s"),
                          one_of(cfg.get("think", "fixed"), ("fixed", "exponential"),
                                 f"{path}.think"))
    check_keys(cfg, {"type", "path", "format", "columns", "time_unit", "hash_block_tokens"}, path, required=["path"])
    columns = cfg.get("columns")
    if columns is not None:
        columns = dict(check_mapping(columns, f"{path}.columns"))
    block = int_at_least(cfg.get("hash_block_tokens", 512), 1, f"{path}.hash_block_tokens")
    records = load_trace(cfg["path"], f"{path}.path", fmt=cfg.get("format", "auto"), columns=columns,
                         time_unit=cfg.get("time_unit", "s"), hash_block_tokens=block, limit=trace_limit)
    return TraceArrivals(str(cfg["path"]), tuple(records), block)
