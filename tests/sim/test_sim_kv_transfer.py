"""The simulator's KV-connector worker side (sim/kv_transfer.py): NIXL reads and sends over one link,
offload jobs over PCIe, reported in the step's kv_connector_output at the modelled simulated times."""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.sim.arrivals import Offline
from servetwin.sim.engine import simulate, simulate_workload
from servetwin.sim.kv_transfer import DEFAULT_KV_LINK, transfer_links
from servetwin.sim.links import LINK_PRESETS
from servetwin.sim.model_spec import load_model_spec
from servetwin.sim.workload import WorkloadRequest

BLOCK = 16
NIXL_CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


def remote_prefill(num_blocks: int) -> dict:
    """What a prefill engine's finished request hands the decode engine (core/kv_connector/nixl.py)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(num_blocks))],
            "remote_engine_id": "prefill-0", "remote_request_id": "p", "remote_host": "localhost",
            "remote_port": 5600}


def _engine(kv: dict, **kw):
    args = dict(backend="sim", model="qwen3-8b", hardware="h100-sxm", num_gpu_blocks=256, max_model_len=2048,
                block_size=BLOCK, kv_transfer_config=kv)
    args.update(kw)
    core, _ = create_engine_core(EngineArgs.from_kwargs(**args))
    return core


def _kv_bytes_per_token(model: str = "qwen3-8b") -> int:
    return load_model_spec(model).kv_bytes_per_token()


def test_a_lone_remote_prefill_waits_exactly_the_modelled_read():
    core = _engine(NIXL_CONSUMER)
    prompt = 40 * BLOCK
    core.add_request(Request("r", list(range(10, 10 + prompt)), SamplingParams(
        max_tokens=3, ignore_eos=True, extra_args={"kv_transfer_params": remote_prefill(40)})))
    first = core.step()
    assert first.scheduled.total_num_scheduled_tokens == 0  # waiting for its KV
    assert first.model_output.kv_connector_output.finished_recving == {"r"}
    # the read fills every block but the last token's (recomputed after a full remote hit)
    num_blocks = len(first.scheduled.kv_connector_metadata.reqs_to_recv["r"].local_block_ids[0])
    expected = LINK_PRESETS[DEFAULT_KV_LINK].transfer_s(num_blocks * BLOCK * _kv_bytes_per_token())
    assert num_blocks in (39, 40)
    assert first.model_output.timing.duration_s == pytest.approx(expected, rel=1e-12)
    assert core.executor.kv_worker.recv_s["r"] == pytest.approx(expected, rel=1e-12)
    second = core.step()
    assert second.scheduled.num_scheduled_tokens["r"] >= 1  # runs once the read was reported


def test_a_configured_link_sets_the_read_time():
    link = {"bandwidth_gbps": 8.0, "latency_us": 1000.0}
    core = _engine({**NIXL_CONSUMER, "kv_connector_extra_config": {"kv_link": link}})
    core.add_request(Request("r", list(range(10, 10 + 8 * BLOCK)), SamplingParams(
        max_tokens=2, ignore_eos=True, extra_args={"kv_transfer_params": remote_prefill(8)})))
    step = core.step()
    num_blocks = len(step.scheduled.kv_connector_metadata.reqs_to_recv["r"].local_block_ids[0])
    num_bytes = num_blocks * BLOCK * _kv_bytes_per_token()
    assert step.model_output.timing.duration_s == pytest.approx(1e-3 + num_bytes * 8 / 8e9, rel=1e-12)


def test_a_bad_link_names_the_key():
    with pytest.raises(ConfigError) as e:
        _engine({**NIXL_CONSUMER, "kv_connector_extra_config": {"kv_link": "carrier-pigeon"}})
    assert e.value.path == "kv_transfer_config.kv_connector_extra_config.kv_link"
    kv, pcie = transfer_links(EngineArgs.from_kwargs(backend="fake", kv_transfer_config=NIXL_CONSUMER).kv_transfer_config)
    assert (kv.name, pcie.name) == ("ib-ndr-400", "pcie5-x16")


def test_consumer_only_simulation_completes_and_each_wait_is_its_read():
    prompts = [3 * BLOCK + 5, 20 * BLOCK, 64 * BLOCK + 1, 7 * BLOCK]
    reqs = [WorkloadRequest(f"r{i}", 0.002 * i, list(range(10 + i, 10 + i + n)), 4,
                            kv_transfer_params=remote_prefill(-(-n // BLOCK))) for i, n in enumerate(prompts)]
    core = _engine(NIXL_CONSUMER, max_num_seqs=8)
    res = simulate(core, reqs, Offline(), record_step_requests=True)  # at the given arrival_s
    assert sorted(res.completion_s) == [r.request_id for r in reqs] and not res.unfinished
    worker = core.executor.kv_worker
    assert worker.totals.finished["recv"] == len(reqs) and not worker.has_in_flight()
    rows = {r["request_id"]: r for r in res.recorder.request_rows()}
    for r in reqs:  # its first token comes no earlier than its read could finish
        assert rows[r.request_id]["first_token_s"] >= r.arrival_s + worker.recv_s[r.request_id]


def _run(core, requests_at: dict[int, list[Request]], max_steps: int = 3000):
    """Drive `core` step by step, adding requests at their step; check the invariants every step.
    Returns the steps (scheduled outputs) and the reported receives by step."""
    reading: set[str] = set()  # requests whose NIXL read was started (reqs_to_recv, awaiting its KV)
    reported: set[str] = set()
    pending_outputs: dict[int, object] = {}
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    step = 0
    while step < max_steps and (core.has_work() or any(k >= step for k in requests_at)):
        for r in requests_at.get(step, ()):
            core.add_request(r)
        result = core.step()
        step += 1
        so = result.scheduled
        if so is not None:
            meta = so.kv_connector_metadata
            reading |= {rid for rid, m in getattr(meta, "reqs_to_recv", {}).items() if m.awaiting_kvs}
            for rid in so.num_scheduled_tokens:  # a request never runs before its read is reported
                assert rid not in reading or rid in reported, (rid, so.step)
            pending_outputs[so.step] = result.model_output.kv_connector_output
        if result.processed is not None:
            out = pending_outputs.pop(result.processed.step)
            if out is not None and out.finished_recving:
                reported |= out.finished_recving
        used = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used + 1 == pool.num_gpu_blocks
    for res in core.drain():
        pass
    assert not core.has_work(), "requests waited forever"
    assert not scheduler.requests
    assert scheduler.kv_cache_manager.num_free_blocks == pool.num_gpu_blocks - 1  # no block leak
    assert reading <= reported
    return reading


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["consumer", "producer", "both", "offload"]), async_scheduling=st.booleans(),
       num_blocks=st.integers(24, 96), bandwidth=st.sampled_from([1.0, 50.0, 3600.0]),
       reqs=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 300), st.integers(1, 6), st.integers(0, 3)),
                     min_size=1, max_size=8))
def test_transfers_never_leak_blocks_nor_run_a_request_early(kind, async_scheduling, num_blocks, bandwidth, reqs):
    link = {"bandwidth_gbps": bandwidth, "latency_us": 5.0}
    if kind == "offload":
        kv = {"kv_connector": "OffloadingConnector",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24, "pcie_link": link}}
    else:
        kv = {"kv_connector": "NixlConnector", "kv_role": {"consumer": "kv_consumer", "producer": "kv_producer",
                                                          "both": "kv_both"}[kind],
              "kv_connector_extra_config": {"kv_link": link}}
    core = _engine(kv, model="tiny-llama", hardware="cpu", num_gpu_blocks=num_blocks, max_model_len=num_blocks * BLOCK // 2,
                   async_scheduling=async_scheduling, max_num_seqs=4, max_num_batched_tokens=128)
    limit = num_blocks * BLOCK // 2 - 8
    at: dict[int, list[Request]] = {}
    for i, (when, n, out, group) in enumerate(reqs):
        n = min(n, limit)
        prompt = [10 + group] * 32 + list(range(100 + i, 100 + i + n))  # shared 2-block prefixes per group
        prompt = prompt[:limit]
        params = None
        if kind in ("consumer", "both") and i % 2 == 0:
            params = remote_prefill(-(-len(prompt) // BLOCK))
        elif kind in ("producer", "both"):
            params = {"do_remote_decode": True}
        at.setdefault(when, []).append(Request(f"r{i}", prompt, SamplingParams(
            max_tokens=out, ignore_eos=True, extra_args={"kv_transfer_params": params} if params else None)))
    reading = _run(core, at)
    if kind == "consumer":
        assert reading  # request r0 reads its prompt (its prompt is longer than the recompute backoff)


def test_offload_gets_cpu_hits_and_prefills_fewer_tokens():
    workload = {"requests": 16, "arrival": {"type": "offline"}, "output_tokens": 4,
                "shared_prefix": {"groups": 8, "per_group": 2, "prefix_tokens": 512, "suffix_tokens": 16,
                                  "order": "interleaved"}}
    base = dict(backend="sim", model="qwen3-8b", hardware="h100-sxm", num_gpu_blocks=80, max_model_len=1024,
                max_num_seqs=2)
    offload = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
    runs = {}
    for name, kw in (("gpu", {}), ("cpu_tier", {"kv_transfer_config": offload})):
        res = simulate_workload({**base, **kw}, workload, record_step_requests=True)
        assert len(res.completion_s) == 16 and not res.unfinished
        steps = res.recorder.frames()["steps"]
        runs[name] = (int(steps["num_context_tokens"].sum()),
                      sum(r["cached_tokens"] for r in res.recorder.request_rows()))
    # the GPU pool holds about two prompts: interleaved groups find nothing there, the CPU tier has them
    assert runs["gpu"][1] == 0
    assert runs["cpu_tier"][1] == 8 * 512  # each group's second request hits its whole prefix
    assert runs["cpu_tier"][0] < runs["gpu"][0]


def test_kv_connector_metrics_under_vllms_names():
    from servetwin.core.engine.llm import LLM
    from servetwin.core.engine.metrics import ServingMetrics
    from servetwin.core.engine.messages import EngineStats

    offload = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
    prefix = list(range(100, 100 + 40 * BLOCK))
    with LLM(model="qwen3-8b", backend="sim", tokenizer="toy", hardware="h100-sxm", num_gpu_blocks=48,
             max_model_len=700, kv_transfer_config=offload) as llm:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prefix + [7]}], params)
        llm.generate([{"prompt_token_ids": list(range(2000, 2000 + 40 * BLOCK))}], params)  # evicts the prefix
        llm.generate([{"prompt_token_ids": prefix + [8]}], params)  # a CPU-tier hit
        metrics = {m.name: m.value for m in llm.get_metrics()}
        stats = llm.get_stats()
    hits = metrics["vllm:external_prefix_cache_hits"]
    assert hits > 0 and hits + metrics["vllm:prefix_cache_hits"] == 40 * BLOCK  # the whole prefix, GPU + CPU
    assert metrics["vllm:external_prefix_cache_queries"] >= hits
    block_bytes = BLOCK * _kv_bytes_per_token()
    assert metrics["vllm:kv_offload_store_bytes"] == 80 * block_bytes  # both prompts' full blocks
    assert metrics["vllm:kv_offload_load_bytes"] == hits // BLOCK * block_bytes  # what the hit loaded
    serving = ServingMetrics("m")
    serving.update_engine(EngineStats(**{k: v for k, v in stats.items() if k in EngineStats.__struct_fields__}), 1)
    text = serving.render()
    assert f'vllm:external_prefix_cache_hits_total{{model_name="m",engine="1"}} ' \
           f'{metrics["vllm:external_prefix_cache_hits"]}' in text
    assert "vllm:kv_offload_load_bytes_total" in text


def test_a_hybrid_models_read_moves_every_groups_blocks():
    """gpt-oss: a sliding-window group and a full-attention group of 12 layers each; a pool block is a page of
    its group's 12 layers, and the read moves the blocks of both groups (the window group only its window)."""
    link = {"bandwidth_gbps": 8.0, "latency_us": 0.0}
    core = _engine({**NIXL_CONSUMER, "kv_connector_extra_config": {"kv_link": link}}, model="gpt-oss-20b",
                   hardware="h200", num_gpu_blocks=None, max_model_len=4096)
    prompt = 64 * BLOCK
    params = remote_prefill(64)
    params["remote_block_ids"] = [list(range(9)), list(range(64))]
    core.add_request(Request("r", list(range(10, 10 + prompt)), SamplingParams(
        max_tokens=2, ignore_eos=True, extra_args={"kv_transfer_params": params})))
    step = core.step()
    ids = step.scheduled.kv_connector_metadata.reqs_to_recv["r"].local_block_ids
    assert len(ids) == 2 and len(ids[0]) < len(ids[1])  # the window group holds fewer blocks
    block_bytes = core.executor.kv_pool.bytes_per_block  # a page of each of a group's 12 layers
    assert block_bytes * 2 == BLOCK * _kv_bytes_per_token("gpt-oss-20b")
    expected = (len(ids[0]) + len(ids[1])) * block_bytes * 8 / 8e9
    assert step.model_output.timing.duration_s == pytest.approx(expected, rel=1e-12)
