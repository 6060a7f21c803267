"""vLLM 0.33's internal data-parallel load balancing: the front end's engine choice and the
coordinator's stats publishing (one implementation, used by the simulator's DP instances and, later,
by the real engine stack).

`DPLoadBalancer` is `DPLBAsyncMPClient.get_core_engine_for_request` (`v1/engine/core_client.py:1751-1812`):
1. a pinned request (`data_parallel_rank`) bypasses the score (`:1756-1766`);
2. engines are scanned from `eng_start_index` (initially `N * client_index // client_count`,
   `:1747-1749`), `idx = (eng_start_index + i) % N` (`:1774-1776`);
3. `score = max(client_count * inflight[idx], waiting + running)` (`:1786`), `inflight` being this client's
   exact count of its unfinished requests on that engine (`+1` at `:1811`, `-1` when the engine reports the
   request finished, `process_engine_outputs` `:1819-1825`);
4. with `waiting > 0`: `score += waiting * 6.0 * max(0, kv_cache_usage - 0.5)` (`:1793-1794`);
5. a strict `<` keeps the first minimum in scan order (`:1795-1797`);
6. the chosen row's `waiting += client_count` (a local optimistic bump, `:1800`) and
   `eng_start_index = (eng_start_index + 1) % N` (`:1806`), on scored picks only.
The rows `[waiting, running, kv_cache_usage]` (`:1501-1505`) are replaced wholesale by each coordinator
publish (`:1589-1598`), which erases the local bumps.

`DPStatsCoordinator` is the dense (no wave coordination) publishing rule of `DPCoordinatorProc`
(`v1/engine/coordinator.py:152`, `:255-290`, `:375-407`): it keeps the latest `[waiting, running,
kv_cache_usage]` each engine sent and publishes them all `min_stats_update_interval_ms` (100 ms) after the
previous publish if any engine sent stats since, else 5000 ms after it; a change arriving later than that
is published at once (the poll's timeout is `max(0, wait_for - elapsed)`). The first publish happens
as soon as stats arrive (`last_publish_time` starts at 0, the epoch).

`RequestCountsPublisher` is the engine's side (`v1/engine/core.py:1621-1645`): an engine sends its
counts before and after each step, but only when `(running, waiting)` changed since it last sent them;
`waiting` counts `kv_holding_waiting` too (`v1/core/sched/scheduler.py:2920-2926`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

# the KV-pressure penalty of waiting requests (core_client.py:1793-1794)
KV_PENALTY_FACTOR = 6.0
KV_PENALTY_THRESHOLD = 0.5
MIN_STATS_UPDATE_INTERVAL_S = 0.1  # coordinator.py:152 (min_stats_update_interval_ms=100)
IDLE_STATS_UPDATE_INTERVAL_S = 5.0  # coordinator.py:264-266 ("or otherwise every 5 seconds")


def engine_score(waiting: float, running: float, kv_cache_usage: float, inflight: int, client_count: int) -> float:
    """One engine's load score as `DPLBAsyncMPClient` computes it (core_client.py:1786-1794)."""
    score = max(client_count * inflight, waiting + running)
    if waiting:
        score += waiting * KV_PENALTY_FACTOR * max(0.0, kv_cache_usage - KV_PENALTY_THRESHOLD)
    return score


