"""Property tests (issue 6 section 4): the simulator and the torch backend make identical scheduling
decisions in offline mode, and every step row of both traces obeys the scheduler's invariants.

Hypothesis draws small workloads (prompt / output lengths, an arrival pattern that only fixes the
offline order, shared prefixes, n > 1) and engine settings (tight KV pools, chunked prefill on / off,
small token budgets, prefix caching on / off, fcfs / priority, async scheduling). Both engines are
built by `servetwin.core.engine.engine_factory.create_engine_core` with the same `num_gpu_blocks` and `max_model_len`;
the sim runs through `servetwin.sim.engine.Simulation` (Offline arrival), torch (`tiny-llama`, CPU, float32)
through `servetwin.core.testbed.realtime.run_realtime(offline=True)`, greedy with ignore_eos.

Model loading: the first `TorchExecutor` pays for the torch / transformers imports and the tiny
model build (~3 s); later ones re-read the cached 2-layer checkpoint in ~15 ms, so each example
builds a fresh engine (fresh KV pool of the drawn size) and the module-level `_warm_model` only makes
sure the expensive part happens once, outside Hypothesis' timing.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from inttest_helpers import Scenario, assert_same_decisions, check_step_invariants, run_sim, run_torch

from servetwin.sim.workload import WorkloadRequest

VOCAB = 320  # tiny-llama
MAX_EXAMPLES = int(os.environ.get("SERVETWIN_TWIN_EXAMPLES", "12"))

_WARM: dict[str, object] = {}


def _warm_model() -> None:
    """Import torch / transformers and build (or find) tiny-llama once per test session."""
    if "info" not in _WARM:
        from servetwin.gpu.models.registry import resolve_model  # noqa: PLC0415

        _WARM["info"] = resolve_model("tiny-llama")
        import servetwin.gpu.executor as executor  # noqa: F401, PLC0415


@st.composite
def scenarios(draw) -> Scenario:
    block_size = draw(st.sampled_from([8, 16]))
    max_model_len = draw(st.sampled_from([64, 128]))
    min_blocks = math.ceil(max_model_len / block_size) + 1  # one max-length request must fit (+ null block)
    num_gpu_blocks = draw(st.integers(min_blocks, min_blocks + 5))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    if chunked:
        budget = draw(st.integers(max(max_num_seqs, 4), 96))
        threshold = draw(st.sampled_from([0, 0, 8, 24]))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 64))
        threshold = 0
    policy = draw(st.sampled_from(["fcfs", "fcfs", "priority"]))
    engine = dict(block_size=block_size, max_model_len=max_model_len, num_gpu_blocks=num_gpu_blocks,
                  enable_chunked_prefill=chunked, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                  long_prefill_token_threshold=threshold, enable_prefix_caching=draw(st.booleans()),
                  policy=policy, async_scheduling=draw(st.booleans()),
                  scheduler_reserve_full_isl=draw(st.booleans()))

    # shared prefixes: a few token lists that several prompts start with
    prefixes = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_model_len // 2),
                             max_size=2))
    num_requests = draw(st.integers(1, 7))
    requests = []
    seen: set[tuple[int, ...]] = set()
    for i in range(num_requests):
        prefix = draw(st.sampled_from([[]] + prefixes)) if prefixes else []
        room = max_model_len - 1 - len(prefix)  # prompt + 1 output token must fit
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if prefix else 1,
                               max_size=min(room, 40)))
        prompt = prefix + suffix
        # whole prompts differ between requests (prefixes are still shared): identical prompts give
        # identical greedy outputs in torch, whose output blocks then hit the prefix cache, while the
        # sim's fake tokens never coincide - a known modelling gap (xfail test at the end of this file)
        while tuple(prompt) in seen:
            bump = (prompt[-1] + 1) % VOCAB if prompt else 0
            prompt = prompt + [bump] if len(prompt) < max_model_len - 1 else prompt[:-1] + [bump]
        seen.add(tuple(prompt))
        out = draw(st.integers(1, min(24, max_model_len - len(prompt))))
        n = draw(st.sampled_from([1, 1, 1, 2]))  # n > 1: children share one priority and arrival
        requests.append(WorkloadRequest(f"r{i}", 0.0, prompt, out, n=n))
    # an arrival pattern (all at once, Poisson-like gaps or bursts) fixes only the offline order
    pattern = draw(st.sampled_from(["together", "gaps", "bursts"]))
    if pattern != "together":
        gaps = draw(st.lists(st.integers(0, 3) if pattern == "bursts" else st.integers(1, 100),
                             min_size=num_requests, max_size=num_requests))
        times = np.cumsum(gaps)
        order = sorted(range(num_requests), key=lambda i: (int(times[i]), i))
        requests = [requests[i] for i in order]
    if policy == "priority":  # few levels, so equal priorities (ties broken by arrival order) are common
        for r in requests:
            r.priority = draw(st.integers(0, 2))
    return Scenario(engine, requests)


def _tight_preempting_scenario() -> Scenario:
    """Four long-running requests in a pool too small for them: preemptions and recomputation."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, VOCAB, 24).tolist()
    reqs = [WorkloadRequest(f"r{i}", 0.0, shared + rng.integers(0, VOCAB, 8 + 5 * i).tolist(), 30 + i)
            for i in range(4)]
    engine = dict(block_size=8, max_model_len=128, num_gpu_blocks=17, enable_chunked_prefill=True,
                  max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=True)
    return Scenario(engine, reqs)


