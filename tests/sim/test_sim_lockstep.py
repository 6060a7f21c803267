"""MoE data parallelism in lockstep (`servetwin.sim.lockstep`): the step barrier, padding, dummy batches and the
all-ranks-finished check every 16 steps, as vLLM 0.33's DPEngineCoreProc does them (core.py:2465-2572)."""
from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetwin.experiments.config.schema import validate_config
from servetwin.experiments.run.cluster_run import simulate_cluster
from servetwin.sim.lockstep import DP_SYNC_INTERVAL

BASE = {
    "name": "moe", "model": "gpt-oss-20b", "hardware": "h100-sxm",
    "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 2048},
    "workload": {"requests": 16, "prompt_tokens": {"type": "lognormal", "mean": 150, "cv": 0.6},
                 "output_tokens": {"type": "lognormal", "mean": 20, "cv": 0.6}, "max_prompt_tokens": 600,
                 "max_output_tokens": 60, "arrival": {"type": "poisson", "rate": 20}},
    "output": {"step_requests": False, "plots": False},
}


def _run(dp, seed, rate, requests=16):
    raw = copy.deepcopy(BASE)
    raw["workload"].update(seed=seed, requests=requests, arrival={"type": "poisson", "rate": rate})
    raw["cluster"] = {"instances": [{"name": "ep", "data_parallel_size": dp}]}
    sim, runs, reqs, _ = simulate_cluster(validate_config(raw))
    (inst,) = sim.instances
    assert inst.group is not None  # an MoE model with DP > 1 runs in lockstep
    return sim, runs, reqs, inst.group.stats


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 3), st.integers(0, 5), st.sampled_from([5.0, 50.0, 500.0]))
def test_lockstep_steps_follow_vllms_rules(dp, seed, rate):
    sim, runs, reqs, stats = _run(dp, seed, rate)
    steps = stats.steps
    assert set(sim.result.completion_s) == {r.request_id for r in reqs}
    prev_end = 0.0
    for s in steps:
        assert len(s.tokens) == dp
        assert s.t_start >= prev_end - 1e-12  # a global barrier: no rank starts before the last one ended
        prev_end = s.t_start + s.duration
        # idle ranks run a dummy batch, padded like everyone to the step's largest batch
        assert s.dummy_ranks == [i for i, t in enumerate(s.tokens) if t == 0]
        assert s.padded_tokens == sum(max(s.tokens) - t for t in s.tokens)
        # the all-reduce runs on step 1 and every 16th step of a wave; it ends the wave iff nobody has work
        check = s.step_in_wave == 1 or s.step_in_wave % DP_SYNC_INTERVAL == 0
        assert s.wave_ended == (check and not s.unfinished)
    # waves are numbered 1, 2, ...; each counts its steps from 1 and ends with its last step
    waves = {}
    for s in steps:
        waves.setdefault(s.wave, []).append(s)
    assert sorted(waves) == list(range(1, stats.waves + 1))
    for ws in waves.values():
        assert [s.step_in_wave for s in ws] == list(range(1, len(ws) + 1))
        assert ws[-1].wave_ended and not any(s.wave_ended for s in ws[:-1])
        # after the last step with work anywhere, the ranks run dummies up to the next check
        last_busy = max((s.step_in_wave for s in ws if max(s.tokens) > 0), default=0)
        assert len(ws) - last_busy < DP_SYNC_INTERVAL
    # every engine step that ran a batch is a group step where that rank had tokens
    assert sum(sum(1 for t in s.tokens if t > 0) for s in steps) == sum(len(r.recorder.steps.to_frame())
                                                                       for r in runs.values())


def test_a_lone_request_runs_dummies_on_the_idle_rank_until_the_16_step_check():
    sim, runs, reqs, stats = _run(2, 0, 1.0, requests=1)
    steps = stats.steps
    assert stats.waves == 1
    busy = [s for s in steps if max(s.tokens) > 0]
    assert all(len(s.dummy_ranks) == 1 for s in busy)  # the other rank idles along in every step
    # the request's last step is not a check step (its output is 20+ tokens): the tail runs to the next 16
    assert len(steps) % DP_SYNC_INTERVAL == 0 and len(steps) - len(busy) < DP_SYNC_INTERVAL
    assert stats.dummy_batches == len(busy) + 2 * (len(steps) - len(busy))


def test_external_lb_keeps_moe_ranks_in_one_lockstep_group():
    raw = copy.deepcopy(BASE)
    raw["cluster"] = {"instances": [{"name": "ep", "data_parallel_size": 2, "data_parallel_lb": "external"}],
                      "router": {"type": "round_robin"}}
    sim, runs, reqs, _ = simulate_cluster(validate_config(raw))
    a, b = sim.instances
    assert a.group is b.group is not None and len(a.group.sims) == 2  # two endpoints, one barrier
    assert set(sim.result.completion_s) == {r.request_id for r in reqs}
    assert all(len(s.tokens) == 2 for s in a.group.stats.steps)
