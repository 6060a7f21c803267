"""The simulator's exact shortcuts inside a cluster (sim/cluster.py): with implicit steady decodes on
(what every engine of a cluster run uses, sim/scheduler.py) the cluster gives exactly the run of its
engines stepped one by one - every engine's step and request rows, the router's decisions (times,
candidates, scores, picks), completion times - for plain and hybrid (sliding-window) models, sync and
async scheduling, with and without the API-server front end, under routers that read scraped metrics."""
from __future__ import annotations

import contextlib
import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import servetwin.sim.cluster as cluster_module
from servetwin.experiments.config.schema import validate_config
from servetwin.experiments.run.cluster_run import simulate_cluster
from servetwin.sim.engine import Simulation
from sim_helpers import CLUSTER_BASE, CLUSTER_ROUTERS, assert_same_engine_runs, hybrid_spec, sim_model

BASE = CLUSTER_BASE
ROUTERS = CLUSTER_ROUTERS


def _step_by_step(*args, **kwargs) -> Simulation:
    """An engine simulation with the decode shortcuts off: every step and row simulated. (A factory, not a
    subclass: with the compiled build, `make test-compiled`, an interpreted class cannot inherit from the
    compiled Simulation.)"""
    return Simulation(*args, **{**kwargs, "lazy_decode": False, "fast_forward": False})


def _run(exp, step_by_step: bool, monkeypatch):
    with monkeypatch.context() as patch:
        if step_by_step:
            patch.setattr(cluster_module, "Simulation", _step_by_step)
        sim, runs, _, _ = simulate_cluster(exp)
    lazy = [s.lazy_decode for _, _, s in sim.simulations()]
    assert lazy == [not step_by_step] * len(lazy)
    fused = sum(s.num_fused_steps for _, _, s in sim.simulations())  # (fused implicit-decode steps)
    assert (fused > 0) == (not step_by_step)
    return sim, runs


def _decisions(sim) -> list[str]:
    """The decision table, exactly (repr: a filtered-out candidate's NaN score equals itself)."""
    return [repr((d.request_id, d.t, d.pick, d.rank, d.candidates, d.scores)) for d in sim.result.decisions]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(router=st.sampled_from(ROUTERS), instances=st.integers(2, 4), rate=st.sampled_from([20.0, 80.0, 400.0]),
       async_scheduling=st.booleans(), frontend=st.sampled_from(["offline", "api_server"]),
       window=st.sampled_from([None, 24, 40]), scrape_s=st.sampled_from([0.005, 0.05]), seed=st.integers(0, 50))
def test_a_cluster_with_implicit_decodes_equals_its_step_by_step_run(router, instances, rate, async_scheduling,
                                                                    frontend, window, scrape_s, seed, monkeypatch):
    raw = copy.deepcopy(BASE)
    raw["seed"] = seed
    raw["engine"]["async_scheduling"] = async_scheduling
    raw["workload"]["arrival"] = {"type": "poisson", "rate": rate}
    raw["frontend"] = {"type": frontend}
    raw["cluster"] = {"instances": [{"name": "r", "count": instances}],
                      "router": {**router, "scrape_interval_s": scrape_s}}
    exp = validate_config(raw)
    model = sim_model(hybrid_spec("gpt-oss-like", window)) if window is not None else contextlib.nullcontext()
    with model:
        eager, eager_runs = _run(exp, True, monkeypatch)
        lazy, lazy_runs = _run(exp, False, monkeypatch)
    assert _decisions(eager) == _decisions(lazy)
    assert eager.result.completion_s == lazy.result.completion_s
    assert eager.result.rejected == lazy.result.rejected
    assert eager.result.end_time_s == lazy.result.end_time_s
    assert len(eager.result.completion_s) == 30
    assert_same_engine_runs(eager_runs, lazy_runs)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(router=st.sampled_from([r for r in ROUTERS if not any(s["type"] in ("queue", "kv-cache-utilization")
                                                            for s in r.get("scorers", []))]),
       instances=st.integers(2, 4), rate=st.sampled_from([20.0, 400.0]), async_scheduling=st.booleans(),
       frontend=st.sampled_from(["offline", "api_server"]), seed=st.integers(0, 50))
def test_a_router_that_reads_no_scraped_metrics_runs_the_same_without_scrapes(router, instances, rate,
                                                                             async_scheduling, frontend, seed,
                                                                             monkeypatch):
    """`ClusterSimulation.scrapes_needed`: routers that read no scraped metrics (round robin, least loaded,
    affinity + token-load) run no scrapes; forcing the scrapes on changes nothing in the run."""
    raw = copy.deepcopy(BASE)
    raw["seed"] = seed
    raw["engine"]["async_scheduling"] = async_scheduling
    raw["workload"]["arrival"] = {"type": "poisson", "rate": rate}
    raw["frontend"] = {"type": frontend}
    raw["cluster"] = {"instances": [{"name": "r", "count": instances}], "router": {**router, "scrape_interval_s": 0.005}}
    exp = validate_config(raw)
    skipped, skipped_runs, _, _ = simulate_cluster(exp)
    assert not skipped.scrapes_needed()
    with monkeypatch.context() as patch:
        patch.setattr(cluster_module.ClusterSimulation, "scrapes_needed", lambda self: True)
        scraped, scraped_runs, _, _ = simulate_cluster(exp)
    assert _decisions(skipped) == _decisions(scraped)
    assert skipped.result.completion_s == scraped.result.completion_s
    assert skipped.result.end_time_s == scraped.result.end_time_s
    assert_same_engine_runs(skipped_runs, scraped_runs)


def test_which_routers_read_scraped_metrics():
    from servetwin.experiments.config.schema import validate_config as vc  # noqa: PLC0415
    for router, reads in [(ROUTERS[0], False), (ROUTERS[1], False), (ROUTERS[2], False), (ROUTERS[3], True),
                          ({"type": "llm_d", "scorers": [{"type": "load-aware"}]}, True),
                          ({"type": "random"}, False)]:
        raw = copy.deepcopy(BASE)
        raw["workload"]["requests"] = 5
        raw["workload"]["shared_prefix"]["groups"], raw["workload"]["shared_prefix"]["per_group"] = 1, 5
        raw["cluster"] = {"instances": [{"name": "r", "count": 2}], "router": router}
        sim, _, _, _ = simulate_cluster(vc(raw))
        assert sim.scrapes_needed() == reads, router
