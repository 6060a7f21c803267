"""Data parallelism in the real engine stack: N engine-core processes behind one front end, routed by
vLLM's internal load balancer (`DPLBAsyncMPClient`, `v1/engine/core_client.py:1751-1825`).

`DPSyncMPClient` (the offline `LLM`'s client with `data_parallel_size=N`) starts N `SyncMPClient`s, one
engine-core process each (each with its own tensor-parallel workers when `tensor_parallel_size > 1`),
and routes every new request with `servetwin.core.engine.dp_lb.DPLoadBalancer` - the code the
simulator's cluster uses. Dense models only: a dense DP rank is an independent engine
(`v1/engine/core.py:1546-1555`), so the engines never talk to each other.

The coordinator (`DPFrontEndCoordinator`) lives in the front end's thread rather than a process of
its own: every engine's stats already reach the front end on its output socket (with each step's
outputs), and the balancer reads the published rows only when it picks, so applying
`dp_lb.DPStatsCoordinator`'s 100 ms / 5 s publish rule at each front-end event (a message read, a pick)
gives the rows vLLM's coordinator process would have published by then, without a third hop. An
engine's stats count as sent only when its `(running, waiting)` changed (`RequestCountsPublisher`,
`core.py:1621-1645`). In-flight counts fall when an engine reports a request finished and when the
front end aborts one.

`lb_trace` records the stream the balancer saw: `("publish", t, rows)`, `("pick", request_id, rank)`
and `("finish", request_id)`, in order; `dp_lb.replay_lb_trace` feeds it into a fresh balancer.

An engine that dies ends the whole client: every pending and later call raises `EngineDeadError`, and
shutdown stops every engine (and its workers).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional

import zmq

from servetwin.core.engine import messages as m
from servetwin.core.engine.dp_lb import DPLoadBalancer, DPStatsCoordinator, RequestCountsPublisher
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineCoreClient, EngineDeadError
from servetwin.core.engine.mp_client import POLL_SLICE_MS, SyncMPClient
from servetwin.core.outputs import EngineCoreOutput
from servetwin.core.sampling_params import SamplingParams


class DPFrontEndCoordinator:
    """The balancer, the coordinator's publish rule and the trace, driven by front-end events."""

    def __init__(self, num_engines: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.lb = DPLoadBalancer(num_engines)
        self.stats = DPStatsCoordinator(num_engines)
        self.publishers = [RequestCountsPublisher() for _ in range(num_engines)]
        self.clock = clock
        self.lb_trace: list[tuple] = []

    def _maybe_publish(self) -> None:
        now = self.clock()
        if self.stats.stats_changed and self.stats.next_publish_s(now) <= now:
            rows = self.stats.publish(now)
            self.lb.on_publish(rows)
            self.lb_trace.append(("publish", now, rows))

    def on_engine_stats(self, rank: int, stats: m.EngineStats) -> None:
        self._maybe_publish()  # a publish due before this message carries the rows sent before it
        sent = self.publishers[rank].maybe_publish(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        if sent is not None:
            self.stats.on_engine_stats(rank, *sent)

    def choose(self, request_id: str) -> int:
        self._maybe_publish()
        rank = self.lb.choose(request_id)
        self.lb_trace.append(("pick", request_id, rank))
        return rank

    def on_finished(self, request_id: str) -> None:
        if request_id in self.lb.reqs_in_flight:
            self.lb.on_finished(request_id)
            self.lb_trace.append(("finish", request_id))

    def rank_of(self, request_id: str) -> Optional[int]:
        return self.lb.reqs_in_flight.get(request_id)


def engine_args_for_rank(args: EngineArgs) -> EngineArgs:
    """One DP rank's engine: the same arguments with data_parallel_size 1 (a dense rank is independent)."""
    return dataclasses.replace(args, data_parallel_size=1)


def engine_thread_env(num_engines: int) -> dict[str, str]:
    """The engines share the host's cores: each gets `cpu_count // N` intra-op threads (`OMP_NUM_THREADS`,
    which torch reads at import; its tensor-parallel workers split that again), unless the user set it."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // num_engines))}


def combine_utility_results(name: str, results: list[Any]) -> Any:
    """One answer from every engine's: `get_stats` sums the counts (KV usage: the mean) and lists each
    engine's stats under "engines"; `reset_prefix_cache` is True when every engine reset; else the list."""
    if name == "reset_prefix_cache":
        return all(results)
    if name == "get_stats":
        total = {k: sum(r[k] for r in results) for k in results[0] if k != "kv_cache_usage"}
        total["kv_cache_usage"] = sum(r["kv_cache_usage"] for r in results) / len(results)
        total["engines"] = results
        return total
    return results


def start_engines(cls: type, args: EngineArgs, n: int, kwargs: dict[str, Any]) -> list[Any]:
    """`n` engine clients of `cls`, started at once (each constructor waits for its engine's ready
    message); if any fails, the others are shut down and its error is raised."""
    results: list[Any] = [None] * n

    def start(rank: int) -> None:
        try:
            results[rank] = cls(args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            results[rank] = e

    threads = [threading.Thread(target=start, args=(rank,), name=f"DPEngineStart-{rank}") for rank in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if not isinstance(r, BaseException):
                r.shutdown()
        raise errors[0]
    return results


class DPClientBase(EngineCoreClient):
    """What both data-parallel clients share: the engines (one client of `client_cls` per rank), the
    coordinator, routing of adds and aborts."""

    def __init__(self, args: EngineArgs, client_cls: type, kwargs: dict[str, Any]) -> None:
        n = args.data_parallel_size
        self.args = args
        kwargs = dict(kwargs, extra_env=engine_thread_env(n))
        self.clients: list[Any] = start_engines(client_cls, engine_args_for_rank(args), n, kwargs)
        self.config = self.clients[0].config
        self.simulated = self.clients[0].simulated
        self.coordinator = DPFrontEndCoordinator(n)
        self.sim_arrivals: dict[str, float] = {}

    @property
    def lb_trace(self) -> list[tuple]:
        return self.coordinator.lb_trace

    @property
    def engine_pids(self) -> list[Optional[int]]:
        return [c.engine_pid for c in self.clients]

    @property
    def is_dead(self) -> bool:
        return any(c.is_dead for c in self.clients)

    @property
    def dead_reason(self) -> str:
        for rank, c in enumerate(self.clients):
            if c.is_dead:
                return f"data-parallel engine {rank} is dead: {c.dead_reason}"
        return "the data-parallel engines are shut down"

    def validate_params(self, params: SamplingParams) -> None:
        self.clients[0].validate_params(params)

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for c in self.clients:
                stack.enter_context(c.batched())
            yield

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, parent_id: Optional[str] = None) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        rank = self.coordinator.choose(request_id)
        self.clients[rank].add_request(request_id, prompt_token_ids, params, arrival_time, priority, cache_salt,
                                       parent_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in each request's engine; the balancer frees their in-flight slots at once (the engine
        reports an aborted request finished, which frees it in vLLM)."""
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.coordinator.rank_of(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
                self.coordinator.on_finished(rid)
        for rank, ids in by_rank.items():
            self.clients[rank].abort_requests(ids)

    def on_engine_message(self, rank: int, msg: Any) -> None:
        """An engine's outputs message reached the front end: its stats and finished requests."""
        stats = getattr(msg, "stats", None)
        if stats is not None:
            self.coordinator.on_engine_stats(rank, stats)
        for out in getattr(msg, "outputs", ()):
            if out.finished:
                self.coordinator.on_finished(out.request_id)
        for err in getattr(msg, "errors", None) or ():  # a refused request never runs: its slot is free
            self.coordinator.on_finished(err.request_id)

    def shutdown(self) -> None:
        for c in self.clients:
            c.shutdown()


class DPSyncMPClient(DPClientBase):
    """`data_parallel_size` engine processes behind vLLM's internal load balancer (blocking I/O)."""

    def __init__(self, args: EngineArgs, **kwargs: Any) -> None:
        super().__init__(args, SyncMPClient, kwargs)
        self._poller = zmq.Poller()
        for c in self.clients:
            self._poller.register(c.output_socket, zmq.POLLIN)
        self._next = 0  # the engine whose outputs are taken first next time (fair turns)

    def _check_alive(self) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)

    def _receive_ready(self) -> None:
        """Wait for messages from any engine and take in every one that arrived."""
        ready = dict(self._poller.poll(POLL_SLICE_MS))
        for rank, c in enumerate(self.clients):
            if c.output_socket in ready:
                self.on_engine_message(rank, c.receive())

    def _take_output(self) -> Optional[list[EngineCoreOutput]]:
        n = len(self.clients)
        for i in range(n):
            rank = (self._next + i) % n
            c = self.clients[rank]
            item = c.take_output()
            if item is None:
                continue
            self._next = (rank + 1) % n
            outputs, sim_time_s = item
            if self.simulated:
                self.last_sim_time_s = sim_time_s
            return outputs
        return None

    def get_output(self) -> list[EngineCoreOutput]:
        """The next batch of outputs from any engine; [] once no engine has work for anything sent."""
        while True:
            self._check_alive()
            outputs = self._take_output()
            if outputs is not None:
                for c in self.clients:
                    self.sim_arrivals.update(c.sim_arrivals)
                    c.sim_arrivals.clear()
                return outputs
            for c in self.clients:
                c.raise_request_error()
            if not self.has_work():
                return []
            try:
                self._receive_ready()
            except EngineDeadError as e:
                raise EngineDeadError(f"a data-parallel engine died: {e}") from e

    def has_work(self) -> bool:
        return any(c.has_work() for c in self.clients)

    def utility(self, name: str, *args: Any) -> Any:
        """Every engine runs the call (see `combine_utility_results`)."""
        return combine_utility_results(name, [c.utility(name, *args) for c in self.clients])

__all__ = ["DPClientBase", "DPSyncMPClient", "combine_utility_results", "DPFrontEndCoordinator", "engine_args_for_rank", "start_engines"]
