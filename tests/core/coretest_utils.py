"""Shared helpers for the tests of `core/` (the vLLM v1 scheduler / KV-cache re-implementation).

The helper names mirror the harness described in docs/scheduler_behaviour.md §7 (`create_scheduler`,
`create_requests`, `make_output`, `assert_scheduler_empty`) but are written from the described
behaviour only.
"""
from __future__ import annotations

from typing import Optional

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.kv_cache.hashing import get_request_block_hasher, sha256
from servetwin.core.kv_cache.kv_cache_manager import KVCacheManager
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.scheduler import Scheduler

EOS_TOKEN_ID = 50256
GID = (0).to_bytes(4, "big")  # group id suffix of every prefix-cache key (one KV-cache group)


def create_scheduler(
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    long_prefill_token_threshold: int = 0,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: Optional[int] = None,
    policy: str = "fcfs",
    async_scheduling: bool = False,
    log_stats: bool = True,
    **sched_kwargs,
) -> Scheduler:
    """Like vLLM's test harness: max_model_len defaults to max_num_batched_tokens."""
    if max_model_len is None:
        max_model_len = max_num_batched_tokens
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill, max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold, policy=policy,
        async_scheduling=async_scheduling, **sched_kwargs)
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks,
                     enable_prefix_caching=enable_prefix_caching)
    return Scheduler(sc, cc, log_stats=log_stats)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 16,
    *,
    arrival_time: Optional[float] = None,
    priority: int = 0,
    eos: Optional[int] = EOS_TOKEN_ID,
    block_size: Optional[int] = None,
    cache_salt: Optional[str] = None,
    lora_request=None,
    **sp_kwargs,
) -> Request:
    """A request; `block_size` attaches a sha256 block hasher (needed when driving KVCacheManager
    directly; the Scheduler attaches its own hasher at add_request)."""
    sp = SamplingParams(max_tokens=max_tokens, **sp_kwargs)
    if eos is not None:
        sp.update_from_generation_config(eos)
    kwargs = {}
    if block_size is not None:
        kwargs = dict(block_hasher=get_request_block_hasher(block_size, sha256), hash_block_size=block_size)
    return Request(request_id, prompt_token_ids, sp,
                   arrival_time=0.0 if arrival_time is None else arrival_time,
                   priority=priority, cache_salt=cache_salt, lora_request=lora_request, **kwargs)


def create_requests(num_requests: int, num_tokens: int = 10, max_tokens: int = 16,
                    same_prompt: bool = False, start: int = 0, **kw) -> list[Request]:
    """Prompt of request i is `[i] * num_tokens` (or `[0] * num_tokens`); arrival time = i."""
    reqs = []
    for i in range(start, start + num_requests):
        prompt = [0 if same_prompt else i] * num_tokens
        reqs.append(make_request(str(i), prompt, max_tokens, arrival_time=float(i), **kw))
    return reqs


def make_output(scheduler: Scheduler, so: SchedulerOutput, token: int = 1000,
                tokens: Optional[dict[str, list[int]]] = None) -> ModelRunnerOutput:
    """Model output for `so`: a sampled token for every request whose chunk reached its last known
    token, nothing for a non-final prefill chunk. `tokens` overrides per request."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        if tokens is not None and rid in tokens:
            sampled.append(list(tokens[rid]))
            continue
        req = scheduler.requests.get(rid)
        if req is None or req.is_prefill_chunk:
            sampled.append([])
        else:
            sampled.append([token])
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled)


def step(scheduler: Scheduler, token: int = 1000, tokens: Optional[dict[str, list[int]]] = None):
    """One synchronous schedule -> (fake) execute -> update. Returns (scheduler_output, outputs)."""
    so = scheduler.schedule()
    outs = scheduler.update_from_output(so, make_output(scheduler, so, token, tokens))
    return so, outs


def block_ids(scheduler_or_kv, request_id: str) -> list[int]:
    """The request's block ids in KV cache group 0 (the only group of these tests)."""
    kv = scheduler_or_kv.kv_cache_manager if isinstance(scheduler_or_kv, Scheduler) else scheduler_or_kv
    return kv.get_block_ids(request_id)[0]


def free_queue_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def running_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.running]


def check_block_accounting(kv: KVCacheManager) -> None:
    """Reference counts, free queue and hash map are mutually consistent (docs/scheduler_behaviour.md §4.9, §4.10)."""
    pool = kv.block_pool
    holders: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a request holds a block twice"
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for b in pool.blocks:
        if b.is_null:
            continue
        assert b.ref_cnt == holders.get(b.block_id, 0), (b, holders.get(b.block_id, 0))
    walked = pool.free_block_queue.get_all_free_blocks()
    walked_ids = [b.block_id for b in walked]
    assert len(set(walked_ids)) == len(walked_ids), "block twice in the free queue"
    assert pool.null_block.block_id not in walked_ids
    assert set(walked_ids) == {b.block_id for b in pool.blocks if not b.is_null and b.ref_cnt == 0}
    assert len(walked) == pool.get_num_free_blocks()
    held = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt > 0)
    assert pool.get_num_free_blocks() + held + 1 == pool.num_gpu_blocks
    # extra holders of shared blocks, kept incrementally for the cost model
    assert pool.num_shared_refs == sum(b.ref_cnt - 1 for b in pool.blocks if not b.is_null and b.ref_cnt > 1)
    # hash map <-> block hashes
    table = pool.cached_block_hash_to_block._cache
    in_map = set()
    for key, entry in table.items():
        entries = [entry] if not isinstance(entry, dict) else list(entry.values())
        assert entries, "empty entry left in the hash map"
        for b in entries:
            assert b.block_hash == key
            in_map.add(b.block_id)
    for b in pool.blocks:
        if b.block_hash is not None:
            assert b.block_id in in_map


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """Nothing left: no requests, queues, per-request KV state; every usable block free, ref 0."""
    assert len(scheduler.requests) == 0
    assert len(scheduler.waiting) == 0
    assert len(scheduler.running) == 0
    assert len(scheduler.finished_req_ids) == 0
    kv = scheduler.kv_cache_manager
    assert len(kv.req_to_blocks) == 0
    assert len(kv.num_cached_block) == 0
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    for b in pool.blocks:
        if not b.is_null:
            assert b.ref_cnt == 0
    check_block_accounting(kv)
