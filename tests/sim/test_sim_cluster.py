"""Many engines in one simulation (`servetwin.sim.cluster`): one instance equals the single-engine run,
every request is routed exactly once and served where it was routed, DP ranks share their instance's load."""
from __future__ import annotations

import copy
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.experiments.config.schema import validate_config
from servetwin.experiments.run.cluster_run import simulate_cluster
from servetwin.experiments.run.runner import run_backends, summarize

BASE = {
    "name": "c", "model": "tiny-llama", "hardware": "h100-sxm",
    "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 16, "max_model_len": 512},
    "workload": {"requests": 40, "prompt_tokens": {"type": "lognormal", "mean": 120, "cv": 0.5},
                 "output_tokens": {"type": "lognormal", "mean": 30, "cv": 0.5}, "max_prompt_tokens": 300,
                 "max_output_tokens": 80, "arrival": {"type": "poisson", "rate": 40}},
    "output": {"step_requests": False, "plots": False},
}
WALL = ("wall_s", "sim_speedup_x")


def _cfg(cluster=None, engine=None, **workload):
    raw = copy.deepcopy(BASE)
    raw["engine"].update(engine or {})
    if "shared_prefix" in workload:
        del raw["workload"]["prompt_tokens"]
    raw["workload"].update(workload)
    if cluster is not None:
        raw["cluster"] = cluster
    return validate_config(raw)


def _portable(summary):
    return json.dumps({k: v for k, v in summary.items() if k not in WALL}, sort_keys=True, default=str)


_ARRIVALS = st.sampled_from([{"type": "poisson", "rate": 40}, {"type": "poisson", "rate": 400}, {"type": "offline"},
                             {"type": "closed_loop", "clients": 6}])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ARRIVALS, st.booleans(), st.sampled_from(["offline", "api_server"]), st.integers(0, 3),
       st.sampled_from(["round_robin", "random", "least_loaded"]))
def test_one_instance_gives_the_single_engine_summary_byte_for_byte(arrival, async_scheduling, frontend, seed, router):
    def raw(cluster):
        cfg = _cfg(cluster, arrival=arrival, seed=seed).to_dict()
        cfg["engine"]["async_scheduling"] = async_scheduling
        cfg["frontend"] = {"type": frontend}
        return validate_config(cfg)
    single = raw(None)
    assert single.cluster is None  # a YAML without `cluster:` is the one-engine experiment it was
    combined, _, _ = run_backends(single, progress=False, log=lambda m: None)
    exp = raw({"instances": [{"name": "only"}], "router": {"type": router}})
    _, runs, _, _ = simulate_cluster(exp)
    (run,) = runs.values()
    frames = run.recorder.frames()
    cluster_summary = summarize(run, frames, exp, run.recorder.itl_array())
    assert _portable(cluster_summary) == _portable(combined["backends"]["sim"])


_layouts = st.lists(st.tuples(st.integers(1, 2), st.integers(1, 2)), min_size=1, max_size=2)
_routers = st.sampled_from([{"type": "round_robin"}, {"type": "random"}, {"type": "least_loaded"},
                            {"type": "llm_d", "filters": [{"type": "prefix-cache-affinity"}],
                             "scorers": [{"type": "queue", "weight": 2}, {"type": "prefix-cache", "weight": 3},
                                         {"type": "load-aware"}, {"type": "token-load"}]},
                            {"type": "llm_d", "scorers": [{"type": "kv-cache-utilization"},
                                                          {"type": "active-request"},
                                                          {"type": "precise-prefix-cache"}]}])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layouts, _routers, st.integers(0, 3), st.sampled_from([20.0, 200.0]))
def test_every_request_is_routed_once_and_served_where_it_was_routed(layout, router, seed, rate):
    instances = [{"name": f"g{i}", "count": count, "data_parallel_size": dp} for i, (count, dp) in enumerate(layout)]
    raw_seed = {"requests": 24, "seed": seed, "arrival": {"type": "poisson", "rate": rate}}
    exp = _cfg({"instances": instances, "router": router}, **raw_seed)
    sim, runs, requests, _ = simulate_cluster(exp)
    ids = [r.request_id for r in requests]
    routed = [d.request_id for d in sim.result.decisions]
    assert sorted(routed) == sorted(ids) and len(set(routed)) == len(routed)  # exactly once
    assert set(sim.result.completion_s) | set(sim.result.rejected) == set(ids)
    served = {}
    for label, run in runs.items():
        for rid in run.recorder.requests:
            assert rid not in served  # one engine per request
            served[rid] = label
    for d in sim.result.decisions:  # ... the engine its instance's balancer chose
        dp = dict((inst.name, inst.data_parallel_size) for inst in exp.cluster.instances)
        group = d.pick.rsplit("-", 1)[0] if d.pick not in dp else d.pick
        label = d.pick if dp[group] == 1 else f"{d.pick}-r{d.rank}"
        assert served[d.request_id] == label
    assert sum(run.completed for run in runs.values()) == len(sim.result.completion_s)
    for run in runs.values():  # no engine's KV cache is over-committed
        steps = run.recorder.steps.to_frame()
        assert (steps.kv_free_blocks >= 0).all() and (steps.kv_usage <= 1.0).all()


