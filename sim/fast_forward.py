"""Exact fast-forward of steady decode steps, for simulator speed.

When every running request is decoding, nothing waits, no request can finish by length or forced
EOS, and the KV pool can give every block the window needs, the next k steps are certain: each
running request gets one token per step, in running order. `fast_forward` applies those k steps in
one go - scheduler state (`Scheduler.fast_forward_decode`: blocks allocated and cached in the exact
step order), the executor's runner state and tokens, predicted durations, and the trace rows -
stopping before the first step that starts at or after `t_limit` (the next arrival). The result is
identical to running the k steps one by one (tests/sim/test_sim_fast_forward.py proves it).
"""
from __future__ import annotations

from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.testbed.trace import TraceRecorder

MAX_WINDOW = 4096


def fast_forward(engine: EngineCore, recorder: TraceRecorder, t0: float, t_limit: float) -> list[float]:
    """Returns the durations of the steps fast-forwarded ([] when not applicable). The caller advances
    its clock by each one in turn, so times add up exactly as they do step by step."""
    scheduler = engine.scheduler
    executor = engine.executor
    if engine.batch_queue or not hasattr(executor, "fast_forward"):
        return []
    running = scheduler.running
    ids = [r.request_id for r in running]
    k = scheduler.steady_decode_steps(MAX_WINDOW)
    if k < 2:
        return []
    k = executor.eos_free_steps(ids, k)
    if k < 2:
        return []
    starts = [r.num_computed_tokens for r in running]
    pool = scheduler.kv_cache_manager.block_pool
    shared_kv = pool.num_shared_refs * scheduler.block_size  # no block is shared or freed in the window
    durations = executor.decode_step_durations(len(ids), sum(starts), k, shared_kv)
    t_starts, t_ends, t = [], [], t0
    for d in durations:
        if t >= t_limit:
            break
        t_starts.append(t)
        t += d
        t_ends.append(t)
    k = len(t_starts)
    if k < 2:
        return []
    first_step = engine.step_counter
    tokens = executor.fast_forward(ids, first_step, k)
    free_after = scheduler.fast_forward_decode(k, tokens)
    engine.step_counter += k
    recorder.on_decode_window(first_step, t_starts, t_ends, ids, starts, free_after, pool.num_gpu_blocks,
                              shared_kv)
    return durations[:k]
