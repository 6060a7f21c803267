"""Fast-forwarded steady decode windows (sim/fast_forward.py, SimScheduler) give exactly the trace of
step-by-step simulation."""
import contextlib
import os

import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.sim.engine import Simulation
from servetwin.sim.workload import build_workload, rng_streams
from sim_helpers import (LAYER_PATTERNS, NUM_KV_CACHE_GROUPS, assert_same_block_pool, hybrid_spec, sim_model,
                         small_workload)

# more examples for a thorough local check: SERVETWIN_FF_EXAMPLES=300
EXAMPLES = int(os.environ.get("SERVETWIN_FF_EXAMPLES", "25"))


def _run(engine_kw: dict, workload: dict, fast: bool):
    args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm",
                                  skip_tokenizer_init=True, **engine_kw)
    engine, info = create_engine_core(args)
    spec, requests = build_workload(workload, vocab_size=info.vocab_size)
    sim = Simulation(engine, requests, spec.arrival, rng=rng_streams(spec.seed)["runtime"], fast_forward=fast)
    res = sim.run()
    return res, engine


# The settings and workloads both Hypothesis tests draw (with their own KV pool and model)
SCHEDULES = dict(
    caching=st.booleans(),
    block_size=st.sampled_from([1, 4, 16]),
    max_num_seqs=st.integers(1, 12),
    rate=st.sampled_from([None, 5.0, 50.0, 400.0]),
    requests=st.integers(1, 14),
    prompt_hi=st.integers(2, 60),
    out_hi=st.integers(1, 60),
    shared=st.booleans(),
    seed=st.integers(0, 1000),
    policy=st.sampled_from(["fcfs", "priority"]),
)


def _engine_and_workload(num_blocks: int, max_model_len: int, *, caching, block_size, max_num_seqs, rate, requests,
                         prompt_hi, out_hi, shared, seed, policy) -> tuple[dict, dict]:
    """The engine settings and workload of one `SCHEDULES` draw."""
    engine_kw = dict(enable_prefix_caching=caching, block_size=block_size, num_gpu_blocks=num_blocks,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max(64, max_num_seqs),
                     max_model_len=max_model_len, policy=policy)
    return engine_kw, small_workload(requests, seed, out_hi, prompt_hi, rate, shared)


@settings(max_examples=EXAMPLES, deadline=None)
@given(num_blocks=st.integers(40, 400), **SCHEDULES)
def test_fast_forward_trace_equals_step_by_step(num_blocks, **draw):
    _assert_same_trace(*_engine_and_workload(num_blocks, -1, **draw))


def _assert_same_trace(engine_kw: dict, workload: dict) -> None:
    slow, slow_engine = _run(engine_kw, workload, fast=False)
    fast, fast_engine = _run(engine_kw, workload, fast=True)
    a, b = slow.recorder.frames(), fast.recorder.frames()
    for name in ("steps", "step_requests", "requests"):
        pd.testing.assert_frame_equal(a[name].reset_index(drop=True), b[name].reset_index(drop=True),
                                      check_exact=False, rtol=1e-9, atol=1e-12, obj=name)
    assert slow.completion_s == fast.completion_s and slow.rejected == fast.rejected
    assert slow.num_steps == fast.num_steps
    assert_same_block_pool(slow_engine, fast_engine)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    pattern=st.sampled_from(sorted(LAYER_PATTERNS)),
    window=st.sampled_from([2, 3, 5, 8, 13, 40]),
    retention=st.sampled_from([0, 0, None, 1, 4]),  # x block_size (1, 4); None: dense
    extra_blocks=st.integers(0, 300),
    **SCHEDULES,
)
def test_fast_forward_with_sliding_window_groups_trace_equals_step_by_step(pattern, window, retention,
                                                                           extra_blocks, **draw):
    """Hybrid models (gpt-oss-like, all sliding, Gemma-like): the windows' frees replayed in step order,
    prefix sharing (a shared block's free ends a window), small pools (preemption)."""
    max_model_len = 128
    block_size = draw["block_size"]
    num_blocks = NUM_KV_CACHE_GROUPS[pattern] * -(-max_model_len // block_size) + 1 + extra_blocks
    engine_kw, workload = _engine_and_workload(num_blocks, max_model_len, **draw)
    with sim_model(hybrid_spec(pattern, window),
                   None if retention is None or not draw["caching"] else retention * block_size):
        _assert_same_trace(engine_kw, workload)


@pytest.mark.pure_python("counts steps by replacing the engine's step method")
@pytest.mark.parametrize("pattern", [None, "gpt-oss-like"])
def test_fast_forward_actually_skips_steps(pattern):
    """Also on a model with a sliding-window group (window 8: it drops a block every 16 steps)."""
    engine_kw = dict(enable_prefix_caching=True, num_gpu_blocks=500, max_num_seqs=8, max_model_len=512)
    workload = {"requests": 8, "seed": 1, "prompt_tokens": 20, "output_tokens": 100, "arrival": {"type": "offline"}}
    with contextlib.ExitStack() as stack:
        if pattern is not None:
            stack.enter_context(sim_model(hybrid_spec(pattern, 8)))
        args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm",
                                      skip_tokenizer_init=True, **engine_kw)
        engine, info = create_engine_core(args)
    assert len(engine.scheduler.kv_cache_manager.kv_cache_groups) == (1 if pattern is None else 2)
    spec, requests = build_workload(workload, vocab_size=info.vocab_size)
    calls = []
    orig = engine.step
    engine.step = lambda *a, **k: calls.append(1) or orig(*a, **k)
    res = Simulation(engine, requests, spec.arrival, fast_forward=True).run()
    assert res.num_steps == 100  # 1 prefill step + 99 decode steps
    assert len(calls) < 10  # most of them fast-forwarded in one window
