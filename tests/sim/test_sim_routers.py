"""Routers and llm-d scorers (`servetwin.sim.routers`): worked values from the sources' formulas."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.experiments.config.cluster import PluginConfig, RouterConfig
from servetwin.sim.routers import (ActiveRequestScorer, ApproxPrefixIndex, Endpoint, InFlightLoad,
                                   KVCacheUtilizationScorer, LeastLoaded, LlmdRouter, LoadAwareScorer,
                                   PrefixAffinityFilter, PrefixCacheScorer, QueueScorer, RoundRobin, TokenLoadScorer,
                                   approx_prefix_producer, make_llm_d, prompt_block_keys)


def _eps(*waiting, **kw):
    return [Endpoint(i, f"e{i}", waiting=w, **{k: v[i] for k, v in kw.items()}) for i, w in enumerate(waiting)]


REQ = SimpleNamespace(prompt_token_ids=list(range(100, 164)))  # 4 blocks of 16


def test_queue_scorer_is_min_max_normalised():
    assert QueueScorer().score(REQ, _eps(0, 5, 10)) == [1.0, 0.5, 0.0]
    assert QueueScorer().score(REQ, _eps(3, 3)) == [1.0, 1.0]  # all equal -> 1


def test_load_aware_and_kv_and_token_load_and_active_request():
    assert LoadAwareScorer().score(REQ, _eps(0, 64, 500)) == [0.5, 0.25, 0.0]
    assert KVCacheUtilizationScorer().score(REQ, _eps(0, 0, kv_usage=[0.25, 1.0])) == [0.75, 0.0]
    assert TokenLoadScorer(threshold=1000).score(REQ, _eps(0, 0, 0, active_tokens=[0, 500, 5000])) == [1.0, 0.5, 0.0]
    assert ActiveRequestScorer().score(REQ, _eps(0, 0, 0, active=[0, 2, 4])) == [1.0, 0.5, 0.0]
    assert ActiveRequestScorer().score(REQ, _eps(0, 0)) == [1.0, 1.0]


def test_approximate_prefix_index_scores_routed_prompts_and_never_sees_evictions():
    scorer = PrefixCacheScorer()
    eps = _eps(0, 0)
    assert scorer.score(REQ, eps) == [0.0, 0.0]
    scorer.on_routed(REQ, eps[1])
    half = SimpleNamespace(prompt_token_ids=REQ.prompt_token_ids[:32] + [7] * 32)
    assert scorer.score(half, eps) == [0.0, 0.5]  # 2 of 4 leading blocks
    # the engine may have evicted them long ago: the index still says so (only its own LRU forgets)
    small = ApproxPrefixIndex(capacity=4)
    small.add(0, prompt_block_keys(REQ.prompt_token_ids, 16, 256))
    small.add(0, prompt_block_keys([1] * 32, 16, 256))
    assert small.matches(prompt_block_keys(REQ.prompt_token_ids, 16, 256)).get(0, 0) == 0  # its LRU dropped the head


def test_prefix_affinity_filter_keeps_every_endpoint_at_or_above_the_threshold():
    scorer = PrefixCacheScorer()
    eps = _eps(0, 0, 0, 0)
    scorer.on_routed(REQ, eps[2])
    three_quarters = SimpleNamespace(prompt_token_ids=REQ.prompt_token_ids[:48] + [7] * 16)
    scorer.on_routed(three_quarters, eps[3])
    assert PrefixAffinityFilter(scorer).filter(REQ, eps) == [2]  # 3 of 4 blocks at eps[3]: below 0.80
    assert PrefixAffinityFilter(scorer, threshold=0.75).filter(REQ, eps) == [2, 3]  # not only the best
    other = SimpleNamespace(prompt_token_ids=[9] * 64)
    assert PrefixAffinityFilter(scorer).filter(other, eps) == [0, 1, 2, 3]  # nothing sticky: all stay


def test_prefix_affinity_filter_ttft_load_gate_breaks_stickiness():
    """llm-d-router prefixcacheaffinity: estimated TTFT = in-flight tokens / peakPrefillThroughput; the gate
    opens (every endpoint stays) when the best sticky one is more than maxTTFTPenaltyMs behind the best other."""
    scorer = PrefixCacheScorer()
    eps = _eps(0, 0, 0, active_tokens=[2_000, 500, 12_000])  # at 1,000 tok/s: 2 s, 0.5 s, 12 s
    scorer.on_routed(REQ, eps[2])

    def kept(max_penalty_ms):
        return PrefixAffinityFilter(scorer, max_ttft_penalty_ms=max_penalty_ms,
                                    peak_prefill_throughput=1_000.0).filter(REQ, eps)
    assert kept(12_000.0) == [2]  # 11.5 s behind: tolerated
    assert kept(11_000.0) == [0, 1, 2]  # more than 11 s behind: stickiness broken
    assert kept(0.0) == [2]  # 0 turns the gate off
    with pytest.raises(TypeError):
        PrefixAffinityFilter(scorer, threshold=1.5)


def test_llm_d_picks_the_best_weighted_sum_with_random_tie_breaks():
    router = LlmdRouter([(QueueScorer(), 2.0), (LoadAwareScorer(), 1.0)], np.random.default_rng(0))
    d = router.route(REQ, _eps(4, 0, 8))
    assert d.pick == 1 and d.scores == pytest.approx([2 * 0.5 + 0.5 * (1 - 4 / 128), 2.5, 0.5 * (1 - 8 / 128)])
    picks = {router.route(REQ, _eps(1, 1, 1)).pick for _ in range(60)}
    assert picks == {0, 1, 2}  # ties broken at random


def test_round_robin_and_least_loaded():
    rr = RoundRobin()
    assert [rr.route(REQ, _eps(0, 0, 0)).pick for _ in range(4)] == [0, 1, 2, 0]
    assert LeastLoaded().route(REQ, _eps(0, 0, 0, active=[3, 1, 1])).pick == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=8), st.integers(0, 2**31))
def test_llm_d_pick_has_the_maximum_score(waiting, seed):
    router = LlmdRouter([(QueueScorer(), 1.0), (LoadAwareScorer(), 2.0)], np.random.default_rng(seed))
    d = router.route(REQ, _eps(*waiting))
    assert d.scores[d.pick] == max(d.scores)


def test_pyproject_registers_every_built_in_router_and_scorer():
    import tomllib
    from pathlib import Path

    from servetwin.sim import routers

    eps = tomllib.loads((Path(routers.__file__).parents[1] / "pyproject.toml").read_text())["project"]["entry-points"]
    assert {k: v.rsplit(":", 1)[1] for k, v in eps["servetwin.routers"].items()} == {
        k: f.__name__ for k, f in routers.ROUTERS.items()}
    assert {k: v.rsplit(":", 1)[1] for k, v in eps["servetwin.router_scorers"].items()} == {
        k: f.__name__ for k, f in routers.SCORERS.items()}


def test_a_user_router_and_scorer_load_through_their_entry_points(monkeypatch):
    import importlib.metadata

    from servetwin.experiments.config.cluster import PluginConfig, RouterConfig
    from servetwin.sim import routers

    class Always:
        def __init__(self, spec, rng):
            self.target = spec.params["target"]

        def route(self, request, endpoints):
            return routers.RouteDecision(self.target)

    class Constant:
        def __init__(self, value=0.0):
            self.value = value

        def score(self, request, endpoints):
            return [self.value] * len(endpoints)

    def fake_entry_points(group):
        table = {"servetwin.routers": {"always": Always}, "servetwin.router_scorers": {"constant": Constant}}
        return [SimpleNamespace(name=n, load=lambda f=f: f) for n, f in table.get(group, {}).items()]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    r = routers.build_router(RouterConfig("always", params={"target": 2}), np.random.default_rng(0))
    assert r.route(REQ, _eps(0, 0, 0)).pick == 2
    llmd = routers.build_router(RouterConfig("llm_d", scorers=[PluginConfig("constant", 1.0, {"value": 0.3})]),
                                np.random.default_rng(0))
    assert llmd.route(REQ, _eps(0, 0)).scores == [0.3, 0.3]


def test_precise_prefix_index_follows_the_kv_events():
    from servetwin.sim.routers import PrecisePrefixCacheScorer

    keys = [b"a", b"b", b"c", b"d"]
    eps = [Endpoint(i, f"e{i}", block_keys=lambda tokens: keys) for i in range(2)]
    scorer = PrecisePrefixCacheScorer()
    scorer.on_kv_events(1, [("stored", k) for k in keys[:3]])
    assert scorer.score(REQ, eps) == [0.0, 0.75]
    scorer.on_kv_events(1, [("removed", b"b")])  # an eviction breaks the leading run
    assert scorer.score(REQ, eps) == [0.0, 0.25]
    scorer.on_kv_events(1, [("cleared", None)])
    assert scorer.score(REQ, eps) == [0.0, 0.0]


def test_the_pd_decider_disaggregates_above_16_non_cached_tokens():
    from servetwin.sim.routers import PrefixBasedPDDecider

    d = PrefixBasedPDDecider()
    assert d.disaggregate(100, 0) and d.disaggregate(100, 83)
    assert not d.disaggregate(100, 84) and not d.disaggregate(16, 0)


# -- llm-d's inflight-load-producer (InFlightLoad) --------------------------------------------------------------
def _request(rid, tokens, max_tokens=500):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(tokens), max_tokens=max_tokens)


def test_in_flight_load_charges_uncached_prompt_tokens_until_the_first_token():
    """llm-d-router inflightload/producer.go (7f6c33663): PreRequest charges the prompt tokens the endpoint's
    approximate index does not hold; with no output estimate (the default) StartOfStream releases them and
    EndOfStream the request count."""
    prefix = PrefixCacheScorer()
    load = InFlightLoad(prefix)
    eps = _eps(0, 0)
    a = _request("a", REQ.prompt_token_ids + [5] * 10)  # 74 tokens: 4 full blocks + a 10-token tail
    assert load.request_tokens(a, 0) == 74  # nothing indexed: the whole prompt
    load.on_routed(a, 0)
    prefix.on_routed(a, eps[0])  # (the router: producer first, then the index learns the prompt)
    assert load.tokens_at(0) == 74 and load.requests[0] == 1
    b = _request("b", REQ.prompt_token_ids + [6] * 10)
    assert load.request_tokens(b, 0) == 10 and load.request_tokens(b, 1) == 74  # 4 blocks matched at 0
    load.on_routed(b, 0)
    assert load.tokens_at(0) == 84
    load.on_first_token("a")
    assert load.tokens_at(0) == 10 and load.requests[0] == 2  # tokens freed, the request still in flight
    load.on_finished("a")
    load.on_finished("b")  # finished without a first token seen: its tokens go too
    assert load.tokens_at(0) == 0 and load.requests[0] == 0 and not load.charged
    load.on_finished("b")  # twice: no-op


def test_in_flight_load_with_estimated_output_holds_tokens_to_the_end():
    """addEstimatedOutputTokens: + round(prompt x 1.5) bounded by max_tokens, released only at EndOfStream."""
    load = InFlightLoad(add_estimated_output_tokens=True)  # no prefix index: no discount
    r = _request("r", range(100), max_tokens=40)
    assert load.request_tokens(r, 0) == 100 + 40  # min(150, 40)
    assert load.request_tokens(_request("s", range(100), max_tokens=1000), 0) == 100 + 150
    load.on_routed(r, 0)
    load.on_first_token("r")
    assert load.tokens_at(0) == 140
    load.on_finished("r")
    assert load.tokens_at(0) == 0
    with pytest.raises(TypeError):
        InFlightLoad(output_ratio=-1.0)


def test_token_load_scorer_and_the_gate_read_the_producer():
    """token_load.go: InFlightLoad.Tokens + UncachedRequestTokens; the affinity filter's TTFT gate reads
    InFlightLoad.Tokens / peakPrefillThroughput."""
    prefix = PrefixCacheScorer()
    load = InFlightLoad(prefix)
    eps = _eps(0, 0, 0, active_tokens=[0, 0, 10**9])  # the router's own counts are not read any more
    load.on_routed(_request("x", [9] * 500), 1)  # 500 uncached tokens in flight at 1
    prefix.on_routed(REQ, eps[2])
    scores = TokenLoadScorer(threshold=1000, load=load).score(_request("q", REQ.prompt_token_ids), eps)
    assert scores == pytest.approx([1 - 64 / 1000, 1 - 564 / 1000, 1.0])  # 2 holds it: adds nothing
    gate = PrefixAffinityFilter(prefix, max_ttft_penalty_ms=400.0, peak_prefill_throughput=1_000.0, load=load)
    assert gate.filter(REQ, eps) == [2]  # sticky 2 has no load
    load.on_routed(_request("y", [8] * 500), 2)
    assert gate.filter(REQ, eps) == [0, 1, 2]  # 2: 500 ms, best other 0 ms: over 400 ms, all stay


def test_make_llm_d_wires_the_producer_and_the_router_releases_it():
    spec = RouterConfig(type="llm_d", scorers=[PluginConfig("token-load")],
                        filters=[PluginConfig("prefix-cache-affinity")], params={"in_flight_load": {}})
    router = make_llm_d(spec, np.random.default_rng(0))
    assert router.wants_first_token and router.scorers[0][0].load is router.load
    assert router.filters[0].load is router.load and router.load.prefix is router.filters[0].scorer
    eps = _eps(0, 0, 0)
    first = _request("g0", REQ.prompt_token_ids)
    d = router.route(first, eps)
    router.on_routed(first, eps[d.pick])
    assert router.load.tokens_at(d.pick) == 64  # charged the pre-routing match (nothing)
    again = _request("g1", REQ.prompt_token_ids)
    assert router.route(again, eps).pick == d.pick  # sticky
    router.on_routed(again, eps[d.pick])
    assert router.load.tokens_at(d.pick) == 64  # fully indexed: no uncached tokens
    router.on_first_token("g0")
    router.on_finished("g0")
    router.on_finished("g1")
    assert router.load.tokens_at(d.pick) == 0 and router.load.requests[d.pick] == 0
    plain = make_llm_d(RouterConfig(type="llm_d", scorers=[PluginConfig("token-load")]), np.random.default_rng(0))
    assert not plain.wants_first_token and plain.scorers[0][0].load is None
    with pytest.raises(ConfigError) as e:
        make_llm_d(RouterConfig(type="llm_d", params={"in_flight": {}}), np.random.default_rng(0))
    assert e.value.path == "cluster.router.params.in_flight"
    with pytest.raises(ConfigError) as e:
        make_llm_d(RouterConfig(type="llm_d", params={"in_flight_load": {"ratio": 2}}), np.random.default_rng(0))
    assert e.value.path == "cluster.router.params.in_flight_load"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 80), st.booleans()), min_size=1, max_size=30),
       st.booleans())
def test_in_flight_load_counts_return_to_zero(routes, estimate):
    """Whatever the order of first tokens and ends, every charge is released exactly once."""
    load = InFlightLoad(PrefixCacheScorer(), add_estimated_output_tokens=estimate)
    for k, (endpoint, n, first) in enumerate(routes):
        r = _request(k, [k % 3] * n)
        load.on_routed(r, endpoint)
        load.prefix.index.add(endpoint, load.prefix.keys(r))
        if first:
            load.on_first_token(k)
        assert all(v >= 0 for v in load.tokens.values())
    for k in range(len(routes)):
        load.on_finished(k)
    assert set(load.tokens.values()) <= {0} and set(load.requests.values()) <= {0}


# -- llm-d-router's approx-prefix-cache-producer (params.approx_prefix) ------------------------------------------
def test_prompt_block_keys_with_the_tail_block_hash_the_partial_last_block():
    """hashing.go:119 (7f6c33663) yields the prompt's last partial block too, within maxPrefixBlocks."""
    tokens = list(range(70))  # 4 full blocks of 16 and 6 tokens
    full = prompt_block_keys(tokens, 16, 256)
    tail = prompt_block_keys(tokens, 16, 256, tail_block=True)
    assert len(full) == 4 and tail[:4] == full and len(tail) == 5
    assert prompt_block_keys(tokens[:-1] + [999], 16, 256, tail_block=True)[4] != tail[4]  # the tail's tokens count
    assert prompt_block_keys(tokens, 16, 4, tail_block=True) == full  # the cap reached: no tail
    assert prompt_block_keys(tokens[:64], 16, 256, tail_block=True) == full  # no partial block
    assert prompt_block_keys(tokens[:10], 16, 256, tail_block=True) == [hash((0, tuple(range(10))))]