def test_dense_dp_ranks_share_a_burst_and_stay_independent():
    exp = _cfg({"instances": [{"name": "dp", "data_parallel_size": 4}]}, requests=40,
               arrival={"type": "poisson", "rate": 2000})
    sim, runs, _, _ = simulate_cluster(exp)
    counts = [run.num_requests for run in runs.values()]
    assert len(counts) == 4 and sum(counts) == 40
    # the in-flight floor spreads a burst (the coordinator's counts lag it): no rank takes most of it
    assert max(counts) - min(counts) <= 4
    assert all(len(run.recorder.steps.to_frame()) > 0 for run in runs.values())


def test_round_robin_cycles_through_the_instances():
    exp = _cfg({"instances": [{"name": "r", "count": 3}], "router": {"type": "round_robin"}}, requests=9)
    sim, _, _, _ = simulate_cluster(exp)
    assert [d.pick for d in sim.result.decisions] == ["r-0", "r-1", "r-2"] * 3
    assert all(d.scores is None for d in sim.result.decisions)


def test_the_dp_coordinator_publishes_at_most_every_100ms_and_aborts_free_in_flight_slots():
    exp = _cfg({"instances": [{"name": "dp", "count": 2, "data_parallel_size": 2}], "router": {"type": "least_loaded"}},
               requests=60, timeout_s=0.05, arrival={"type": "poisson", "rate": 400})
    sim, _, reqs, _ = simulate_cluster(exp)
    for times in sim.result.publishes.values():
        assert times and all(b - a >= 0.1 - 1e-9 for a, b in zip(times, times[1:]))
    assert sim.result.aborted_s  # some clients gave up
    assert set(sim.result.completion_s) | set(sim.result.aborted_s) | set(sim.result.rejected) == {
        r.request_id for r in reqs}
    assert all(e.active == 0 and e.active_tokens == 0 for e in sim.endpoints)  # every slot freed
    for inst in sim.instances:
        assert inst.lb.engine_inflight == [0, 0] and not inst.lb.reqs_in_flight


def test_precise_prefix_routing_sees_the_engines_cache_after_the_event_delay():
    """Shared-prefix groups behind the precise scorer alone: once a group's prefix is cached somewhere (and its
    events arrived), the group's later requests go there; the index equals the engines' caches at the end."""
    shared = {"groups": 4, "per_group": 8, "prefix_tokens": 128, "suffix_tokens": 16, "order": "shuffled"}
    router = {"type": "llm_d", "scorers": [{"type": "precise-prefix-cache", "event_delay_s": 0.002}]}
    # a 4,096-block pool, not the H100's millions (which the check below materialises): the 32 requests use
    # under 400 blocks, so nothing is evicted in either and the run is the same (checked: the same decisions,
    # completion times and index)
    exp = _cfg({"instances": [{"name": "p", "count": 4}], "router": router}, {"num_gpu_blocks": 4096}, requests=32,
               shared_prefix=shared, arrival={"type": "poisson", "rate": 20})
    sim, runs, reqs, _ = simulate_cluster(exp)
    scorer = sim.router.scorers[0][0]
    for inst in sim.instances:  # the index is the cache: every event reached it
        pool = inst.ranks[0].engine.scheduler.kv_cache_manager.block_pool
        cached = {b.block_hash for b in pool.blocks if b.block_hash is not None}
        assert scorer.index.get(inst.index, set()) == cached
    prefix = {r.request_id: tuple(r.prompt_token_ids[:128]) for r in reqs}
    first_pick, hits = {}, 0
    decisions = sorted(sim.result.decisions, key=lambda d: d.t)
    for d in decisions:
        group = prefix[d.request_id]
        if group in first_pick and max(x for x in d.scores if x == x) > 0:
            hits += 1
            assert d.pick == d.candidates[max(range(len(d.scores)), key=lambda i: d.scores[i])]
        first_pick.setdefault(group, d.pick)
    assert hits > 0


