"""The SimPy engine loop: event order at equal times, closed loops, async scheduling, determinism."""
import gc
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.engine_core import EngineCore
from servetwin.sim.arrivals import ClosedLoop, Offline
from servetwin.sim.coefficients import CostCoefficients
from servetwin.sim.cost_model import CostModel
from servetwin.sim.engine import SIM_GC_THRESHOLD0, Simulation, simulate, simulate_workload
from servetwin.sim.executor import SimExecutor
from servetwin.sim.workload import WorkloadRequest

ONE_SECOND_STEPS = CostCoefficients(c_step=1.0, c_linear=0.0, c_attn_prefill=0.0, c_attn_decode=0.0,
                                    c_lm_head=0.0, c_comm=0.0)


def _engine(async_scheduling=False, coefficients=ONE_SECOND_STEPS, blocks=200, max_model_len=512):
    cm = CostModel("tiny-llama", "cpu", coefficients=coefficients)
    return EngineCore(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                      max_model_len=max_model_len, async_scheduling=async_scheduling),
                      CacheConfig(num_gpu_blocks=blocks, block_size=16), SimExecutor(cost_model=cm))


def _req(rid, t, prompt_tokens=8, max_tokens=3, **kw):
    """A request whose prompt starts with a token of its own (no accidental prefix sharing)."""
    first = 1 + sum(map(ord, rid)) * 7 % 250
    return WorkloadRequest(rid, t, [first] + list(range(prompt_tokens - 1)), max_tokens, **kw)


def test_arrival_at_a_step_end_joins_the_next_step():
    reqs = [_req("a", 0.0), _req("c", 0.5),
            _req("b", 1.0)]
    res = simulate(_engine(), reqs, Offline())  # open-loop replay of the given arrival_s
    frames = res.recorder.frames()
    steps = frames["steps"]
    assert steps.t_start_s.tolist()[:2] == [0.0, 1.0]
    assert steps.annotation.tolist()[:2] == ["execute_context_1(8)_generation_0(0)",
                                              "execute_context_2(16)_generation_1(1)"]
    r = frames["requests"].set_index("request_id")
    assert r.loc["b", "queue_s"] == 0.0 and r.loc["c", "queue_s"] == 0.5  # both start at t=1
    assert r.loc["a", "ttft_s"] == 1.0 and r.loc["b", "ttft_s"] == 1.0
    assert res.completion_s == {"a": 3.0, "c": 4.0, "b": 4.0}
    assert res.end_time_s == 4.0 and res.num_steps == 4


def test_closed_loop_zero_think_submits_before_the_next_step_starts():
    reqs = [_req(f"r{i}", 0.0, max_tokens=2) for i in range(3)]
    res = simulate(_engine(), reqs, ClosedLoop(clients=1))
    assert [r.arrival_s for r in reqs] == [0.0, 2.0, 4.0]
    steps = res.recorder.frames()["steps"]
    busy = steps[steps.total_tokens > 0]
    assert busy.t_start_s.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # no idle gap
    # the scheduler's last, empty step only tells the runner about the finished request: not a row
    assert len(steps) == 6 and (steps.total_tokens > 0).all()
    assert res.end_time_s == 6.0 and res.completion_s == {"r0": 2.0, "r1": 4.0, "r2": 6.0}


def test_idle_engine_waits_for_the_next_arrival():
    reqs = [_req("a", 0.0, max_tokens=1), _req("b", 10.0, max_tokens=1)]
    res = simulate(_engine(), reqs, Offline())
    steps = res.recorder.frames()["steps"]
    assert steps[steps.total_tokens > 0].t_start_s.tolist() == [0.0, 10.0]
    assert res.completion_s == {"a": 1.0, "b": 11.0}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_time_is_the_sum_of_predicted_step_durations(async_scheduling):
    engine = _engine(async_scheduling, coefficients=None)
    reqs = [WorkloadRequest(f"q{i}", 0.0, list(np.random.default_rng(i).integers(0, 256, 40 + 7 * i)),
                            5 + i) for i in range(12)]
    res = simulate(engine, reqs, Offline())
    steps = res.recorder.frames()["steps"]
    busy = steps[steps.total_tokens > 0]
    assert res.end_time_s == pytest.approx(busy.duration_s.sum())
    assert np.allclose(busy.t_start_s.to_numpy()[1:], busy.t_end_s.to_numpy()[:-1])
    req = res.recorder.frames()["requests"].set_index("request_id")
    assert req.output_tokens.to_dict() == {f"q{i}": 5 + i for i in range(12)}
    assert len(res.completion_s) == 12 and not res.unfinished


def test_async_and_sync_finish_the_same_work():
    reqs = lambda: [_req(f"x{i}", 0.1 * i, prompt_tokens=20 + i, max_tokens=4 + i % 3)
                    for i in range(10)]
    sync = simulate(_engine(False), reqs(), Offline())
    asyn = simulate(_engine(True), reqs(), Offline())
    tok = lambda r: r.recorder.frames()["requests"].set_index("request_id").output_tokens.to_dict()
    assert tok(sync) == tok(asyn) and set(sync.completion_s) == set(asyn.completion_s)


