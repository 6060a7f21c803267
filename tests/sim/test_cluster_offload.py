"""CPU KV offload tiers per cluster instance (`servetwin.sim.cluster_offload`, docs/cluster.md): a prefix set
larger than the HBM pool hits the CPU tier and prefills less than without it; one instance with the tier is
the single-engine run with the same `kv_transfer_config`; the tiered prefix scorer sees the CPU tier."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.hashing import make_block_hash_with_group_id
from servetwin.core.kv_connector.cpu_tier import LookupResult, make_offload_key
from servetwin.experiments.config.cluster import instance_engine_args
from servetwin.experiments.config.schema import validate_config
from servetwin.experiments.run.cluster_run import simulate_cluster
from servetwin.experiments.run.runner import run_backends, summarize
from servetwin.sim.cluster_offload import cpu_tier_totals
from servetwin.sim.routers import Endpoint, TieredPrefixCacheScorer

# 40 blocks of 16 tokens hold three 200-token prefixes; 30 groups share them: the prefix set exceeds HBM
BASE = {
    "name": "c", "model": "tiny-llama", "hardware": "h100-sxm",
    "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 16, "max_model_len": 512,
               "num_gpu_blocks": 40},
    "workload": {"requests": 150, "shared_prefix": {"groups": 30, "per_group": 5, "prefix_tokens": 200,
                                                    "suffix_tokens": 20, "order": "shuffled"},
                 "output_tokens": {"type": "lognormal", "mean": 20, "cv": 0.5}, "max_output_tokens": 60,
                 "arrival": {"type": "poisson", "rate": 40}},
    "output": {"step_requests": False, "plots": False},
}
CPU_TIER = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
WALL = ("wall_s", "sim_speedup_x")


def _raw(cluster=None, engine=None, **workload):
    raw = copy.deepcopy(BASE)
    raw["workload"].update(workload)
    raw["engine"].update(engine or {})
    if cluster is not None:
        raw["cluster"] = cluster
    return raw


def _prefilled(runs) -> int:
    return sum(int(run.recorder.steps.to_frame().num_context_tokens.sum()) for run in runs.values())


@pytest.mark.parametrize("router", [{"type": "round_robin"},
                                    {"type": "llm_d", "scorers": [{"type": "tiered-prefix-cache"},
                                                                  {"type": "queue"}]}])
def test_a_prefix_set_larger_than_hbm_hits_the_cpu_tier_and_prefills_less(router):
    def run(tier):
        inst = {"name": "r", "count": 2}
        if tier:
            inst["engine"] = {"kv_transfer_config": CPU_TIER}
        sim, runs, reqs, _ = simulate_cluster(validate_config(_raw({"instances": [inst], "router": router})))
        assert set(sim.result.completion_s) == {r.request_id for r in reqs}
        return sim, runs
    sim, runs = run(True)
    totals = cpu_tier_totals([s.engine for _, _, s in sim.simulations()])
    assert totals["hits"] > 0 and totals["load_bytes"] > 0 and totals["store_bytes"] > 0
    base_sim, base_runs = run(False)
    assert cpu_tier_totals([s.engine for _, _, s in base_sim.simulations()]) is None
    assert _prefilled(runs) < _prefilled(base_runs)
    for r in runs.values():  # no engine's KV cache is over-committed
        steps = r.recorder.steps.to_frame()
        assert (steps.kv_free_blocks >= 0).all() and (steps.kv_usage <= 1.0).all()


def _portable(summary):
    return json.dumps({k: v for k, v in summary.items() if k not in WALL}, sort_keys=True, default=str)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([{"type": "poisson", "rate": 40}, {"type": "offline"}]), st.sampled_from(["lru", "arc"]),
       st.booleans(), st.integers(0, 3))
def test_one_instance_with_the_tier_is_the_single_engine_run_byte_for_byte(arrival, policy, async_scheduling, seed):
    tier = copy.deepcopy(CPU_TIER)
    tier["kv_connector_extra_config"]["eviction_policy"] = policy
    engine = {"kv_transfer_config": tier, "async_scheduling": async_scheduling}
    small = {"requests": 60, "shared_prefix": {**BASE["workload"]["shared_prefix"], "groups": 12}}
    single = validate_config(_raw(engine=engine, arrival=arrival, seed=seed, **small))
    combined, _, _ = run_backends(single, progress=False, log=lambda m: None)
    exp = validate_config(_raw({"instances": [{"name": "only", "engine": {"kv_transfer_config": tier}}]},
                               engine={"async_scheduling": async_scheduling}, arrival=arrival, seed=seed, **small))
    sim, runs, _, _ = simulate_cluster(exp)
    (run,) = runs.values()
    assert cpu_tier_totals([sim.simulations()[0][2].engine])["store_bytes"] > 0
    cluster_summary = summarize(run, run.recorder.frames(), exp, run.recorder.itl_array())
    assert _portable(cluster_summary) == _portable(combined["backends"]["sim"])


def test_the_cluster_cpu_tier_link_is_the_connectors_default_pcie_link():
    exp = validate_config(_raw({"instances": [{"name": "a", "engine": {"kv_transfer_config": CPU_TIER}},
                                              {"name": "b", "engine": {"kv_transfer_config": {
                                                  **CPU_TIER, "kv_connector_extra_config": {
                                                      "cpu_bytes_to_use": 1 << 30, "pcie_link": "pcie4-x16"}}}}],
                                "links": {"cpu_tier": {"preset": "pcie5-x16", "efficiency": 0.5}}}))
    a, b = (instance_engine_args(exp.engine_args("sim"), inst, inst.hardware_spec, exp.cluster.links)
            for inst in exp.cluster.instances)
    assert a.kv_transfer_config.kv_connector_extra_config["pcie_link"]["efficiency"] == 0.5
    assert b.kv_transfer_config.kv_connector_extra_config["pcie_link"] == "pcie4-x16"  # its own wins
    assert a.kv_transfer_config is not b.kv_transfer_config


@pytest.mark.parametrize("tier, path", [
    ({"kv_connector": "OffloadingConnector"}, "kv_transfer_config.kv_connector_extra_config.cpu_bytes_to_use"),
    ({**CPU_TIER, "kv_rol": "kv_both"}, "kv_transfer_config.kv_rol"),
    ({**CPU_TIER, "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "pcie_link": "pcie9"}},
     "kv_transfer_config.kv_connector_extra_config.pcie_link"),
])
def test_a_bad_instance_kv_transfer_config_names_its_field(tier, path):
    with pytest.raises(ConfigError) as err:
        validate_config(_raw({"instances": [{"name": "a", "engine": {"kv_transfer_config": tier}}]}))
    assert err.value.path == f"cluster.instances[0].engine.{path}"


def test_the_tiered_scorer_counts_leading_blocks_held_in_either_tier():
    keys = [make_block_hash_with_group_id(bytes([i]) * 32, 0) for i in range(4)]
    endpoints = [Endpoint(i, f"e{i}", block_keys=lambda tokens: keys, key_scheme="same") for i in range(3)]
    scorer = TieredPrefixCacheScorer(cpu_weight=0.5)
    scorer.on_kv_events(0, [("stored", keys[0]), ("stored", keys[1])])
    scorer.on_cpu_kv_events(0, [("stored", bytes([2]) * 32)])  # the tier keys a chunk by its block hash
    scorer.on_cpu_kv_events(1, [("stored", bytes([i]) * 32) for i in range(4)])
    scorer.on_cpu_kv_events(2, [("stored", bytes([i]) * 32) for i in (1, 2, 3)])  # no leading block
    request = type("R", (), {"prompt_token_ids": list(range(64))})()
    assert scorer.score(request, endpoints) == [(1 + 1 + 0.5) / 4, 0.5, 0.0]
    scorer.on_cpu_kv_events(1, [("removed", bytes([1]) * 32)])  # an eviction cuts the run
    assert scorer.score(request, endpoints)[1] == 0.5 / 4


def test_the_tiered_scorer_index_is_the_cpu_tiers_contents_after_a_run():
    """Behind the tiered scorer, every completed store's event reached the router and every evicted chunk was
    dropped: the index holds exactly the chunks the tier can load."""
    router = {"type": "llm_d", "scorers": [{"type": "tiered-prefix-cache", "event_delay_s": 0.0}, {"type": "queue"}]}
    exp = validate_config(_raw({"instances": [{"name": "r", "count": 2, "engine": {"kv_transfer_config": CPU_TIER}}],
                                "router": router}))
    sim, _, reqs, _ = simulate_cluster(exp)
    scorer = sim.router.scorers[0][0]
    for inst in sim.instances:
        sched = inst.ranks[0].engine.scheduler
        hashes = {h for r in reqs for h in sched.block_hasher(SimpleNamespace(
            block_hashes=[], all_token_ids=r.prompt_token_ids, lora_request=None, cache_salt=None))}
        readable = {make_block_hash_with_group_id(h, 0) for h in hashes
                    if sched.connector.manager.lookup(make_offload_key(h, 0)) is LookupResult.HIT}
        assert readable and scorer.cpu_index.get(inst.index, set()) == readable


@pytest.mark.parametrize("hybrid, tp, layers", [(True, 1, 18), (False, 1, 36), (True, 2, 18)])
def test_the_cpu_chunk_is_one_pool_block_of_every_rank(hybrid, tp, layers):
    """vLLM 0.33 sizes a CPU chunk as the worker's KV allocation / num_blocks x world size: with the
    hybrid KV cache manager gpt-oss's pool block is a page of 18 layers (one group), else of all 36;
    a page is 128 tokens x 2048 B (8 KV heads x 64 x K and V x bf16), split over the TP ranks."""
    from servetwin.core.engine.engine_args import EngineArgs
    from servetwin.sim.kv_pool import build_sim_executor
    args = EngineArgs.from_kwargs(model="gpt-oss-120b", backend="sim", hardware="h100-sxm", block_size=128,
                                  max_model_len=16640, tensor_parallel_size=tp,
                                  disable_hybrid_kv_cache_manager=not hybrid,
                                  kv_transfer_config={**CPU_TIER, "kv_connector_extra_config": {
                                      "cpu_bytes_to_use": 107374182400}})
    build_sim_executor(args)
    chunk = args.kv_transfer_config.kv_connector_extra_config["kv_bytes_per_block"]
    assert chunk == layers * 128 * 2048
    if hybrid and tp == 1:  # the llm-d guide's 100 GiB tier: 22,755 chunks (11,377 without the hybrid manager)
        from servetwin.core.kv_connector.factory import create_connector
        assert create_connector(args.kv_transfer_config, 128).num_cpu_chunks == 22755