def test_external_and_hybrid_dp_load_balancing_make_the_ranks_endpoints():
    exp = _cfg({"instances": [{"name": "x", "data_parallel_size": 4, "data_parallel_lb": "external"},
                              {"name": "y", "data_parallel_size": 4, "data_parallel_lb": "hybrid",
                               "data_parallel_size_local": 2}],
                "router": {"type": "round_robin"}}, requests=24)
    sim, runs, _, _ = simulate_cluster(exp)
    assert [e.name for e in sim.endpoints] == ["x-r0", "x-r1", "x-r2", "x-r3", "y-n0", "y-n1"]
    assert [len(inst.ranks) for inst in sim.instances] == [1, 1, 1, 1, 2, 2]
    assert [inst.lb is not None for inst in sim.instances] == [False] * 4 + [True] * 2  # balanced inside a node
    assert [d.pick for d in sim.result.decisions[:6]] == [e.name for e in sim.endpoints]  # the router picks ranks
    assert set(runs) == {"x-r0", "x-r1", "x-r2", "x-r3", "y-n0-r0", "y-n0-r1", "y-n1-r0", "y-n1-r1"}
    assert exp.cluster.num_gpus() == 8


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.booleans(), st.sampled_from(["offline", "api_server"]), st.integers(0, 3))
def test_llm_d_in_flight_load_is_released_at_each_first_token_and_at_each_end(async_scheduling, frontend, seed):
    """llm-d's inflight-load-producer in a cluster: every request is charged once when routed, its prompt tokens
    released at its first token (while it still runs) and its request count at its end; nothing stays charged."""
    shared = {"groups": 3, "per_group": 6, "prefix_tokens": 96, "suffix_tokens": 16, "order": "shuffled"}
    router = {"type": "llm_d", "scorers": [{"type": "token-load"}], "filters": [{"type": "prefix-cache-affinity"}],
              "params": {"in_flight_load": {}}}
    cfg = _cfg({"instances": [{"name": "p", "count": 3}], "router": router}, {"async_scheduling": async_scheduling},
               requests=18, shared_prefix=shared, seed=seed, arrival={"type": "poisson", "rate": 30}).to_dict()
    cfg["frontend"] = {"type": frontend}
    exp = validate_config(cfg)
    sim, runs, reqs, _ = simulate_cluster(exp)
    load = sim.router.load
    assert all(inst.ranks[0].hooks.on_first_token is not None for inst in sim.instances)
    assert len(sim.result.completion_s) == len(reqs) == 18
    assert not load.charged and all(v == 0 for v in load.tokens.values())
    assert all(v == 0 for v in load.requests.values())


def test_the_engines_share_the_prompts_block_hashes_and_keep_the_chained_ones():
    """A cluster's engines keep their prompts' full-block hashes in one memo (a prompt list sent to several engines is
    hashed once), and the kept hashes are the chain of `hash_block_tokens` over the prompt's full blocks."""
    from servetwin.core.kv_cache.hashing import hash_block_tokens, make_none_hash, sha256

    shared = {"groups": 2, "per_group": 2, "prefix_tokens": 64, "suffix_tokens": 16, "order": "inference_perf"}
    exp = _cfg({"instances": [{"name": "r", "count": 3}], "router": {"type": "round_robin"}, "sim_workers": 1},
               requests=24, shared_prefix=shared, arrival={"type": "stages", "stages": [{"rate": 20, "duration_s": 1.2}]})
    sim, _, requests, _ = simulate_cluster(exp)  # (one process: its engines' memos are read here)
    memos = {id(s.engine.scheduler.block_hasher.prompt_memo) for _, _, s in sim.simulations()}
    assert len(memos) == 1
    memo = next(s for _, _, s in sim.simulations()).engine.scheduler.block_hasher.prompt_memo
    prompts = {id(r.prompt_token_ids): r.prompt_token_ids for r in requests}
    assert len(prompts) < len(requests)  # (prompt lists sent again, to several engines: round robin over 3)
    for prompt in prompts.values():
        kept = memo.get(prompt, (16, sha256))
        assert kept is not None
        parent, chain = make_none_hash(sha256), []
        for start in range(0, len(prompt) // 16 * 16, 16):
            parent = hash_block_tokens(sha256, parent, prompt[start:start + 16], None)
            chain.append(parent)
        assert list(kept) == chain
