"""`SimScheduler.steady_decode_steps` / `fast_forward_decode` leave exactly the state of k normal steps
(of the core `Scheduler`: the comparison runs the core class step by step)."""
from __future__ import annotations

import pytest

from servetwin.core.outputs import ModelRunnerOutput

from sim_helpers import create_schedulers, make_request, sync_step


def _build(block_size, caching, prompts, max_tokens, num_blocks):
    """(SimScheduler, core Scheduler), both after one step that ran every prefill -> steady decode."""
    pair = create_schedulers(num_gpu_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching,
                             max_num_batched_tokens=256, max_model_len=256)
    for s in pair:
        for i, p in enumerate(prompts):
            s.add_request(make_request(f"r{i}", p, max_tokens=max_tokens, arrival_time=float(i)))
        sync_step(s)
    return pair


def _step_through_window(slow, rows: list[str], tokens: list[list[int]], k: int) -> list[int]:
    """Step `slow` k times as the window would: every step schedules one token for each row in running
    order (no admission, no preemption) and finishes no one; the free blocks after each step's
    scheduling (what `fast_forward_decode` returns)."""
    observed = []
    for j in range(k):
        so = slow.schedule()
        assert list(so.num_scheduled_tokens.items()) == [(rid, 1) for rid in rows]
        assert not so.preempted_order and not so.scheduled_new_reqs
        observed.append(slow.kv_cache_manager.num_free_blocks)
        out = ModelRunnerOutput(rows, {r: i for i, r in enumerate(rows)}, [[tokens[i][j]] for i in range(len(rows))])
        assert all(o.finish_reason is None for o in slow.update_from_output(so, out))
    return observed


def _state(s):
    kv = s.kv_cache_manager
    pool = kv.block_pool
    table = {k: (sorted(v) if isinstance(v, dict) else [v.block_id])
             for k, v in pool.cached_block_hash_to_block._cache.items()}
    return dict(
        running=[(r.request_id, r.num_computed_tokens, list(r.all_token_ids), list(r.block_hashes))
                 for r in s.running],
        blocks={rid: [b.block_id for b in bl] for rid, bl in kv.req_to_blocks.items()},
        cached=dict(kv.num_cached_block),
        free=[b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        pool=[(b.ref_cnt, b.block_hash) for b in pool.blocks],
        table=table,
        step=s.current_step,
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("tight", [True, False])
def test_fast_forward_equals_step_by_step(block_size, caching, tight):
    # tight: each request alone fits (51 tokens), all three together do not -> window cut by blocks
    num_blocks = -(-51 // block_size) + 2 if tight else 200
    shared = list(range(9))
    prompts = [shared + [1, 2], shared + [3], [7] * 5]
    fast, slow = _build(block_size, caching, prompts, 40, num_blocks)
    assert _state(fast) == _state(slow)
    k = fast.steady_decode_steps(30)
    if not tight:
        assert k == 30  # plenty of blocks: limited only by `limit`
    else:
        assert 0 < k < 30  # cut where the free blocks run out
    if k == 0:
        return
    rows = [r.request_id for r in fast.running]
    tokens = [[100 + 7 * j + i for j in range(k)] for i in range(len(rows))]
    free_after = fast.fast_forward_decode(k, tokens)
    assert free_after == _step_through_window(slow, rows, tokens, k)
    assert _state(fast) == _state(slow)


def test_not_steady_when_waiting_or_async():
    s, _ = create_schedulers(num_gpu_blocks=100, block_size=4, max_num_batched_tokens=8192, max_model_len=8192)
    s.add_request(make_request("a", [1] * 5, max_tokens=10))
    assert s.steady_decode_steps(10) == 0  # nothing running yet
    sync_step(s)
    assert s.steady_decode_steps(10) > 0
    s.add_request(make_request("b", [2] * 5, max_tokens=10))
    assert s.steady_decode_steps(10) == 0  # a waiting request could be admitted
    a, _ = create_schedulers(num_gpu_blocks=100, block_size=4, max_num_batched_tokens=8192, max_model_len=8192,
                             async_scheduling=True)
    a.add_request(make_request("a", [1] * 5, max_tokens=10))
    sync_step(a)
    assert a.steady_decode_steps(10) == 0


def test_steady_window_stops_before_length_cap():
    s, _ = create_schedulers(num_gpu_blocks=100, block_size=4, max_num_batched_tokens=8192, max_model_len=8192)
    s.add_request(make_request("a", [1] * 5, max_tokens=6))
    sync_step(s)  # 1 output; 5 more allowed, the last one finishes the request
    assert s.steady_decode_steps(100) == 4


def _group_state(s):
    """`_state` plus every KV cache group's block table (the windows' dropped blocks as the null block)."""
    kv = s.kv_cache_manager
    return dict(_state(s), groups=[({rid: [b.block_id for b in bl] for rid, bl in g.req_to_blocks.items()},
                                    dict(g.num_cached_block)) for g in kv.coordinator.single_type_managers],
                shared=kv.block_pool.num_shared_refs)


@pytest.mark.parametrize("window", [3, 6, 13])
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("caching,retention", [(False, 0), (True, 0), (True, None), (True, 4)])
@pytest.mark.parametrize("tight", [True, False])
def test_fast_forward_with_window_groups_equals_step_by_step(window, block_size, caching, retention, tight):
    """gpt-oss-like groups [sliding W, full]: windows of steady steps, each compared with the core's steps
    (frees, allocations, registrations, free counts); a window stops before a window group would free a
    block two requests share (the shared prefix), where a normal step does it."""
    from servetwin.core.kv_cache.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: PLC0415

    num_blocks = 2 * -(-71 // block_size) + 2 if tight else 400
    fast, slow = create_schedulers(num_gpu_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching,
                                   max_num_batched_tokens=256, max_model_len=256,
                                   kv_cache_groups=(SlidingWindowSpec(window), FullAttentionSpec()),
                                   prefix_cache_retention_interval=retention * block_size if retention else retention)
    shared = list(range(9))
    prompts = [shared + [1, 2], shared + [3], [7] * 5]
    for s in (fast, slow):
        for i, p in enumerate(prompts):
            s.add_request(make_request(f"r{i}", p, max_tokens=60, arrival_time=float(i)))
    rows = [f"r{i}" for i in range(len(prompts))]
    token = 100
    windows = 0
    while (fast.running or fast.waiting) and windows < 12:
        assert _group_state(fast) == _group_state(slow)
        k = fast.steady_decode_steps(30)
        if k == 0:  # one normal step on both
            for s in (fast, slow):
                sync_step(s, token)
            token += 1
            continue
        windows += 1
        rows = [r.request_id for r in fast.running]
        tokens = [[token + 7 * j + i for j in range(k)] for i in range(len(rows))]
        token += 7 * k + len(rows)
        free_after = fast.fast_forward_decode(k, tokens)
        assert free_after == _step_through_window(slow, rows, tokens, k)
    assert windows >= 2
    assert _group_state(fast) == _group_state(slow)