def _check(scenario: Scenario) -> tuple[dict, dict]:
    fs, sinfo = run_sim(scenario)
    ft, tinfo = run_torch(scenario)
    assert sinfo.num_gpu_blocks == tinfo.num_gpu_blocks == scenario.engine["num_gpu_blocks"]
    assert sinfo.max_model_len == tinfo.max_model_len == scenario.engine["max_model_len"]
    expected = {}
    for r in scenario.requests:
        for j in range(r.n):
            expected[r.request_id if r.n == 1 else f"{j}_{r.request_id}"] = r.max_tokens
    e = scenario.engine
    for frames in (fs, ft):
        check_step_invariants(frames, max_num_batched_tokens=e["max_num_batched_tokens"],
                              max_num_seqs=e["max_num_seqs"], num_gpu_blocks=e["num_gpu_blocks"],
                              max_model_len=e["max_model_len"], expected_outputs=expected)
    assert_same_decisions(fs, ft)
    return fs, ft


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
@example(_tight_preempting_scenario())
def test_sim_and_torch_make_identical_offline_decisions(scenario):
    _warm_model()
    _check(scenario)


def test_tight_pool_preempts_and_both_backends_agree():
    """The explicit example above does exercise preemption and prefix hits (not a vacuous pass)."""
    _warm_model()
    fs, ft = _check(_tight_preempting_scenario())
    for frames in (fs, ft):
        assert frames["steps"].num_preempted.sum() > 0
        assert frames["steps"].prefix_hits.sum() > 0
        assert (frames["steps"].num_context_reqs > 0).sum() > 1  # chunked prefill spans steps


def test_sim_fast_forward_does_not_change_the_trace():
    """The sim's decode fast-forward gives the rows stepping one by one gives (what torch is compared to)."""
    sc = _tight_preempting_scenario()
    fast, _ = run_sim(sc, fast_forward=True)
    slow, _ = run_sim(sc, fast_forward=False)
    assert_same_decisions(fast, slow)


def test_priority_policy_with_equal_priorities_matches_between_backends():
    """Regression (fixed in core/realtime.py): offline torch runs stamped every request with arrival 0.0,
    so equal-priority ties picked the oldest running request as the preemption victim where the sim
    (and vLLM's distinct wall-clock stamps) pick the newest."""
    _warm_model()
    rng = np.random.default_rng(1)
    reqs = [WorkloadRequest(f"r{i}", 0.0, rng.integers(0, VOCAB, 40).tolist(), 40) for i in range(3)]
    engine = dict(block_size=16, max_model_len=128, num_gpu_blocks=9, enable_chunked_prefill=True,
                  max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False, policy="priority")
    sc = Scenario(engine, reqs)
    fs, _ = run_sim(sc)
    ft, _ = run_torch(sc)
    assert fs["steps"].num_preempted.sum() > 0  # the tie matters only when someone is preempted
    assert_same_decisions(fs, ft)


