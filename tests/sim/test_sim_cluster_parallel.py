"""A routing cluster split over forked worker processes (sim/cluster_parallel.py) gives the one-process run:
every engine's step and request rows, the router's decisions (times, candidates, scores, picks), completions,
rejections, the end time and the router's final counts - whatever the router, arrivals, front end and
scheduling; the picks a router can prove (`forced_pick`) skip the workers' meetings; clusters that cannot be
split run in one process; a worker's failure is raised with its traceback and an interrupt keeps every engine."""
from __future__ import annotations

import copy
import os
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import servetwin.sim.cluster as cluster_module
import servetwin.sim.cluster_parallel as parallel
from servetwin.core.config_error import ConfigError
from servetwin.experiments.config.schema import validate_config
from servetwin.experiments.run.cluster_run import simulate_cluster
from servetwin.sim.routers import (Endpoint, InFlightLoad, PrefixAffinityFilter, RandomRouter, RoundRobin)
from sim_helpers import CLUSTER_BASE, CLUSTER_ROUTERS, assert_same_engine_runs, window_model

LLMD_LOADED = {"type": "llm_d", "filters": [{"type": "prefix-cache-affinity"}],
               "scorers": [{"type": "token-load"}, {"type": "queue"}], "params": {"in_flight_load": {}}}
ROUTERS = [*CLUSTER_ROUTERS, {"type": "random"}, LLMD_LOADED]


def _raw(router, instances, arrival, frontend="offline", async_scheduling=True, seed=0, workers=1):
    raw = copy.deepcopy(CLUSTER_BASE)
    raw["seed"] = seed
    raw["engine"]["async_scheduling"] = async_scheduling
    raw["workload"]["arrival"] = arrival
    raw["frontend"] = {"type": frontend}
    raw["cluster"] = {"instances": [{"name": "r", "count": instances}], "router": router, "sim_workers": workers}
    return raw


def _decisions(sim) -> list[str]:
    """The decision table, exactly (repr: a filtered-out candidate's NaN score equals itself)."""
    return [repr((d.request_id, d.t, d.pick, d.rank, d.candidates, d.scores)) for d in sim.result.decisions]


def _router_state(sim) -> str:
    load = getattr(sim.router, "load", None)
    counts = [(e.active, e.active_tokens) for e in sim.endpoints]
    return repr((counts, None if load is None else (load.tokens, load.requests, load.charged)))


def assert_same_run(raw, workers: int):
    one, one_runs, _, _ = simulate_cluster(validate_config({**raw, "cluster": {**raw["cluster"], "sim_workers": 1}}))
    split, split_runs, _, _ = simulate_cluster(
        validate_config({**raw, "cluster": {**raw["cluster"], "sim_workers": workers}}))
    assert one.num_meetings == 0 and one.workers_used == 1
    assert _decisions(one) == _decisions(split)
    assert (one.result.completion_s, one.result.rejected, one.result.aborted_s, one.result.end_time_s) \
        == (split.result.completion_s, split.result.rejected, split.result.aborted_s, split.result.end_time_s)
    assert list(one.result.completion_s) == list(split.result.completion_s)  # (in time order, as they came)
    assert _router_state(one) == _router_state(split)
    assert_same_engine_runs(one_runs, split_runs)
    for label, run in one_runs.items():  # (each engine's end: the cluster's, when its last engine anywhere is done)
        assert (run.simulated_s, run.completed, run.frontend) == \
            (split_runs[label].simulated_s, split_runs[label].completed, split_runs[label].frontend)
    return one, split


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(router=st.sampled_from(ROUTERS), instances=st.integers(2, 4), rate=st.sampled_from([20.0, 80.0, 400.0]),
       stages=st.booleans(), async_scheduling=st.booleans(), frontend=st.sampled_from(["offline", "api_server"]),
       window=st.sampled_from([None, 24]), timeout_s=st.sampled_from([None, None, 0.1]),
       workers=st.integers(2, 3), seed=st.integers(0, 50))
def test_a_split_cluster_equals_its_one_process_run(router, instances, rate, stages, async_scheduling, frontend,
                                                    window, timeout_s, workers, seed):
    """(with client timeouts: their aborts release the router's counts too)"""
    arrival = ({"type": "stages", "stages": [{"rate": rate, "duration_s": 10 / rate},
                                             {"rate": rate, "duration_s": 20 / rate}]}
               if stages else {"type": "poisson", "rate": rate})
    raw = _raw({**router, "scrape_interval_s": 0.005}, instances, arrival, frontend, async_scheduling, seed)
    if timeout_s is not None:
        raw["workload"]["timeout_s"] = timeout_s
    with window_model(window):
        _, split = assert_same_run(raw, workers)
    assert split.workers_used == min(workers, instances)