def test_parallel_sampling_and_forced_eos():
    reqs = [WorkloadRequest("p", 0.0, list(range(1, 30)), max_tokens=50, n=3, eos_at=4)]
    res = simulate(_engine(), reqs, Offline())
    rows = res.recorder.frames()["requests"]
    assert sorted(rows.request_id) == ["0_p", "1_p", "2_p"] and set(rows.parent_id) == {"p"}
    assert set(rows.finish_reason) == {"stop"} and set(rows.output_tokens) == {4}
    assert res.completion_s == {"p": 4.0}


def test_unservable_request_is_rejected_and_the_rest_run():
    reqs = [_req("long", 0.0, prompt_tokens=600), _req("ok", 0.0)]
    res = simulate(_engine(max_model_len=512), reqs, ClosedLoop(clients=1))
    assert list(res.rejected) == ["long"] and "max_model_len" in res.rejected["long"]
    assert list(res.completion_s) == ["ok"] and not res.unfinished


def test_max_time_leaves_requests_unfinished():
    reqs = [_req(f"u{i}", 0.0, max_tokens=20) for i in range(3)]
    res = Simulation(_engine(), reqs, Offline(), max_time_s=5.0).run()
    assert res.end_time_s == 5.0 and res.unfinished == ["u0", "u1", "u2"]


def test_runs_are_deterministic_and_never_read_the_host_clock(monkeypatch):
    args = {"backend": "sim", "model": "qwen3-0.6b", "hardware": "h200", "max_num_seqs": 16,
            "num_gpu_blocks": 400, "max_model_len": 4096}
    workload = {"seed": 5, "requests": 40,
                "shared_prefix": None, "output_tokens": {"type": "uniform", "low": 2, "high": 30},
                "prompt_tokens": {"type": "lognormal", "mean": 200, "cv": 1.0}, "n": 2,
                "arrival": {"type": "closed_loop", "clients": 4, "think_time_s": 0.01,
                            "think": "exponential"}}
    workload.pop("shared_prefix")
    first = simulate_workload(args, workload)

    def boom(*_a, **_k):
        raise AssertionError("host clock read")
    for name in ("time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, boom)
    second = simulate_workload(args, workload)
    monkeypatch.undo()
    a, b = first.recorder.frames(), second.recorder.frames()
    for table in ("steps", "requests", "step_requests"):
        assert a[table].equals(b[table]), table
    assert first.end_time_s == second.end_time_s > 0
    assert len(first.completion_s) == 40


def test_prefix_sharing_workload_hits_the_cache():
    args = {"backend": "sim", "model": "llama-3.1-8b", "hardware": "h100-sxm", "max_num_seqs": 64,
            "max_model_len": 4096}
    wl = {"seed": 0, "shared_prefix": {"groups": 4, "per_group": 4, "prefix_tokens": 1024, "suffix_tokens": 64},
          "output_tokens": 8, "arrival": {"type": "poisson", "rate": 20}}
    res = simulate_workload(args, wl)
    req = res.recorder.frames()["requests"]
    # the first member of each group computes the prefix; the other three reuse its 64 blocks
    assert sorted(req.cached_tokens.tolist()) == [0] * 4 + [1024] * 12
    assert len(res.completion_s) == 16


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_client_timeout_aborts_between_steps_and_frees_everything(async_scheduling):
    # 1 s steps: "slow" needs 10 steps, its client gives up 3.5 s after arrival; "fast" finishes in time
    reqs = [_req("slow", 0.0, max_tokens=10, timeout_s=3.5), _req("fast", 0.0, max_tokens=2, timeout_s=3.5),
            _req("par", 0.0, max_tokens=10, n=2, timeout_s=2.0)]
    engine = _engine(async_scheduling=async_scheduling)
    res = simulate(engine, reqs, Offline())
    assert list(res.completion_s) == ["fast"]
    assert res.aborted_s == {"par": 2.0, "slow": 4.0}  # applied at the first step start after the deadline
    assert not res.unfinished
    rows = res.recorder.frames()["requests"].set_index("request_id")
    assert rows.loc[["slow", "0_par", "1_par"], "finish_reason"].tolist() == ["abort"] * 3
    assert rows.loc["slow", "output_tokens"] < 10 and rows.loc["fast", "finish_reason"] == "length"
    assert not engine.has_work()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 199  # every block back


def test_workload_timeout_is_validated_and_drawn_onto_every_request():
    from servetwin.sim.workload import build_workload

    spec, reqs = build_workload({"requests": 3, "timeout_s": 1.5})
    assert spec.timeout_s == 1.5 and {r.timeout_s for r in reqs} == {1.5}
    with pytest.raises(ValueError, match=r"workload\.timeout_s: must be > 0"):
        build_workload({"requests": 3, "timeout_s": 0})


def test_run_collects_young_garbage_rarely_and_restores_the_thresholds():
    """Simulation.run raises the collector's young threshold for the loop only (sim/engine.py)."""
    seen = []
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        sim = Simulation(_engine(), [_req("a", 0.0), _req("b", 0.5)], Offline(),
                         on_complete=lambda rid, t: seen.append(gc.get_threshold()))
        sim.run()
        assert seen and all(t == (SIM_GC_THRESHOLD0, 10, 10) for t in seen)
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*old)