def test_the_producer_defaults_and_auto_tune_read_the_engines():
    """defaultConfig (types.go:146): autoTune, 16-token blocks floored at 64 (plugin.go:296-306), 131,072 tokens;
    tuned, the first endpoint's block size and each endpoint's KV blocks as its LRU capacity (plugin.go:255)."""
    p = approx_prefix_producer()
    assert (p.block_tokens, p.max_blocks, p.tail_block, p.auto_tune) == (64, 2048, True, True)
    eps = [Endpoint(i, f"e{i}", block_size=128, num_gpu_blocks=1834 + i) for i in range(3)]
    p.tune(eps)
    assert (p.block_tokens, p.max_blocks, p.index.capacities) == (128, 1024, {0: 1834, 1: 1835, 2: 1836})
    q = approx_prefix_producer(max_prefix_tokens=40_960)
    q.tune([Endpoint(0, "e", block_size=16)])
    assert (q.block_tokens, q.max_blocks, q.index.capacities) == (64, 640, {})  # floored; capacity stays 31,250
    fixed = approx_prefix_producer(auto_tune=False, block_tokens=256)
    fixed.tune(eps)
    assert (fixed.block_tokens, fixed.max_blocks) == (256, 512)
    with pytest.raises(TypeError):
        approx_prefix_producer(block_size=64)


