"""The fused implicit-decode step (`Simulation._fused_step`, `SimScheduler.quiet_step`, `CostModel.decode_duration`,
`TraceRecorder.on_implicit_step`) gives exactly the step-by-step run: every step and request row, ITLs, completions,
client timeouts and the front end's deliveries; and the cost model's decode fast path gives `predict`'s float."""
import pytest
from hypothesis import example, given, settings, strategies as st

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.sim.coefficients import CostCoefficients
from servetwin.sim.cost_model import CostModel, StepSummary
from servetwin.sim.engine import Simulation
from servetwin.sim.frontend import FrontendConfig
from servetwin.sim.workload import build_workload, rng_streams
from sim_helpers import assert_same_block_pool, assert_same_recordings, small_engine, small_workload, window_model


@settings(max_examples=200, deadline=None)
@given(model=st.sampled_from(["tiny-llama", "llama-3.1-8b", "gpt-oss-120b"]), tp=st.sampled_from([1, 2]),
       cuda_graphs=st.booleans(), async_scheduling=st.booleans(), ipc=st.booleans(), k=st.integers(1, 700),
       mean_s=st.integers(0, 9000), shared_frac=st.sampled_from([0.0, 0.0, 0.3, 1.0, 2.0]))
def test_decode_duration_equals_predict(model, tp, cuda_graphs, async_scheduling, ipc, k, mean_s, shared_frac):
    """`decode_duration(k, sum of (s + 1), shared)` is `predict`'s duration of that pure decode batch, to the bit,
    for dense, MoE and sliding-window models, TP, CUDA graphs (padded sizes) or eager, sync or async - the
    second call of a batch size from its cached terms too."""
    cm = CostModel(model, "h100-sxm", tp=tp, cuda_graphs=cuda_graphs, ipc=ipc, async_scheduling=async_scheduling)
    sum_before = k * mean_s
    shared = int(sum_before * shared_frac)
    # (`predict_by_terms`: `predict` itself prices a pure decode batch from the same cached parts)
    expected = cm.predict_by_terms(StepSummary.from_lists([], [], 0, implicit_decodes=k, implicit_sum_s=sum_before,
                                                          shared_kv=shared)).duration_s
    assert cm.decode_duration(k, sum_before + k, shared) == expected
    other = cm.predict_by_terms(StepSummary.from_lists([], [], 0, implicit_decodes=k,
                                                       implicit_sum_s=sum_before + 7 * k, shared_kv=0)).duration_s
    assert cm.decode_duration(k, sum_before + 8 * k, 0) == other  # (cached terms, other lengths)


def _run(engine_kw: dict, workload: dict, mode: str, frontend: str, max_time_s=None, free_steps=False,
         runner_known=None):
    """mode: "fused" (implicit decodes and fused steps), "lazy" (implicit decodes, no fused step) or "eager"
    (every step and row simulated). `free_steps`: every step priced 0 s (all cost coefficients 0).
    `runner_known` (a dict): filled with the requests the runner knows after each step, by step counter (the
    step boundary hook keeps every step one by one: no step windows)."""
    args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm", skip_tokenizer_init=True,
                                  **engine_kw)
    engine, info = create_engine_core(args)
    if free_steps:
        engine.executor.cost_model.coefficients = CostCoefficients.from_terms({})
    spec, requests = build_workload(workload, vocab_size=info.vocab_size)
    sim = Simulation(engine, requests, spec.arrival, rng=rng_streams(spec.seed)["runtime"], fast_forward=False,
                     record_step_requests=False, lazy_decode=mode != "eager", fused_steps=mode == "fused",
                     max_time_s=max_time_s, frontend=FrontendConfig(frontend))
    if runner_known is not None:
        def boundary(_sim):
            runner_known[engine.step_counter] = frozenset(engine.executor.num_prompt_tokens)
        sim.on_step_boundary = boundary
    result = sim.run()
    return result, engine, sim


def _assert_same(engine_kw: dict, workload: dict, frontend: str, max_time_s=None, free_steps=False) -> int:
    """The fused run equals the step-by-step run; returns its fused steps."""
    eager, eager_engine, eager_sim = _run(engine_kw, workload, "eager", frontend, max_time_s, free_steps)
    fused, fused_engine, fused_sim = _run(engine_kw, workload, "fused", frontend, max_time_s, free_steps)
    assert_same_recordings(eager.recorder, fused.recorder)
    assert (eager.completion_s, eager.rejected, eager.aborted_s, eager.unfinished, eager.num_steps, eager.end_time_s) \
        == (fused.completion_s, fused.rejected, fused.aborted_s, fused.unfinished, fused.num_steps, fused.end_time_s)
    if frontend == "api_server":
        assert eager_sim.frontend.num_messages == fused_sim.frontend.num_messages
        assert eager_sim.frontend.cpu.busy_s == fused_sim.frontend.cpu.busy_s
    assert_same_block_pool(eager_engine, fused_engine)
    assert eager_engine.step_counter == fused_engine.step_counter
    # the runner forgets a finished request at the same step (a fused step after a finish hands it over too)
    assert eager_engine.executor.num_prompt_tokens.keys() == fused_engine.executor.num_prompt_tokens.keys()
    assert eager_sim.num_fused_steps == 0
    known = [{}, {}]  # ... after every step, with the steps taken one by one
    _run(engine_kw, workload, "eager", frontend, max_time_s, free_steps, runner_known=known[0])
    _run(engine_kw, workload, "fused", frontend, max_time_s, free_steps, runner_known=known[1])
    assert known[0] == known[1]
    return fused_sim.num_fused_steps


