"""`CostModel.decode_durations` (and `SimExecutor.implicit_decode_durations`): n consecutive fused decode
steps priced in one call, equal element for element to n `decode_duration` calls and to `predict`."""
from hypothesis import given, settings, strategies as st

from servetwin.core.sched.output import ImplicitDecodes
from servetwin.sim.cost_model import CostModel, StepSummary
from servetwin.sim.executor import SimExecutor

_MODELS = {}


def _model(model: str, tp: int, cuda_graphs: bool, async_scheduling: bool, ipc: bool) -> CostModel:
    key = (model, tp, cuda_graphs, async_scheduling, ipc)
    if key not in _MODELS:  # (fresh caches per test case are not needed: a cached batch size is part of the claim)
        _MODELS[key] = CostModel(model, "h100-sxm", tp=tp, cuda_graphs=cuda_graphs, ipc=ipc,
                                 async_scheduling=async_scheduling)
    return _MODELS[key]


_COST = dict(model=st.sampled_from(["tiny-llama", "llama-3.1-8b", "gpt-oss-120b"]), tp=st.sampled_from([1, 2]),
             cuda_graphs=st.booleans(), async_scheduling=st.booleans(), ipc=st.booleans())


@settings(max_examples=150, deadline=None)
@given(**_COST, k=st.integers(1, 600), mean_s=st.integers(0, 200_000), n=st.integers(0, 40),
       shared_frac=st.sampled_from([0.0, 0.3, 1.0, 2.0]), fresh=st.booleans())
def test_decode_durations_equal_sequential_calls(model, tp, cuda_graphs, async_scheduling, ipc, k, mean_s, n,
                                                 shared_frac, fresh):
    """Bit for bit (floats compared with ==): dense, MoE and sliding-window models (the window's min switching
    sides inside the run), TP, graphs or eager, sync or async, the shared tokens below, inside or above the
    batch's KV; the batch size's parts cached by a previous call or computed by this one."""
    cm = (CostModel(model, "h100-sxm", tp=tp, cuda_graphs=cuda_graphs, ipc=ipc, async_scheduling=async_scheduling)
          if fresh else _model(model, tp, cuda_graphs, async_scheduling, ipc))
    first = k * mean_s + k
    shared = int(first * shared_frac)
    bulk = cm.decode_durations(k, first, shared, n)
    sequential = [cm.decode_duration(k, first + i * k, shared) for i in range(n)]
    assert len(bulk) == n
    assert bulk == sequential
    for i in range(n):  # and each float is predict's (both calls run `decode_durations`' loop)
        expected = cm.predict(StepSummary.from_lists([], [], 0, implicit_decodes=k,
                                                     implicit_sum_s=first - k + i * k, shared_kv=shared)).duration_s
        assert bulk[i] == expected


def test_decode_duration_new_coefficients_object():
    """A new `coefficients` object is priced with its own values (the per-size parts are recomputed)."""
    cm = CostModel("tiny-llama", "h100-sxm")
    before = cm.decode_duration(4, 400)
    coeffs = type(cm.coefficients)(**{name: 2 * getattr(cm.coefficients, name)
                                      for name in cm.coefficients.__dataclass_fields__})
    cm.coefficients = coeffs
    after = cm.decode_duration(4, 400)
    assert after != before
    assert after == cm.predict(StepSummary.from_lists([], [], 0, implicit_decodes=4, implicit_sum_s=396)).duration_s


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 64), sum_before=st.integers(0, 50_000), shared=st.integers(0, 60_000),
       n=st.integers(0, 20))
def test_executor_implicit_decode_durations(k, sum_before, shared, n):
    """The executor's bulk wrapper equals n `implicit_decode_duration` calls on the growing aggregates."""
    ex = SimExecutor("llama-3.1-8b", "h100-sxm")
    bulk = ex.implicit_decode_durations(ImplicitDecodes(k, sum_before, 0), shared, n)
    assert bulk == [ex.implicit_decode_duration(ImplicitDecodes(k, sum_before + i * k, i), shared) for i in range(n)]