def test_the_producer_charges_what_llm_d_router_charges():
    """uncachedInputTokens (producer.go:521): (total - matched) blocks x block size + the tokens beyond the
    indexed ones. A 6,500-token prompt in 128-token blocks is 51 blocks (50 full and a 100-token tail): new, it
    costs 51 x 128 (the tail block counted whole, as there); sent again, nothing; a prompt sharing its first
    6,000 tokens matches 46 blocks and costs 5 x 128."""
    p = approx_prefix_producer()
    eps = [Endpoint(i, f"e{i}", block_size=128, num_gpu_blocks=2000) for i in range(2)]
    p.tune(eps)
    shared = list(range(6000))
    first = _request("a", shared + [1] * 500)
    assert p.uncached_tokens(first, 0) == 6528
    p.on_routed(first, eps[0])
    assert p.uncached_tokens(first, 0) == 0 and p.score(first, eps) == [1.0, 0.0]
    member = _request("b", shared + [2] * 500)
    assert p.uncached_tokens(member, 0) == 640 and p.uncached_tokens(member, 1) == 6528
    assert p.score(member, eps) == [46 / 51, 0.0]
    # GIE's plugin (16-token full blocks, 256 at most) matched 4,096 tokens of either
    gie = PrefixCacheScorer()
    gie.on_routed(first, eps[0])
    assert gie.uncached_tokens(first, 0) == 2404 and gie.uncached_tokens(member, 0) == 2404


