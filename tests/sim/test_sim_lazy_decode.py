"""Implicit steady decodes (sim/scheduler.py, sim/lazy_decode.py) give exactly the trace of the normal step-by-step run:
every step row, every request row, completion times and the final block pool (ids and hashes)."""
import os

import pandas as pd
import pytest
from hypothesis import example, given, settings, strategies as st

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.sim.engine import Simulation
from servetwin.sim.workload import build_workload, rng_streams
from sim_helpers import (LAYER_PATTERNS, NUM_KV_CACHE_GROUPS, assert_same_block_pool, hybrid_spec, sim_model,
                         small_workload)

# more examples for a thorough local check: SERVETWIN_LAZY_EXAMPLES=1500
EXAMPLES = int(os.environ.get("SERVETWIN_LAZY_EXAMPLES", "60"))


def _run(engine_kw: dict, workload: dict, lazy: bool, max_time_s=None):
    args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm",
                                  skip_tokenizer_init=True, **engine_kw)
    engine, info = create_engine_core(args)
    spec, requests = build_workload(workload, vocab_size=info.vocab_size)
    sim = Simulation(engine, requests, spec.arrival, rng=rng_streams(spec.seed)["runtime"], fast_forward=False,
                     record_step_requests=False, lazy_decode=lazy, max_time_s=max_time_s)
    assert sim.lazy_decode == lazy
    return sim.run(), engine


def _assert_same_run(engine_kw: dict, workload: dict, max_time_s=None) -> None:
    eager, eager_engine = _run(engine_kw, workload, lazy=False, max_time_s=max_time_s)
    lazy, lazy_engine = _run(engine_kw, workload, lazy=True, max_time_s=max_time_s)
    a, b = eager.recorder.frames(), lazy.recorder.frames()
    for name in ("steps", "requests"):
        pd.testing.assert_frame_equal(a[name].reset_index(drop=True), b[name].reset_index(drop=True),
                                      check_exact=True, obj=name)
    assert eager.recorder.itls() == lazy.recorder.itls()
    assert eager.completion_s == lazy.completion_s and eager.rejected == lazy.rejected
    assert eager.num_steps == lazy.num_steps
    assert_same_block_pool(eager_engine, lazy_engine)
    assert eager_engine.scheduler.num_preemptions_total == lazy_engine.scheduler.num_preemptions_total


# The scheduling settings and workloads both Hypothesis tests draw (with their own KV pool and model)
SCHEDULES = dict(
    async_scheduling=st.booleans(),
    caching=st.booleans(),
    chunked=st.booleans(),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 12),
    budget=st.sampled_from([8, 16, 64, 256]),
    threshold=st.sampled_from([0, 4, 24]),
    rate=st.sampled_from([None, 5.0, 50.0, 400.0]),
    requests=st.integers(1, 14),
    prompt_hi=st.integers(2, 60),
    out_hi=st.integers(1, 60),
    shared=st.booleans(),
    n=st.sampled_from([1, 1, 2]),
    finish=st.sampled_from(["max_tokens", "max_tokens", "eos"]),
    seed=st.integers(0, 1000),
    policy=st.sampled_from(["fcfs", "priority"]),
)


def _engine_and_workload(num_blocks: int, max_model_len: int, *, async_scheduling, caching, chunked, block_size,
                         max_num_seqs, budget, threshold, rate, requests, prompt_hi, out_hi, shared, n, finish, seed,
                         policy) -> tuple[dict, dict]:
    """The engine settings and workload of one `SCHEDULES` draw."""
    engine_kw = dict(enable_prefix_caching=caching, block_size=block_size, num_gpu_blocks=num_blocks,
                     max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max(budget, max_num_seqs) if chunked else 128,
                     enable_chunked_prefill=chunked, long_prefill_token_threshold=min(threshold, max_model_len),
                     max_model_len=max_model_len, policy=policy, async_scheduling=async_scheduling)
    workload = small_workload(requests, seed, out_hi, prompt_hi, rate, shared, n=n, finish=finish,
                              max_output_tokens=out_hi, priority=[0, 1, 2])
    return engine_kw, workload


@settings(max_examples=EXAMPLES, deadline=None)
@given(num_blocks=st.integers(12, 400), **SCHEDULES)
def test_implicit_decodes_trace_equals_step_by_step(num_blocks, **draw):
    max_model_len = min(96, (num_blocks - 1) * draw["block_size"])
    _assert_same_run(*_engine_and_workload(num_blocks, max_model_len, **draw))


def test_a_run_cut_short_flushes_the_implicit_tokens():
    engine_kw = dict(enable_prefix_caching=True, num_gpu_blocks=500, max_num_seqs=8, max_model_len=512,
                     async_scheduling=True)
    workload = {"requests": 8, "seed": 1, "prompt_tokens": 20, "output_tokens": 300, "arrival": {"type": "offline"}}
    _assert_same_run(engine_kw, workload, max_time_s=0.05)


@pytest.mark.pure_python("counts rows by replacing the scheduler's schedule method")
def test_implicit_decodes_replace_most_rows():
    """In a steady batch, most decode rows are implicit (not listed in the SchedulerOutput)."""
    engine_kw = dict(enable_prefix_caching=True, num_gpu_blocks=500, max_num_seqs=8, max_model_len=512,
                     async_scheduling=True)
    workload = {"requests": 8, "seed": 1, "prompt_tokens": 20, "output_tokens": 200, "arrival": {"type": "offline"}}
    args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm",
                                  skip_tokenizer_init=True, **engine_kw)
    engine, info = create_engine_core(args)
    spec, requests = build_workload(workload, vocab_size=info.vocab_size)
    listed = implicit = 0
    orig = engine.scheduler.schedule

    def count():
        nonlocal listed, implicit
        so = orig()
        listed += len(so.num_scheduled_tokens)
        implicit += so.implicit_decodes.num_reqs if so.implicit_decodes is not None else 0
        return so
    engine.scheduler.schedule = count
    # (no fused steps: a fused step's implicit rows never pass through `schedule`)
    res = Simulation(engine, requests, spec.arrival, record_step_requests=False, fused_steps=False).run()
    assert len(res.completion_s) == 8
    assert implicit > 4 * listed
    assert listed + implicit == 8 * 200  # every request is a row in every step until its last token