def test_builtin_hash_runs_the_same_simulation_as_sha256():
    """Decisions depend only on hash equality: a prefix-sharing run (implicit decodes, async, output
    blocks of equal greedy prompts hashing equal) gives the same trace with either hash."""
    def run(algo):
        args = {"backend": "sim", "model": "llama-3.1-8b", "hardware": "h100-sxm", "max_num_seqs": 16,
                "max_model_len": 4096, "async_scheduling": True, "num_gpu_blocks": 400,
                "prefix_caching_hash_algo": algo}
        wl = {"seed": 1, "shared_prefix": {"groups": 3, "per_group": 4, "prefix_tokens": 256, "suffix_tokens": 40},
              "output_tokens": {"type": "uniform", "low": 20, "high": 80}, "arrival": {"type": "poisson", "rate": 40}}
        res = simulate_workload(args, wl, record_step_requests=False)
        rec = res.recorder
        return list(rec.steps), {rid: (t.token_times, t.cached_tokens) for rid, t in rec.requests.items()}
    steps, requests = run("builtin")
    assert (steps, requests) == run("sha256")
    assert any(cached for _, cached in requests.values())  # the prefix cache was hit


def test_a_client_timeout_between_the_engine_finish_and_the_delivery_is_no_abort():
    """The API server still carries the last chunk when the client's deadline passes: the request completed
    (it used to be aborted too, and its completion event fired twice)."""
    import copy

    from servetwin.experiments.config.schema import validate_config
    from servetwin.experiments.run.runner import run_backends

    raw = {"name": "t", "model": "tiny-llama", "hardware": "h100-sxm",
           "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 16, "max_model_len": 512},
           "workload": {"requests": 60, "timeout_s": 0.05, "prompt_tokens": {"type": "lognormal", "mean": 120, "cv": 0.5},
                        "output_tokens": {"type": "lognormal", "mean": 30, "cv": 0.5}, "max_prompt_tokens": 300,
                        "max_output_tokens": 80, "arrival": {"type": "poisson", "rate": 100}},
           "output": {"step_requests": False, "plots": False}}
    combined, _, runs = run_backends(validate_config(copy.deepcopy(raw)), progress=False, log=lambda m: None)
    s = combined["backends"]["sim"]
    assert s["completed"] + s["aborted_sequences"] == 60


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_on_first_token_fires_once_per_request_at_its_first_token(async_scheduling):
    """`hooks.on_first_token(request id, t)`: once per workload request (n > 1: at its first child's first
    token), at the engine time of that token - the trace's `first_token_s` - and never for a rejected one."""
    reqs = [_req("a", 0.0, max_tokens=5), _req("x", 0.1, prompt_tokens=600), _req("b", 0.3, prompt_tokens=40, max_tokens=4),
            WorkloadRequest("p", 0.7, list(range(1, 30)), max_tokens=6, n=3)]
    sim = Simulation(_engine(async_scheduling, max_model_len=512), reqs, Offline())
    seen = []
    sim.hooks.on_first_token = lambda rid, t: seen.append((rid, t))
    res = sim.run()
    assert set(res.rejected) == {"x"}
    rows = res.recorder.frames()["requests"]
    first = rows.assign(parent=rows.parent_id.fillna(rows.request_id)).groupby("parent").first_token_s.min().to_dict()
    assert sorted(r for r, _ in seen) == ["a", "b", "p"]
    assert dict(seen) == {rid: first[rid] for rid in ("a", "b", "p")}


def test_a_config_error_inside_the_simulation_reaches_the_caller_with_its_field():
    """SimPy re-raises a process's exception as `type(err)(*err.args)`: a ConfigError survives it, path and all."""
    reqs = [_req("a", 0.5), _req("b", 0.1)]  # not sorted by arrival
    with pytest.raises(ConfigError) as e:
        Simulation(_engine(), reqs, Offline()).run()
    assert e.value.path == "arrivals" and "sorted by arrival_s" in str(e.value)


@settings(max_examples=60, deadline=None)
@given(settings_=st.lists(st.tuples(st.integers(1, 4), st.sampled_from([1, 1, 3]), st.sampled_from([None, 2, 7])),
                          min_size=1, max_size=12))
def test_workload_sampling_params_equal_params_built_per_request(settings_):
    """The SamplingParams shared by a workload's requests of the same settings == the ones `_admit` built per
    request before (every field, the EOS ids included); one object per setting."""
    from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415
    from servetwin.sim.engine import workload_sampling_params  # noqa: PLC0415
    for max_tokens, n, eos in settings_:
        want = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=eos is None)
        if eos is not None:
            want.update_from_generation_config(eos)
        got = workload_sampling_params(max_tokens, n, eos)
        assert got == want and got is workload_sampling_params(max_tokens, n, eos)  # (== compares every field)
        assert (got.eos_token_id, got.all_stop_token_ids) == (want.eos_token_id, want.all_stop_token_ids)
