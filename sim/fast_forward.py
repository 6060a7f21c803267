"""Exact fast-forward of steady decode steps, for simulator speed (not vLLM's behaviour).

When every running request is decoding, nothing waits, no request can finish by length or forced
EOS, and the KV pool can give every block the window needs, the next k steps are certain: each
running request gets one token per step, in running order. `fast_forward` applies those k steps in
one go - scheduler state (`SimScheduler.fast_forward_decode`: blocks allocated and cached in the
exact step order), the executor's runner state and tokens, predicted durations, and the trace rows
(`decode_window_rows`) - stopping before the first step that starts at or after `t_limit` (the next
arrival). The result is identical to running the k steps one by one (tests/sim/test_sim_fast_forward.py
and test_sim_scheduler_fast_forward.py prove it).
"""
from __future__ import annotations

from typing import Any

from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.testbed.trace import TraceRecorder
from servetwin.sim.scheduler import SimScheduler

MAX_WINDOW = 4096


def fast_forward(engine: EngineCore, recorder: TraceRecorder, t0: float, t_limit: float) -> list[float]:
    """Returns the durations of the steps fast-forwarded ([] when not applicable). The caller advances
    its clock by each one in turn, so times add up exactly as they do step by step."""
    scheduler = engine.scheduler
    executor = engine.executor
    if engine.batch_queue or not isinstance(scheduler, SimScheduler) or not hasattr(executor, "fast_forward"):
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
    # no block is shared or unshared in the window (a window group stops before freeing a shared one)
    shared_kv = scheduler.shared_kv_tokens()
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
    rows, step_requests = decode_window_rows(recorder, first_step, t_starts, t_ends, ids, starts, free_after,
                                             scheduler.kv_cache_manager.block_pool.num_gpu_blocks, shared_kv)
    recorder.add_steps(rows, step_requests, {rid: t_ends for rid in ids})
    return durations[:k]


def decode_window_rows(recorder: TraceRecorder, first_step: int, t_starts: list[float], t_ends: list[float],
                       req_ids: list[str], computed_before: list[int], free_after: list[int], num_gpu_blocks: int,
                       shared_kv_tokens: int = 0) -> tuple[list[dict[str, Any]], list[tuple]]:
    """The step rows (and per-request step rows, when the recorder keeps them) of k fast-forwarded
    steady decode steps: the rows `TraceRecorder.on_step` would give for the k normal steps."""
    run, backend = recorder.run, recorder.backend
    num = len(req_ids)
    sum_c = sum(computed_before)
    max_c = max(computed_before)
    annotation = f"execute_context_0(0)_generation_{num}({num})"
    usable = num_gpu_blocks - 1
    rows: list[dict[str, Any]] = []
    step_requests: list[tuple] = []
    for j, (t0, t1, free) in enumerate(zip(t_starts, t_ends, free_after)):
        kv_sum = sum_c + num * (j + 1)
        rows.append({
            "run": run, "backend": backend, "step": first_step + j, "t_start_s": t0,
            "t_end_s": t1, "duration_s": t1 - t0, "num_reqs": num, "num_context_reqs": 0,
            "num_context_tokens": 0, "num_generation_reqs": num, "num_generation_tokens": num,
            "total_tokens": num, "annotation": annotation, "sum_q2": num, "sum_q_kv": kv_sum,
            "sum_kv": kv_sum, "max_kv": max_c + j + 1, "num_running": num, "num_waiting": 0,
            "num_preempted": 0, "num_finished": 0, "kv_free_blocks": free,
            "kv_usage": (1.0 - free / usable) if usable > 0 else 0.0, "prefix_queries": 0, "prefix_hits": 0,
            "shared_kv_tokens": shared_kv_tokens})
        if recorder.record_step_requests:
            step = first_step + j
            step_requests.extend((run, backend, step, rid, 1, c + j, "generation", True)
                                 for rid, c in zip(req_ids, computed_before))
    return rows, step_requests