def _count_lazy_calls(monkeypatch, *names: str) -> dict[str, int]:
    """Count the calls of these `LazyDecodes` methods (pure Python only: the methods are patched)."""
    from servetwin.sim.lazy_decode import LazyDecodes  # noqa: PLC0415

    counts = dict.fromkeys(names, 0)
    for name in names:
        orig = getattr(LazyDecodes, name)

        def wrapped(self, *a, _orig=orig, _name=name):
            counts[_name] += 1
            return _orig(self, *a)
        monkeypatch.setattr(LazyDecodes, name, wrapped)
    return counts


@pytest.mark.pure_python("counts calls by patching LazyDecodes methods")
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_block_boundaries_are_handled_in_place(async_scheduling, monkeypatch):
    """A member crossing block boundaries (a new block, a block registered) stays implicit: it is
    materialised about once (its last token), not once per block, and listed only around its prefill
    and its end - with a trace equal to the step-by-step run."""
    engine_kw = dict(enable_prefix_caching=True, num_gpu_blocks=600, max_num_seqs=8, max_model_len=512,
                     async_scheduling=async_scheduling, block_size=16)
    workload = {"requests": 8, "seed": 2, "prompt_tokens": 40, "output_tokens": 300, "arrival": {"type": "offline"}}
    counts = _count_lazy_calls(monkeypatch, "materialise", "advance")
    _assert_same_run(engine_kw, workload)
    # each lazy run crosses ~300/16 boundaries per request in place; materialised ~once per request
    assert counts["advance"] >= 8 * 300 // 16 - 8 * 2
    assert counts["materialise"] <= 8 * 2


# -- hybrid models: sliding-window KV cache groups free blocks as a member decodes --------------------
def _assert_same_hybrid_run(spec, engine_kw: dict, workload: dict, retention=0, max_time_s=None) -> None:
    """`_assert_same_run` on a model with these layers (and this sparse-retention interval)."""
    with sim_model(spec, retention):
        _assert_same_run(engine_kw, workload, max_time_s=max_time_s)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    pattern=st.sampled_from(sorted(LAYER_PATTERNS)),
    window=st.sampled_from([2, 3, 5, 8, 13, 40]),
    retention=st.sampled_from([0, 0, None, 1, 4]),  # x block_size (1, 4); None: dense
    extra_blocks=st.integers(0, 300),
    **SCHEDULES,
)
@example(pattern="gpt-oss-like", window=13, retention=0, async_scheduling=True, caching=True, chunked=True,
         block_size=4, extra_blocks=6, max_num_seqs=6, budget=8, threshold=0, rate=None, requests=4, prompt_hi=41,
         out_hi=29, shared=False, n=2, finish="max_tokens", seed=8, policy="priority")  # a shared block's free
def test_implicit_decodes_with_sliding_window_groups_trace_equals_step_by_step(pattern, window, retention,
                                                                               extra_blocks, **draw):
    """Hybrid models (gpt-oss's sliding / full layers, all sliding, Gemma's five sliding groups per full
    one): the windows' out-of-window frees, their sparse prefix-cache retention, prefix sharing,
    preemption (small pools), sync and async - the same trace and block pool as step by step."""
    spec = hybrid_spec(pattern, window)
    block_size = draw["block_size"]
    max_model_len = 96 if block_size < 16 else 96 + 16 * (extra_blocks % 3)
    # one max-length request fits
    num_blocks = NUM_KV_CACHE_GROUPS[pattern] * -(-max_model_len // block_size) + 1 + extra_blocks
    engine_kw, workload = _engine_and_workload(num_blocks, max_model_len, **draw)
    _assert_same_hybrid_run(spec, engine_kw, workload, None if retention is None or not draw["caching"]
                            else retention * block_size)


@pytest.mark.pure_python("counts calls by patching LazyDecodes methods")
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_window_frees_are_handled_in_place(async_scheduling, caching, monkeypatch):
    """gpt-oss-like layers (window 18, blocks of 4): a member whose window drops a block every 4 steps
    stays implicit through its frees as through its new blocks - materialised about once per request,
    its KV events done in place - with a trace equal to the step-by-step run."""
    engine_kw = dict(enable_prefix_caching=caching, num_gpu_blocks=800, max_num_seqs=8, max_model_len=512,
                     async_scheduling=async_scheduling, block_size=4)
    workload = {"requests": 8, "seed": 2, "prompt_tokens": 40, "output_tokens": 300, "arrival": {"type": "offline"}}
    counts = _count_lazy_calls(monkeypatch, "materialise", "advance")
    _assert_same_hybrid_run(hybrid_spec("gpt-oss-like", 18), engine_kw, workload)
    # per request: ~300/4 new blocks and ~300/4 frees in place, at different steps (the window's
    # boundary is 2 tokens off the blocks'), materialised about once
    assert counts["advance"] >= 8 * 2 * 300 // 4 - 8 * 8
    assert counts["materialise"] <= 8 * 2