def test_picks_a_router_can_prove_skip_the_meetings():
    """Round robin and random picks never depend on the engines: the workers meet only at the stages' ends;
    llm-d's prefix-affinity filter leaves one endpoint for a prompt it has routed before, whose TTFT gate the
    charges since the last meeting cannot open (6 prompt groups: their first requests and the stage ends meet)."""
    stages = {"type": "stages", "stages": [{"rate": 40, "duration_s": 0.5}, {"rate": 40, "duration_s": 0.25}]}
    for router, most in (({"type": "round_robin"}, 2), ({"type": "random"}, 2), (LLMD_LOADED, 10)):
        _, split = assert_same_run(_raw(router, 4, stages), 2)
        assert 1 <= split.num_meetings <= most, (router, split.num_meetings)
    _, split = assert_same_run(_raw({"type": "least_loaded"}, 4, stages), 2)
    assert split.num_meetings == 30 + 2  # (every pick reads the counts: a meeting each, and one per stage)


def test_clusters_that_cannot_be_split_run_in_one_process():
    stages = {"type": "stages", "stages": [{"rate": 40, "duration_s": 0.5}]}
    closed = _raw({"type": "round_robin"}, 3, {"type": "closed_loop", "clients": 4}, workers=2)
    dp = _raw({"type": "round_robin"}, 2, stages, workers=2)
    dp["cluster"]["instances"] = [{"name": "r", "count": 2, "data_parallel_size": 2}]
    one = _raw({"type": "round_robin"}, 1, stages, workers=2)
    moe = _raw({"type": "round_robin"}, 2, stages, workers=2)  # (external LB: one endpoint per rank, one lockstep)
    moe["cluster"]["instances"] = [{"name": "m", "data_parallel_size": 2, "data_parallel_lb": "external"}]
    moe["model"] = "gpt-oss-20b"
    for raw, reason in ((closed, "ClosedLoop arrivals"), (dp, "data-parallel ranks"), (one, "one instance"),
                        (moe, "MoE lockstep")):
        sim, _, _, _ = simulate_cluster(validate_config(raw))
        assert any(reason in r for r in parallel.partition_blockers(sim))
        assert sim.workers_used == 1 and sim.num_meetings == 0
        assert len(sim.result.completion_s) == len(sim.result.decisions) > 0


def test_sim_workers_is_checked_with_its_field():
    for bad in (0, 9, "two", True, 1.5):
        raw = _raw({"type": "round_robin"}, 2, {"type": "poisson", "rate": 10}, workers=bad)
        with pytest.raises(ConfigError, match=r"cluster\.sim_workers"):
            validate_config(raw)
    assert validate_config(_raw({"type": "round_robin"}, 2, {"type": "poisson", "rate": 10}, workers="auto")) \
        .cluster.sim_workers == "auto"


# -- the routers' proofs ----------------------------------------------------------------------------------
def _endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(i, f"e{i}", "both") for i in range(n)]


def test_round_robin_and_random_forced_picks_are_their_picks_with_the_same_draws():
    endpoints = _endpoints(5)
    rr = RoundRobin()
    for _ in range(12):
        assert rr.forced_pick(None, endpoints) == rr.route(None, endpoints).pick
    told, plain = RandomRouter(np.random.default_rng(7)), RandomRouter(np.random.default_rng(7))
    for k in range(40):
        forced = told.forced_pick(None, endpoints) if k % 3 else None
        if k % 2:  # (asked twice: the same draw)
            assert forced is None or told.forced_pick(None, endpoints) == forced
        pick = told.route(None, endpoints).pick
        assert pick == plain.route(None, endpoints).pick and forced in (None, pick)


class _FixedScores:
    def __init__(self, scores):
        self.scores = scores

    def score(self, request, endpoints):
        return [self.scores[e.index] for e in endpoints]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 6), penalty=st.sampled_from([0.0, 50.0, 18_000.0]))
def test_the_affinity_filters_forced_candidates_hold_for_every_release_since_the_meeting(data, n, penalty):
    """Whatever was released since the last meeting (each endpoint's tokens anywhere from 0 to its bound), the
    filter keeps what `forced_filter` said it would."""
    scores = data.draw(st.lists(st.sampled_from([0.0, 0.5, 0.8, 1.0]), min_size=n, max_size=n))
    bound = data.draw(st.lists(st.integers(0, 2_000), min_size=n, max_size=n))
    load = InFlightLoad()
    load.meeting_tokens = dict(enumerate(bound))
    filt = PrefixAffinityFilter(_FixedScores(scores), max_ttft_penalty_ms=penalty, peak_prefill_throughput=20.0,
                                load=load)
    endpoints = _endpoints(n)
    forced = filt.forced_filter(None, endpoints)
    for _ in range(5):
        load.tokens = {i: data.draw(st.integers(0, b)) for i, b in enumerate(bound)}
        kept = filt.filter(None, endpoints)
        assert forced is None or forced == kept