class DPLoadBalancer:
    """One front-end client's engine choice among `num_engines` DP ranks (vLLM's internal LB)."""

    def __init__(self, num_engines: int, client_index: int = 0, client_count: int = 1) -> None:
        if num_engines < 1:
            raise ValueError(f"data_parallel_size: need at least 1 engine, got {num_engines}")
        if not 0 <= client_index < client_count:
            raise ValueError(f"client_index: {client_index} is not in [0, {client_count})")
        self.num_engines = num_engines
        self.client_index = client_index
        self.client_count = client_count
        self.lb_engines: list[list[float]] = [[0, 0, 0.0] for _ in range(num_engines)]
        self.engine_inflight: list[int] = [0] * num_engines
        self.reqs_in_flight: dict[str, int] = {}
        self.eng_start_index = num_engines * client_index // client_count

    def scores(self) -> list[float]:
        """Every engine's current score, in rank order (what the next scored pick compares)."""
        return [engine_score(w, r, kv, self.engine_inflight[i], self.client_count)
                for i, (w, r, kv) in enumerate(self.lb_engines)]

    def choose(self, request_id: str, data_parallel_rank: Optional[int] = None) -> int:
        """The engine (rank) for a new request, with vLLM's bookkeeping for the choice."""
        engine = self.reqs_in_flight.get(request_id)
        if engine is not None:  # streaming-input session affinity (core_client.py:1756-1760)
            return engine
        if data_parallel_rank is not None:
            if not 0 <= data_parallel_rank < self.num_engines:
                raise ValueError(f"data_parallel_rank: {data_parallel_rank} is not in [0, {self.num_engines})")
            engine = data_parallel_rank
        else:
            engine = self._scored_pick()
        self.reqs_in_flight[request_id] = engine
        self.engine_inflight[engine] += 1
        return engine

    def _scored_pick(self) -> int:
        counts = self.lb_engines
        n = len(counts)
        min_score = math.inf
        chosen = 0
        for i in range(n):
            idx = (self.eng_start_index + i) % n
            waiting, running, kv = counts[idx]
            score = engine_score(waiting, running, kv, self.engine_inflight[idx], self.client_count)
            if score < min_score:  # strict: the first minimum in scan order wins
                min_score = score
                chosen = idx
        counts[chosen][0] += self.client_count
        self.eng_start_index = (self.eng_start_index + 1) % n
        return chosen

    def on_finished(self, request_id: str) -> None:
        """The engine reported `request_id` finished (or aborted): its in-flight slot is free."""
        engine = self.reqs_in_flight.pop(request_id, None)
        if engine is not None:
            self.engine_inflight[engine] -= 1

    def on_publish(self, counts: list[list[float]]) -> None:
        """A coordinator publish: the rows are replaced wholesale (the local bumps are gone)."""
        if len(counts) != self.num_engines:
            raise ValueError(f"counts: {len(counts)} rows for {self.num_engines} engines")
        self.lb_engines = [list(row) for row in counts]


@dataclass(slots=True)
class DPStatsCoordinator:
    """The DP coordinator's stats store and publishing schedule (dense DP, times in seconds)."""

    num_engines: int
    min_interval_s: float = MIN_STATS_UPDATE_INTERVAL_S
    idle_interval_s: float = IDLE_STATS_UPDATE_INTERVAL_S
    engines: list[list[float]] = field(init=False)
    stats_changed: bool = field(init=False, default=False)
    last_publish_s: float = field(init=False, default=-math.inf)

    def __post_init__(self) -> None:
        self.engines = [[0, 0, 0.0] for _ in range(self.num_engines)]

    def on_engine_stats(self, engine: int, waiting: int, running: int, kv_cache_usage: float) -> None:
        """An engine's counts arrived (coordinator.py:404-408)."""
        self.engines[engine] = [waiting, running, kv_cache_usage]
        self.stats_changed = True

    def next_publish_s(self, now: float) -> float:
        """When the next publish happens if no stats arrive before it."""
        wait = self.min_interval_s if self.stats_changed else self.idle_interval_s
        return max(now, self.last_publish_s + wait)

    def publish(self, now: float) -> list[list[float]]:
        """The publish at `now`: a copy of every engine's latest counts."""
        self.stats_changed = False
        self.last_publish_s = now
        return [list(row) for row in self.engines]


@dataclass(slots=True)
class RequestCountsPublisher:
    """An engine's `_maybe_publish_request_counts`: stats only when `(running, waiting)` changed."""

    last_counts: Optional[tuple[int, int]] = None

    def maybe_publish(self, running: int, waiting: int, kv_cache_usage: float) -> Optional[tuple[int, int, float]]:
        """`(waiting, running, kv_cache_usage)` to send, or None when the counts are unchanged."""
        counts = (running, waiting)
        if counts == self.last_counts:
            return None
        self.last_counts = counts
        return waiting, running, kv_cache_usage


def replay_lb_trace(trace: list[tuple], num_engines: int) -> dict[str, int]:
    """Feed a recorded balancer stream - `("publish", t, rows)`, `("pick", request_id, rank)`,
    `("finish", request_id)`, in the order the real front end saw them - into a fresh `DPLoadBalancer`
    and return the engine it picks for each request (the recorded ranks are not consulted)."""
    lb = DPLoadBalancer(num_engines)
    picks: dict[str, int] = {}
    for event in trace:
        kind = event[0]
        if kind == "publish":
            lb.on_publish(event[2])
        elif kind == "pick":
            picks[event[1]] = lb.choose(event[1])
        elif kind == "finish":
            lb.on_finished(event[1])
        else:
            raise ValueError(f"trace: unknown event {kind!r}")
    return picks


__all__ = ["DPLoadBalancer", "replay_lb_trace", "DPStatsCoordinator", "RequestCountsPublisher", "engine_score",
           "KV_PENALTY_FACTOR", "KV_PENALTY_THRESHOLD", "MIN_STATS_UPDATE_INTERVAL_S",
           "IDLE_STATS_UPDATE_INTERVAL_S"]
