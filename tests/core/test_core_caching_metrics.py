from servetwin.core.kv_cache.caching_metrics import CachingMetrics
from servetwin.core.kv_cache.kv_cache_manager import PrefixCacheStats


def test_window_of_recent_requests():
    m = CachingMetrics(max_recent_requests=5)
    assert m.empty and m.hit_rate == 0.0
    m.observe(PrefixCacheStats(requests=2, queries=20, hits=9))
    assert m.hit_rate == 0.45
    m.observe(PrefixCacheStats(requests=3, queries=80, hits=16))
    assert m.hit_rate == 0.25  # 25 / 100 over exactly 5 requests
    m.observe(PrefixCacheStats(requests=1, queries=10, hits=2))
    assert m.aggregated_requests == 4 and m.hit_rate == 0.2  # oldest update dropped: 18 / 90
    m.observe(PrefixCacheStats(requests=1, queries=10, hits=10, reset=True))
    assert m.aggregated_requests == 1 and m.hit_rate == 1.0


def test_empty_updates_are_ignored_and_latest_always_kept():
    m = CachingMetrics(max_recent_requests=5)
    m.observe(PrefixCacheStats())
    assert m.empty
    m.observe(PrefixCacheStats(requests=11, queries=100, hits=50))
    assert not m.empty and m.aggregated_requests == 11 and m.hit_rate == 0.5


def test_empty_distinguishes_no_queries_from_no_hits():
    m = CachingMetrics()
    m.observe(PrefixCacheStats(requests=1, queries=10, hits=0))
    assert not m.empty and m.hit_rate == 0.0


def test_preempted_fields_do_not_count():
    m = CachingMetrics()
    m.observe(PrefixCacheStats(preempted_requests=1, preempted_queries=10, preempted_hits=10))
    assert m.empty