def test_the_index_walks_the_keys_as_match_longest_prefix_does():
    """matchLongestPrefix (plugin.go:265): walk while some endpoint holds the key; an endpoint counts every
    walked key it holds. Evictions drop the LRU's oldest keys, the prompt's first blocks first."""
    index = ApproxPrefixIndex(capacity=3)
    index.add(0, [1, 2, 3])
    index.add(1, [1, 2])
    assert index.matches([1, 2, 3, 4]) == {0: 3, 1: 2}
    index.add(0, [7, 8])  # capacity 3: 1 and 2 leave endpoint 0
    assert index.lru[0] == {3: None, 7: None, 8: None} and index.holders[1] == {1}
    assert index.matches([1, 2, 3]) == {1: 2, 0: 1}  # 3 is walked (1 and 2 are held by endpoint 1)
    assert index.matches([7, 8]) == {0: 2} and index.matches([7, 8]).get(1, 0) == 0
    index.add(1, [9, 10])  # 1 and 2 leave endpoint 1 too: nobody holds 1, the walk stops at once
    assert index.matches([1, 2, 3]) == {} and 1 not in index.holders


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(1, 90)), min_size=1, max_size=25),
       st.booleans())
def test_without_evictions_each_endpoint_matches_its_leading_run(routes, tail):
    """With room for every key, the walk gives each endpoint the leading run of the prompt's keys it holds
    (a chained key is held only with every key before it): the per-endpoint walk of the index before."""
    scorer = PrefixCacheScorer(block_tokens=8, tail_block=tail)
    eps = [Endpoint(i, f"e{i}") for i in range(4)]
    for k, (endpoint, group, n) in enumerate(routes):
        r = _request(k, [group] * 40 + [k] * n)
        keys = scorer.keys(r)
        got = scorer.matches(r)
        for e in eps:
            table = scorer.index.lru.get(e.index, {})
            run = 0
            while run < len(keys) and keys[run] in table:
                run += 1
            assert got.get(e.index, 0) == run
        scorer.on_routed(r, eps[endpoint])