@settings(max_examples=25, deadline=None)
@given(async_scheduling=st.booleans(), caching=st.booleans(), block_size=st.sampled_from([1, 4, 16]),
       max_num_seqs=st.integers(1, 10), rate=st.sampled_from([None, 20.0, 200.0]), requests=st.integers(1, 12),
       out_hi=st.integers(1, 80), frontend=st.sampled_from(["offline", "api_server"]),
       timeout_s=st.sampled_from([None, None, 0.01, 0.05]), window=st.sampled_from([None, None, 5, 24]),
       extra_blocks=st.sampled_from([0, 10, 400]), seed=st.integers(0, 500))
@example(async_scheduling=True, caching=True, block_size=4, max_num_seqs=4, rate=200.0, requests=8, out_hi=100,
         frontend="api_server", timeout_s=0.01, window=None, extra_blocks=400, seed=3)  # aborts between fused steps
def test_fused_steps_equal_the_step_by_step_run(async_scheduling, caching, block_size, max_num_seqs, rate, requests,
                                                out_hi, frontend, timeout_s, window, extra_blocks, seed):
    """Sync and async scheduling, prefix caching, sliding-window groups (their frees done in place in a fused
    step), small pools (preemption), arrivals between steps, the API-server front end, client timeouts (an
    abort between fused steps): the same run as step by step."""
    engine_kw = small_engine(window, block_size, 96, extra_blocks, enable_prefix_caching=caching,
                           max_num_seqs=max_num_seqs, async_scheduling=async_scheduling)
    extra = {"timeout_s": timeout_s} if timeout_s is not None else {}
    workload = small_workload(requests, seed, out_hi, 40, rate, False, max_output_tokens=min(out_hi, 50), **extra)
    with window_model(window):
        _assert_same(engine_kw, workload, frontend)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("frontend", ["offline", "api_server"])
def test_most_steps_of_a_steady_batch_are_fused(async_scheduling, frontend):
    """A steady decode batch: nearly every step is fused (the others admit, finish or cross a length cap),
    block boundaries included (KV events in place), and the run equals step by step - also cut mid-run."""
    engine_kw = dict(enable_prefix_caching=True, block_size=16, num_gpu_blocks=600, max_num_seqs=8,
                     max_model_len=512, async_scheduling=async_scheduling)
    workload = {"requests": 8, "seed": 2, "prompt_tokens": 40, "output_tokens": 300, "arrival": {"type": "offline"}}
    fused = _assert_same(engine_kw, workload, frontend)
    assert fused >= 300 - 20
    assert _assert_same(engine_kw, workload, frontend, max_time_s=0.2) > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("frontend", ["offline", "api_server"])
def test_the_step_after_a_finish_is_fused(async_scheduling, frontend):
    """Requests of different lengths finishing one by one while the others decode: the step after a finish
    (its finished ids handed to the runner) is fused too, so a finish costs one normal step (its last token's):
    at most the admission, the two steps after it (the prefills' outputs), one per request and the last one."""
    engine_kw = dict(enable_prefix_caching=True, block_size=16, num_gpu_blocks=600, max_num_seqs=8,
                     max_model_len=512, async_scheduling=async_scheduling)
    workload = {"requests": 8, "seed": 2, "prompt_tokens": 40,
                "output_tokens": {"type": "uniform", "low": 50, "high": 300}, "arrival": {"type": "offline"}}
    fused = _assert_same(engine_kw, workload, frontend)
    result, _, _ = _run(engine_kw, workload, "fused", frontend)
    assert result.num_steps - fused <= 3 + 8 + 1


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("frontend", ["offline", "api_server"])
def test_fused_steps_priced_zero_seconds(async_scheduling, frontend):
    """Steps priced 0 s (every cost coefficient 0): a fused step then takes no event either, as a normal one."""
    engine_kw = dict(enable_prefix_caching=True, block_size=4, num_gpu_blocks=600, max_num_seqs=4,
                     max_model_len=256, async_scheduling=async_scheduling)
    workload = {"requests": 6, "seed": 5, "prompt_tokens": 20, "output_tokens": 40,
                "arrival": {"type": "poisson", "rate": 50.0}}
    assert _assert_same(engine_kw, workload, frontend, free_steps=True) > 0