def _one_token_last_chunk_scenario() -> Scenario:
    """Budget 5: step 0 prefills a (3 tokens) and 2 of b's 3; step 1 runs a's first decode and b's LAST
    prompt token - a one-token prefill chunk, i.e. a context request, not a decode."""
    engine = dict(block_size=8, max_model_len=64, num_gpu_blocks=9, enable_chunked_prefill=True,
                  max_num_batched_tokens=5, max_num_seqs=2, enable_prefix_caching=False)
    return Scenario(engine, [WorkloadRequest("a", 0.0, [5, 6, 7], 4), WorkloadRequest("b", 0.0, [1, 2, 3], 4)])


def test_one_token_last_prefill_chunk_is_context_in_torch_and_step_by_step_sim():
    step_by_step, _ = run_sim(_one_token_last_chunk_scenario(), fast_forward=False)
    _warm_model()
    ft, _ = run_torch(_one_token_last_chunk_scenario())
    for frames in (step_by_step, ft):
        assert frames["steps"].annotation.iloc[1] == "execute_context_1(1)_generation_1(1)"
    assert_same_decisions(step_by_step, ft)


def test_sim_fast_forward_matches_step_by_step_on_a_one_token_last_prefill_chunk():
    fast, _ = run_sim(_one_token_last_chunk_scenario(), fast_forward=True)
    slow, _ = run_sim(_one_token_last_chunk_scenario(), fast_forward=False)
    assert_same_decisions(fast, slow)


@pytest.mark.xfail(strict=True, reason=(
    "modelling gap: identical prompts + prefix caching + preemption. Torch's greedy outputs of identical "
    "prompts are identical, so their full blocks holding OUTPUT tokens get the same block hashes and a "
    "request resumed after preemption hits another request's cached output blocks (step 13: 32 prefix-hit "
    "tokens, 2 tokens scheduled). The sim's fake tokens (servetwin.sim.executor.fake_token(step, row)) differ per "
    "batch row, so the sim hits only 16 tokens and recomputes 18. vLLM behaves like torch here. A sim "
    "token rule that is a function of the request's token history (+ seed when sampling) would match."))
def test_identical_greedy_prompts_share_output_blocks_in_both_backends():
    engine = dict(block_size=8, max_model_len=64, num_gpu_blocks=9, enable_chunked_prefill=False,
                  max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=True)
    sc = Scenario(engine, [WorkloadRequest(f"r{i}", 0.0, [0] * 5, 13) for i in range(4)])
    fs, _ = run_sim(sc)
    _warm_model()
    ft, _ = run_torch(sc)
    assert fs["steps"].num_preempted.sum() > 0 and ft["steps"].num_preempted.sum() > 0
    assert_same_decisions(fs, ft)


def _empty_step_preemption_scenario() -> Scenario:
    """Async scheduling, 4 usable blocks of 8: at step 9 `a` waits for its last output (placeholder) and
    `b` needs a new block: the scheduler preempts `b` and schedules nothing; step 10 recomputes b.
    The step that scheduled nothing has no row: its preemption is counted on the request and carried
    to the next step row (found by this test: it used to be lost)."""
    engine = dict(block_size=8, max_model_len=32, num_gpu_blocks=5, max_num_batched_tokens=32, max_num_seqs=4,
                  async_scheduling=True, enable_prefix_caching=False)
    return Scenario(engine, [WorkloadRequest("a", 0.0, list(range(1, 5)), 9),
                             WorkloadRequest("b", 0.0, list(range(100, 108)), 10)])


@pytest.mark.parametrize("backend", ["sim", "torch"])
def test_preemption_in_a_step_that_schedules_nothing_is_recorded(backend):
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.core.testbed.realtime import run_realtime  # noqa: PLC0415
    from servetwin.core.testbed.trace import TraceRecorder  # noqa: PLC0415
    from servetwin.sim.arrivals import Offline  # noqa: PLC0415
    from servetwin.sim.engine import Simulation  # noqa: PLC0415

    sc = _empty_step_preemption_scenario()
    engine, _ = create_engine_core(sc.engine_args(backend))
    if backend == "sim":
        sim = Simulation(engine, sc.requests, Offline(), fast_forward=False)
        sim.run()
        frames = sim.recorder.frames()
    else:
        _warm_model()
        rec = TraceRecorder("twin", "torch")
        run_realtime(engine, sc.requests, rec, offline=True)
        frames = rec.frames()
    assert engine.scheduler.num_preemptions_total == 1  # the scheduler did preempt once
    assert int(frames["requests"].num_preemptions.sum()) == 1
    assert int(frames["steps"].num_preempted.sum()) == 1
