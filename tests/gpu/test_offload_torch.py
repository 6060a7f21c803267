"""The offloading connector for real in the torch backend (tiny-llama, and tiny-gpt-oss with its
sliding-window groups; CPU): a prefix set larger than the KV pool but within the CPU tier is served
from the tier (loads copy the stored KV back), the greedy outputs equal a run without offload, and
fewer tokens are prefilled."""
from __future__ import annotations

import pytest
import torch

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.gpu.executor import TorchExecutor

BLOCK, POOL = 4, 24  # 24 blocks of 4 tokens; the six 16-token prefixes need 24 blocks by themselves
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PREFIXES = [[7 + 11 * p + i for i in range(16)] for p in range(6)]


def _prompts() -> list[list[int]]:
    """Two rounds over the six prefixes, each with its own 5-token suffix: a prefix comes back only
    after the other five have pushed it out of the pool."""
    return [PREFIXES[p] + [200 + 10 * r + p + j for j in range(5)] for r in range(2) for p in range(6)]


def _run(offload: bool):
    conn = KVTransferConfig("OffloadingConnector", "kv_both",
                            kv_connector_extra_config={"cpu_bytes_to_use": 64 * 4096}) if offload else None
    ex = TorchExecutor(model="tiny-llama", device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=POOL,
                       max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, kv_transfer_config=conn)
    engine = EngineCore(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
                        CacheConfig(block_size=BLOCK, num_gpu_blocks=POOL), ex)
    outputs, prefilled = {}, 0
    for i, prompt in enumerate(_prompts()):  # one at a time: each round's prefixes evict the last's
        engine.add_request(Request(f"r{i}", prompt, GREEDY))
        while engine.has_work():
            res = engine.step()
            if res.scheduled is not None:
                so = res.scheduled
                prefilled += sum(min(n, len(prompt) - _computed(so, rid)) for rid, n in so.num_scheduled_tokens.items()
                                 if _computed(so, rid) < len(prompt))
            for o in res.outputs:
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(_prompts()))], prefilled, ex, engine


def _computed(so, rid: str) -> int:
    for r in so.scheduled_new_reqs:
        if r.req_id == rid:
            return r.num_computed_tokens
    cached = so.scheduled_cached_reqs
    return cached.num_computed_tokens[cached.req_ids.index(rid)]


def test_cpu_tier_hits_give_the_same_outputs_with_fewer_prefilled_tokens():
    base, base_prefilled, _, base_engine = _run(offload=False)
    assert base_engine.scheduler.kv_cache_manager.block_pool.num_gpu_blocks == POOL
    out, prefilled, ex, engine = _run(offload=True)
    worker = ex.kv_connector_worker
    st = worker.stats
    # the second round's prefixes come from the CPU tier: 4 blocks (16 tokens) each
    assert st.num_loaded_blocks == 6 * 4 and st.loaded_bytes == 6 * 4 * ex.kv_bytes_per_block
    assert st.num_stored_blocks >= 6 * 4  # every first-round prefix (and more) was stored
    assert out == base
    assert prefilled == base_prefilled - 6 * 16
    assert worker.num_chunks == 64 * 4096 // (-(-ex.kv_bytes_per_block // 4096) * 4096)
    assert not engine.scheduler.connector.has_pending_push_work()


def test_loaded_blocks_hold_the_stored_kv():
    """A load copies back exactly the bytes a store copied out (chunk i of the tier <-> a pool block)."""
    conn = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": 8 * 4096})
    ex = TorchExecutor(model="tiny-llama", device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=9,
                       max_model_len=32, kv_transfer_config=conn)
    worker = ex.kv_connector_worker
    for k, v in ex.kv_caches:
        k.normal_(), v.normal_()
    before = [t[3].clone() for t in worker.layers]

    class Job:  # the connector's TransferJob fields the worker reads
        def __init__(self, rid, blocks, chunks):
            self.req_id, self.gpu_block_ids, self.cpu_chunk_ids = rid, blocks, chunks

    class Meta:
        def __init__(self, loads=None, stores=None, flush=()):
            self.load_jobs, self.store_jobs, self.jobs_to_flush = loads or {}, stores or {}, set(flush)

    worker.before_forward(Meta(stores={0: Job("a", (3,), (5,))}))
    assert worker.after_forward().completed_jobs == {0: 1}
    for t in worker.layers:
        t[6].zero_()
    worker.before_forward(Meta(loads={1: Job("b", (6,), (5,))}))
    out = worker.after_forward()
    assert out.completed_jobs == {1: 1} and out.finished_recving == {"b"}
    for t, b in zip(worker.layers, before):
        assert torch.equal(t[6], b)


def test_kv_bytes_per_block_must_match_the_pool():
    conn = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": 4096,
                                                                             "kv_bytes_per_block": 123})
    with pytest.raises(ConfigError, match="kv_bytes_per_block"):
        TorchExecutor(model="tiny-llama", device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=9,
                      max_model_len=32, kv_transfer_config=conn)


def _run_hybrid(offload: bool, pool: int):
    """tiny-gpt-oss (10-token sliding windows on every other layer, the hybrid KV cache manager on):
    six 20-token prompts, then the same six again, one at a time."""
    conn = KVTransferConfig("OffloadingConnector", "kv_both",
                            kv_connector_extra_config={"cpu_bytes_to_use": 96 * 4096}) if offload else None
    ex = TorchExecutor(model="tiny-gpt-oss", device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=pool,
                       max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32, kv_transfer_config=conn)
    engine = EngineCore(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32),
                        CacheConfig(block_size=BLOCK, num_gpu_blocks=pool, kv_cache_groups=ex.kv_cache_groups), ex)
    prompts = [[7 + 13 * p + i for i in range(20)] for p in range(6)] * 2
    outputs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, GREEDY))
        while engine.has_work():
            for o in engine.step().outputs:
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))], ex, engine


def test_with_sliding_window_groups_cpu_tier_loads_give_the_same_outputs():
    """vLLM 0.33's connector offloads both groups; a sliding-window group only the cdiv(10 - 1, 4) = 3
    blocks before the replay boundary (19 // 4 = 4: blocks 1-3). A resent prompt's hit therefore ends
    at 16 tokens: it loads 4 full-attention blocks and the window's 3, and the model's outputs are those
    of a run without the tier."""
    base, _, _ = _run_hybrid(offload=False, pool=24)
    out, ex, engine = _run_hybrid(offload=True, pool=24)
    assert ex.kv_cache_groups is not None and len(ex.kv_cache_groups) == 2
    st = ex.kv_connector_worker.stats
    assert st.num_loaded_blocks == 6 * (4 + 3)
    assert out == base
    assert not engine.scheduler.connector.has_pending_push_work()