def test_a_forced_pick_needs_the_meeting_bound_under_a_ttft_gate():
    load = InFlightLoad()
    filt = PrefixAffinityFilter(_FixedScores([1.0, 0.0]), load=load)
    assert filt.forced_filter(None, _endpoints(2)) is None  # (no meeting yet: no bound)
    load.mark_meeting()
    assert filt.forced_filter(None, _endpoints(2)) == [0]
    load.meeting_tokens = {0: 10**9}  # (a charge so large the gate might open)
    assert filt.forced_filter(None, _endpoints(2)) is None


# -- failures and interrupts ------------------------------------------------------------------------------
def _stages_raw(workers=2):
    return _raw({"type": "least_loaded"}, 4, {"type": "stages", "stages": [{"rate": 40, "duration_s": 0.75}]},
                workers=workers)


def test_a_worker_that_fails_is_raised_with_its_traceback(monkeypatch):
    parent = os.getpid()
    real = cluster_module.ClusterSimulation._route

    def route(self, request):
        if os.getpid() != parent and request.request_id.endswith("-20"):
            raise ValueError("boom in a worker")
        return real(self, request)
    monkeypatch.setattr(cluster_module.ClusterSimulation, "_route", route)
    with pytest.raises(parallel.WorkerFailed, match="boom in a worker"):
        simulate_cluster(validate_config(_stages_raw()))


def test_a_worker_killed_mid_run_is_named(monkeypatch):
    """A worker killed (SIGKILL: the OOM killer's) leaves no traceback: worker 0 says which one vanished."""
    parent = os.getpid()
    real = cluster_module.ClusterSimulation._route

    def route(self, request):
        if os.getpid() != parent and request.request_id.endswith("-20"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, request)
    monkeypatch.setattr(cluster_module.ClusterSimulation, "_route", route)
    with pytest.raises(parallel.WorkerFailed, match=r"cluster worker 1 exited without (a word|its results)"):
        simulate_cluster(validate_config(_stages_raw()))


def test_worker_0_failing_ends_the_others(monkeypatch):
    parent = os.getpid()
    real, fork = cluster_module.ClusterSimulation._route, os.fork
    forked = []

    def route(self, request):
        if os.getpid() == parent and request.request_id.endswith("-20"):
            raise ValueError("boom in worker 0")
        return real(self, request)

    def recorded_fork():
        pid = fork()
        if pid:
            forked.append(pid)
        return pid
    monkeypatch.setattr(cluster_module.ClusterSimulation, "_route", route)
    monkeypatch.setattr(parallel.os, "fork", recorded_fork)
    with pytest.raises(ValueError, match="boom in worker 0"):
        simulate_cluster(validate_config(_stages_raw()))
    assert len(forked) == 1
    with pytest.raises(ChildProcessError):  # (the worker was ended and reaped: none left behind)
        os.waitpid(forked[0], os.WNOHANG)


def test_an_interrupted_split_run_keeps_every_engine(monkeypatch):
    """Ctrl-C reaching worker 0 mid-run: every worker stops where it is and ships its engines; the run is
    interrupted with the requests every engine finished, as the one-process run leaves them."""
    parent = os.getpid()
    real = cluster_module.ClusterSimulation._route

    def route(self, request):
        if os.getpid() == parent and request.request_id.endswith("-24"):  # (Ctrl-C landing in the loop; a real
            # SIGINT's KeyboardInterrupt lands wherever the interpreter next checks, here at once)
            raise KeyboardInterrupt
        return real(self, request)
    monkeypatch.setattr(cluster_module.ClusterSimulation, "_route", route)
    sim, runs, _, interrupted = simulate_cluster(validate_config(_stages_raw()))
    assert interrupted
    assert len(runs) == 4 and all(run.num_requests > 0 for run in runs.values())  # (least loaded: every instance)
    assert all(len(run.recorder.requests) > 0 for run in runs.values())


def test_auto_splits_runs_long_enough_where_two_cpus_are_free(monkeypatch):
    raw = _raw({"type": "round_robin"}, 3, {"type": "poisson", "rate": 40}, workers="auto")
    sim, _, _, _ = simulate_cluster(validate_config(raw))
    assert sim.workers_used == 1  # (30 requests: below AUTO_MIN_REQUESTS)
    monkeypatch.setattr(parallel, "AUTO_MIN_REQUESTS", 30)
    sim, _, _, _ = simulate_cluster(validate_config(raw))
    assert sim.workers_used == (2 if len(os.sched_getaffinity(0)) >= 2 else 1)
