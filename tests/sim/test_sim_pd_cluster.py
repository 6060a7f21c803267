"""Prefill/decode disaggregation across a cluster's instances (`servetwin.sim.pd_cluster`): every request is
routed exactly once per phase, a decode instance never starts a request before its KV read ends, the
producer holds the blocks until then, and no instance's KV is over-committed."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.experiments.config.schema import validate_config
from servetwin.experiments.run.cluster_run import simulate_cluster
from servetwin.sim.kv_transfer import SimKVWorker
from servetwin.sim.links import LINK_PRESETS
from servetwin.sim.pd_cluster import is_prefill_id, read_scale

BASE = {
    "name": "pd", "model": "tiny-llama", "hardware": "h100-sxm",
    "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 16, "max_model_len": 512},
    "workload": {"requests": 30, "prompt_tokens": {"type": "lognormal", "mean": 120, "cv": 0.8},
                 "output_tokens": {"type": "lognormal", "mean": 20, "cv": 0.5}, "max_prompt_tokens": 400,
                 "max_output_tokens": 60, "arrival": {"type": "poisson", "rate": 60}},
    "output": {"step_requests": False, "plots": False},
}


def _cluster(num_prefill=2, num_decode=1, decode_tp=2, threshold=16, router=None, link="roce-400g", **extra):
    cluster = {"instances": [{"name": "p", "count": num_prefill, "role": "prefill"},
                             {"name": "d", "count": num_decode, "role": "decode",
                              "engine": {"tensor_parallel_size": decode_tp}}],
               "router": dict(router or {"type": "round_robin"}, pd_threshold_tokens=threshold),
               "links": {"kv_transfer": link}}
    cluster.update(extra)
    return cluster


def _exp(cluster, **workload):
    raw = copy.deepcopy(BASE)
    raw["workload"].update(workload)
    raw["cluster"] = cluster
    return validate_config(raw)


_ROUTERS = st.sampled_from([{"type": "round_robin"}, {"type": "random"}, {"type": "least_loaded"},
                            {"type": "llm_d", "scorers": [{"type": "active-request"}]},
                            {"type": "llm_d", "filters": [{"type": "prefix-cache-affinity"}],
                             "scorers": [{"type": "prefix-cache", "weight": 2}, {"type": "queue"}]}])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(1, 2), st.sampled_from([1, 2]), st.sampled_from([16, 120]), _ROUTERS,
       st.integers(0, 5), st.sampled_from([30.0, 300.0]), st.sampled_from(["offline", "api_server"]))
def test_pd_invariants(num_prefill, num_decode, decode_tp, threshold, router, seed, rate, frontend):
    raw = copy.deepcopy(BASE)
    raw["workload"].update(seed=seed, arrival={"type": "poisson", "rate": rate})
    raw["cluster"] = _cluster(num_prefill, num_decode, decode_tp, threshold, router)
    raw["frontend"] = {"type": frontend}
    exp = validate_config(raw)
    sim, runs, requests, _ = simulate_cluster(exp)
    prefill = {inst.name for inst in sim.instances if inst.role == "prefill"}
    decode = {inst.name for inst in sim.instances if inst.role == "decode"}
    by_id = {r.request_id: r for r in requests}

    # every request is served: completed once, at the decode instance, with all its tokens
    assert set(sim.result.completion_s) == set(by_id) and not sim.result.rejected
    # routed exactly once per phase: once to a decode instance, once to a prefill instance iff its
    # prompt is over the decider's threshold (no prefix index on the decode profile here, or nothing
    # cached there yet for the prefix one: prompts are random)
    picks: dict[str, list[str]] = {rid: [] for rid in by_id}
    for d in sim.result.decisions:
        picks[d.request_id].append(d.pick)
    for rid, where in picks.items():
        assert sum(p in decode for p in where) == 1
        remote = len(by_id[rid].prompt_token_ids) > threshold
        assert sum(p in prefill for p in where) == (1 if remote else 0), (rid, where)
    record = sim.pd.record
    disaggregated = {rid for rid, ph in record.phases.items() if ph.prefill is not None}
    assert set(record.transfers) == disaggregated

    # a decode instance never starts a request before its transfer ends; the producer keeps the blocks
    # until the read ends (never an expired lease here)
    assert not record.expired_leases
    for label, run in runs.items():
        frame = run.recorder.frames()["requests"]
        for row in frame.itertuples():
            if label in decode and row.request_id in record.transfers:
                t = record.transfers[row.request_id]
                assert t.end_s >= t.start_s >= record.phases[row.request_id].prefill_done_s - 1e-12
                assert row.first_scheduled_s >= t.end_s - 1e-12
                assert t.released_s is not None and t.released_s >= t.end_s - 1e-12
                assert row.output_tokens == by_id[row.request_id].max_tokens
            if label in prefill:
                assert is_prefill_id(row.request_id) and row.output_tokens == 1
    # no KV over-commit on any instance, at any step; every block is back when the run ends
    for (name, _rank, s), run in zip(sim.simulations(), runs.values()):
        steps = run.recorder.frames()["steps"]
        assert (steps.kv_free_blocks >= 0).all() and (steps.kv_usage <= 1.0 + 1e-12).all()
        assert s.engine.scheduler.kv_cache_manager.usage == 0.0
        assert not s.engine.scheduler.requests, name


def test_the_read_crosses_min_tp_nics_and_takes_the_links_time():
    assert read_scale(1, 4) == 4.0 and read_scale(4, 1) == 1.0 and read_scale(2, 2) == 1.0
    exp = _exp(_cluster(1, 1, decode_tp=2, link={"bandwidth_gbps": 1.0, "latency_us": 0.0}),
               requests=4, prompt_tokens=256, output_tokens=4, arrival={"type": "poisson", "rate": 1})
    sim, runs, requests, _ = simulate_cluster(exp)
    (decode,) = [i for i in sim.instances if i.role == "decode"]
    worker = decode.ranks[0].engine.executor.kv_worker
    # a decode rank prices its shard (KV bytes / TP 2) times read_scale(1, 2) = 2: the whole prompt's KV
    # through the prefill GPU's one NIC, at 1 Gb/s
    whole_kv = worker.kv_bytes_per_token * 2 * 256
    for t in sim.pd.record.transfers.values():
        assert t.end_s - t.start_s == pytest.approx(whole_kv * 8 / 1e9, rel=1e-9)


def test_a_held_send_is_reported_when_the_read_ends_or_the_lease_expires():
    link = LINK_PRESETS["roce-400g"]
    worker = SimKVWorker(100.0, 16, link, LINK_PRESETS["pcie5-x16"])
    worker.hold_sends(lease_s=5.0)
    meta = SimpleNamespace(reqs_to_recv={}, reqs_to_send={"a": 5.0, "b": 5.0})
    worker.start(meta, {"a": 32, "b": 32})
    out, _ = worker.finish(meta, 1.0, ran_tokens=True)
    assert out is None  # nothing reported while the consumer reads
    assert worker.release_send("a")
    empty = SimpleNamespace(reqs_to_recv={}, reqs_to_send={})
    worker.start(empty, {})
    out, _ = worker.finish(empty, 0.5, ran_tokens=True)
    assert out.finished_sending == {"a"}
    out, duration = worker.finish(empty, 0.0, ran_tokens=False)  # idle: waits for b's lease (t = 5)
    assert out.finished_sending == {"b"} and worker.clock_s == pytest.approx(5.0)
    assert not worker.release_send("b")  # the lease expired first


@pytest.mark.parametrize("cluster, path", [
    (_cluster(extra_both=True), "cluster.instances[2].role"),
    ({"instances": [{"name": "p", "role": "prefill"}]}, "cluster.instances"),
    ({"instances": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode", "data_parallel_size": 2}]},
     "cluster.instances[1].data_parallel_size"),
    ({"instances": [{"name": "r"}], "prefill_router": {"type": "round_robin"}}, "cluster.prefill_router"),
    ({"instances": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}],
      "prefill_router": {"type": "llm_d", "scorers": ["token-lod"]}}, "cluster.prefill_router.scorers[0].type"),
    ({"instances": [{"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}],
      "prefill_router": {"type": "fastest"}}, "cluster.prefill_router.type"),
    ({"instances": [{"name": "p", "role": "prefill", "engine": {"kv_transfer_config": {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer"}}}, {"name": "d", "role": "decode"}]},
     "cluster.instances[0].engine.kv_transfer_config.kv_role"),
])
def test_a_misshapen_pd_cluster_is_refused_naming_the_field(cluster, path):
    if cluster.pop("extra_both", False):
        cluster["instances"].append({"name": "b", "role": "both"})
    with pytest.raises(ConfigError) as err:
        _exp(cluster)
    assert err.value.path == path


def test_servetwin_run_writes_the_transfer_timeline_and_trace_flows(tmp_path):
    import json

    import pandas as pd
    import yaml

    from servetwin.experiments.cli import main

    raw = copy.deepcopy(BASE)
    raw["workload"].update(requests=12, prompt_tokens=100)
    raw["cluster"] = _cluster(2, 1)
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out)]) == 0
    timeline = pd.read_parquet(out / "sim" / "kv_transfers.parquet")
    assert len(timeline) == 12 and (timeline.end_s >= timeline.start_s).all()
    assert (timeline.start_s >= timeline.prefill_done_s).all() and (timeline.released_s >= timeline.end_s).all()
    whole = json.loads((out / "sim" / "summary.json").read_text())
    assert whole["pd"]["disaggregated"] == 12 and whole["pd"]["expired_leases"] == 0
    assert whole["completed"] == 12 and whole["ttft_s"]["count"] == 12  # the client's requests, not the copies
    events = json.loads((out / "sim" / "trace.json").read_text())["traceEvents"]
    assert sum(e.get("ph") == "s" and e.get("cat") == "kv" for e in events) == 12
    assert sum(e.get("ph") == "f" and e.get("cat") == "kv" for e in events) == 12


def test_a_request_the_prefill_instance_refuses_is_the_clients_rejection_and_never_reaches_decode():
    cluster = _cluster(1, 1)
    cluster["instances"][0]["engine"] = {"max_model_len": 128}  # the prefill instance takes shorter prompts
    exp = _exp(cluster, requests=20, prompt_tokens={"type": "uniform", "low": 60, "high": 250})
    sim, runs, requests, _ = simulate_cluster(exp)
    long_ids = {r.request_id for r in requests if len(r.prompt_token_ids) >= 128}  # (+ its one output token)
    assert long_ids and set(sim.result.rejected) == long_ids
    assert set(sim.result.completion_s) == {r.request_id for r in requests} - long_ids
    decode_frame = runs["d"].recorder.frames()["requests"]
    assert not set(decode_frame.request_id) & long_ids
