"""Prefix-cache hit rate over a window of recent requests (vLLM `CachingMetrics`, docs/scheduler_behaviour.md §6.2)."""
from __future__ import annotations

from collections import deque

from servetwin.core.kv_cache.kv_cache_manager import PrefixCacheStats


class CachingMetrics:
    """Aggregates per-step `PrefixCacheStats`; keeps dropping the oldest update while the window holds
    more than `max_recent_requests` requests, but always keeps the latest one."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.query_queue: deque[tuple[int, int, int]] = deque()  # (requests, queries, hits)
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return  # uses the non-preempted fields only; empty updates are ignored
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self.query_queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits

    def reset(self) -> None:
        self.query_queue.clear()
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0

    @property
    def empty(self) -> bool:
        return not self.query_queue

    @property
    def hit_rate(self) -> float:
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