def test_router_params_approx_prefix_is_the_one_index_and_names_bad_fields():
    spec = RouterConfig(type="llm_d", scorers=[PluginConfig("token-load"), PluginConfig("prefix-cache", weight=2)],
                        filters=[PluginConfig("prefix-cache-affinity")],
                        params={"in_flight_load": {}, "approx_prefix": {"max_prefix_tokens": 40_960}})
    router = make_llm_d(spec, np.random.default_rng(0))
    producer = router.filters[0].scorer
    assert producer.auto_tune and producer.tail_block and router.load.prefix is producer
    assert router.scorers[1] == (producer, 2)
    eps = [Endpoint(i, f"e{i}", block_size=128, num_gpu_blocks=900) for i in range(3)]
    r = _request("r", range(300))
    router.on_routed(r, eps[router.route(r, eps).pick])
    assert (producer.block_tokens, producer.max_blocks, producer.index.capacities[2]) == (128, 320, 900)
    for params, path in [({"approx_prefix": {"blocks": 1}}, "cluster.router.params.approx_prefix"),
                         ({"approx_prefix": 5}, "cluster.router.params.approx_prefix"),
                         ({"approx": {}}, "cluster.router.params.approx")]:
        with pytest.raises(ConfigError) as e:
            make_llm_d(RouterConfig(type="llm_d", params=params), np.random.default_rng(0))
        assert e.value.path == path
    with pytest.raises(ConfigError) as e:
        make_llm_d(RouterConfig(type="llm_d", scorers=[PluginConfig("prefix-cache", params={"block_tokens": 8})],
                                params={"approx_prefix": {}}), np.random.default_rng(0))
    assert e.value.path == "cluster.router.scorers[0].params"
