"""Property tests (issue 22, item 4): on hybrid-attention models the simulator and the torch backend size
the same KV pool into the same groups and make the same decisions, step by step.

The models are the torch backend's tiny random ones: `tiny-gpt-oss` (a 10-token sliding-window layer and
a full-attention layer: two KV cache groups, attention sinks, MoE) and `tiny-mistral-sw` (every layer
sliding, window 12: one sliding-window group). The sim reads the same config.json (its groups come from
the shared core), torch runs the model on the CPU in float32, greedy with ignore_eos.

What is compared, on top of the trace's decision columns (`assert_same_decisions`): every executed
step's SchedulerOutput - tokens per request, the block ids per KV cache group handed to each new,
resumed or running request (a window group's dropped blocks show as the null block 0), preemptions
and finished requests. Offline runs never read the step time, so the sim's clock (its roofline on the
`cpu` preset) and torch's measured one cannot change a decision; the sim steps one by one (no decode
fast-forward: every step's SchedulerOutput is compared).
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inttest_helpers import (Scenario, assert_same_decisions, assert_same_scheduler_outputs,
                             check_step_invariants, run_sim, run_torch)

from servetwin.sim.workload import WorkloadRequest

VOCAB = 320  # both tiny models
GROUPS = {"tiny-gpt-oss": 2, "tiny-mistral-sw": 1}  # KV cache groups (sliding + full / sliding)
WINDOWS = {"tiny-gpt-oss": 10, "tiny-mistral-sw": 12}
MAX_EXAMPLES = int(os.environ.get("SERVETWIN_TWIN_HYBRID_EXAMPLES", "5"))


def _min_blocks(model: str, block_size: int, max_model_len: int) -> int:
    """The core's start-up check: one max-length request fits in every group (+ the null block)."""
    return GROUPS[model] * math.ceil(max_model_len / block_size) + 1


@st.composite
def scenarios(draw) -> Scenario:
    model = draw(st.sampled_from(sorted(GROUPS)))
    block_size = draw(st.sampled_from([4, 8]))
    max_model_len = 64
    low = _min_blocks(model, block_size, max_model_len)
    num_gpu_blocks = draw(st.integers(low, low + 6))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 5))
    budget = draw(st.integers(max(max_num_seqs, 4), 48)) if chunked else max_model_len
    engine = dict(block_size=block_size, max_model_len=max_model_len, num_gpu_blocks=num_gpu_blocks,
                  enable_chunked_prefill=chunked, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                  enable_prefix_caching=draw(st.booleans()), async_scheduling=draw(st.booleans()))
    prefixes = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=30), max_size=2))
    requests, seen = [], set()
    for i in range(draw(st.integers(1, 5))):
        prefix = draw(st.sampled_from([[]] + prefixes)) if prefixes else []
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if prefix else 1,
                               max_size=min(max_model_len - 1 - len(prefix), 30)))
        prompt = prefix + suffix
        while tuple(prompt) in seen:  # identical prompts: a known sim gap (test_int_twin_properties.py)
            prompt = prompt[:-1] + [(prompt[-1] + 1) % VOCAB]
        seen.add(tuple(prompt))
        out = draw(st.integers(1, min(20, max_model_len - len(prompt))))
        requests.append(WorkloadRequest(f"r{i}", 0.0, prompt, out))
    return Scenario(engine, requests, model=model)


def _window_preempting_scenario(model: str) -> Scenario:
    """Prompts several windows long in a pool too small for them all: chunked prefill across the window
    edge, out-of-window frees, prefix hits cut by the window, and preemptions. An all-sliding model
    holds ~W/block_size blocks per request, so it gets twice the requests to run out of blocks."""
    rng = np.random.default_rng(5)
    shared = rng.integers(0, VOCAB, 16).tolist()
    num = 4 * (3 - GROUPS[model])
    reqs = [WorkloadRequest(f"r{i}", 0.0, shared + rng.integers(0, VOCAB, 8 + 4 * (i % 4)).tolist(), 20 + i)
            for i in range(num)]
    engine = dict(block_size=4, max_model_len=64, num_gpu_blocks=_min_blocks(model, 4, 64) + 2,
                  enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=num,
                  enable_prefix_caching=True)
    return Scenario(engine, reqs, model=model)


def _check(scenario: Scenario) -> tuple[dict, dict, list]:
    logs: list = []
    fs, sinfo = run_sim(scenario, fast_forward=False, log=logs)
    ft, tinfo = run_torch(scenario, log=logs)
    e = scenario.engine
    assert sinfo.num_gpu_blocks == tinfo.num_gpu_blocks == e["num_gpu_blocks"]
    assert sinfo.kv_cache_groups == tinfo.kv_cache_groups and len(sinfo.kv_cache_groups) == GROUPS[scenario.model]
    expected = {r.request_id: r.max_tokens for r in scenario.requests}
    for frames in (fs, ft):
        check_step_invariants(frames, max_num_batched_tokens=e["max_num_batched_tokens"],
                              max_num_seqs=e["max_num_seqs"], num_gpu_blocks=e["num_gpu_blocks"],
                              max_model_len=e["max_model_len"], expected_outputs=expected)
    assert_same_decisions(fs, ft)
    assert_same_scheduler_outputs(*logs)
    return fs, ft, logs[0].steps


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_sim_and_torch_make_identical_decisions_on_hybrid_models(scenario):
    _check(scenario)


@pytest.mark.parametrize("model", sorted(GROUPS))
def test_both_backends_agree_through_window_frees_preemptions_and_hits(model):
    """A workload that surely exercises the window groups (not left to Hypothesis' luck): a request's
    sliding group shows the null block in place of dropped blocks, someone is preempted, prefixes hit."""
    fs, _, steps = _check(_window_preempting_scenario(model))
    assert fs["steps"].num_preempted.sum() > 0
    assert fs["steps"].prefix_hits.sum() > 0
    sliding = [ids[0] for s in steps for _, _, ids in s["blocks"].values() if ids is not None]
    assert any(0 in group for group in sliding)  # the null block replaced out-of-window blocks


@pytest.mark.parametrize("model", sorted(GROUPS))
def test_both_backends_size_the_same_pool_from_the_groups(model):
    """Given the same KV memory, the sim and torch cut it into the same blocks: one block is a page of
    each layer of one group (vLLM's hybrid rule), in both through the shared core's KV cache plan.
    Both in bfloat16 (the sim knows no float32 MoE kernel), so the pages are the same size."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415

    budget = 3 * 2**20
    sc = Scenario(dict(block_size=8, max_model_len=64, kv_cache_memory_bytes=budget, max_num_batched_tokens=64,
                       max_num_seqs=8, dtype="bfloat16"), model=model)
    _, sinfo = create_engine_core(sc.engine_args("sim"))
    _, tinfo = create_engine_core(sc.engine_args("torch"))
    assert sinfo.kv_cache_groups == tinfo.kv_cache_groups and len(sinfo.kv_cache_groups) == GROUPS[model]
    layers_per_group = 2 // GROUPS[model]  # both tiny models have 2 layers; 2 KV heads x 16, K and V, bf16
    assert sinfo.num_gpu_blocks == tinfo.num_gpu_blocks == budget // (layers_per_group * 8 * 2 * 2 * 16 * 2)
