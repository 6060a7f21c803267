"""Step windows (`Simulation._plan_window`: a run of quiet fused steps as one SimPy event, its per-step actions
applied later with their own times, cut when a request reaches the engine) give exactly the run with windows
off: every step and request row, ITLs, completions, aborts, the front end's deliveries and CPU time, the
router's decisions - single engines (async and sync scheduling, with and without the API server, client
timeouts, small pools, sliding windows) and clusters behind routers that read scraped metrics."""
from __future__ import annotations

import copy
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import servetwin.sim.cluster as cluster_module
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.experiments.config.schema import validate_config
from servetwin.experiments.run.cluster_run import simulate_cluster
from servetwin.sim.engine import Simulation
from servetwin.sim.frontend import FrontendConfig
from servetwin.sim.workload import build_workload, rng_streams
from sim_helpers import (CLUSTER_BASE, CLUSTER_ROUTERS, NUM_KV_CACHE_GROUPS, assert_same_block_pool,
                         assert_same_engine_runs, assert_same_recordings, small_engine, small_workload, window_model)


FRONTENDS = {"offline": FrontendConfig("offline"), "api_server": FrontendConfig("api_server"),
             "two_servers_in_order": FrontendConfig("api_server", "chat", api_server_count=2, ingress="in_order")}


def _run(engine_kw: dict, workload: dict, frontend, windows: bool):
    args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm", skip_tokenizer_init=True,
                                  **engine_kw)
    engine, info = create_engine_core(args)
    spec, requests = build_workload(workload, vocab_size=info.vocab_size)
    sim = Simulation(engine, requests, spec.arrival, rng=rng_streams(spec.seed)["runtime"], fast_forward=False,
                     record_step_requests=False, step_windows=windows,
                     frontend=FRONTENDS[frontend] if isinstance(frontend, str) else frontend)
    return sim.run(), engine, sim


def _assert_same(engine_kw: dict, workload: dict, frontend) -> tuple[int, int]:
    """The windowed run equals the run with windows off; returns its (windows, steps in them). `frontend`: a
    name in FRONTENDS or a FrontendConfig."""
    num_windows, in_windows, _ = _assert_same_steps(engine_kw, workload, frontend)
    return num_windows, in_windows


def _assert_same_steps(engine_kw: dict, workload: dict, frontend) -> tuple[int, int, int]:
    """`_assert_same`, and the run's number of steps."""
    off, off_engine, off_sim = _run(engine_kw, workload, frontend, False)
    on, on_engine, on_sim = _run(engine_kw, workload, frontend, True)
    assert_same_recordings(off.recorder, on.recorder)
    assert (off.completion_s, off.rejected, off.aborted_s, off.unfinished, off.num_steps, off.end_time_s) \
        == (on.completion_s, on.rejected, on.aborted_s, on.unfinished, on.num_steps, on.end_time_s)
    if off_sim.frontend is not None:
        assert off_sim.frontend.num_messages == on_sim.frontend.num_messages
        assert [c.busy_s for c in off_sim.frontend.cpus] == [c.busy_s for c in on_sim.frontend.cpus]
    assert_same_block_pool(off_engine, on_engine)
    assert off_engine.step_counter == on_engine.step_counter
    assert off_sim.num_fused_steps == on_sim.num_fused_steps
    assert off_sim.window_stats == (0, 0)
    return (*on_sim.window_stats, on.num_steps)


@settings(max_examples=30, deadline=None)
@given(async_scheduling=st.booleans(), caching=st.booleans(), block_size=st.sampled_from([1, 4, 16]),
       max_num_seqs=st.integers(1, 10), rate=st.sampled_from([None, 20.0, 200.0]), requests=st.integers(1, 12),
       out_hi=st.integers(1, 120), frontend=st.sampled_from(sorted(FRONTENDS)),
       timeout_s=st.sampled_from([None, None, 0.01, 0.05]), window=st.sampled_from([None, None, 5, 24]),
       extra_blocks=st.sampled_from([0, 10, 400]), shared=st.booleans(), seed=st.integers(0, 500))
def test_windows_equal_the_run_without_them(async_scheduling, caching, block_size, max_num_seqs, rate, requests,
                                             out_hi, frontend, timeout_s, window, extra_blocks, shared, seed):
    """Sync and async scheduling (sync: windows without a front end only), prefix caching, sliding-window groups, small pools
    (preemption), arrivals during windows (cuts), the API-server front end (also two servers, in-order
    ingress), client timeouts: the same run."""
    engine_kw = small_engine(window, block_size, 160, extra_blocks, enable_prefix_caching=caching,
                           max_num_seqs=max_num_seqs, async_scheduling=async_scheduling)
    extra = {"timeout_s": timeout_s} if timeout_s is not None else {}
    workload = small_workload(requests, seed, out_hi, 40, rate, shared, max_output_tokens=min(out_hi, 100), **extra)
    with window_model(window):
        num_windows, steps = _assert_same(engine_kw, workload, frontend)
    if not async_scheduling and frontend != "offline":
        assert num_windows == 0
    assert steps >= num_windows  # (a window cut while its first step runs has one step)


@pytest.mark.parametrize("async_scheduling, frontend", [(True, "offline"), (True, "api_server"), (False, "offline")])
@pytest.mark.parametrize("rate", [None, 30.0])
def test_a_steady_batch_runs_in_windows(async_scheduling, frontend, rate):
    """A steady decode batch: most of its steps are inside windows (each up to the next member event: a new
    block), arrivals cut them, and the run is the same."""
    engine_kw = dict(enable_prefix_caching=True, block_size=64, num_gpu_blocks=600, max_num_seqs=8,
                     max_model_len=1024, async_scheduling=async_scheduling)
    workload = {"requests": 8, "seed": 2, "prompt_tokens": 40, "output_tokens": 600,
                "arrival": {"type": "offline"} if rate is None else {"type": "poisson", "rate": rate}}
    num_windows, steps = _assert_same(engine_kw, workload, frontend)
    assert num_windows > 0
    assert steps > 300
    assert steps / num_windows > 8


def _busy_frontend(count: int, ingress: str, endpoint: str, ingress_s: float, output_scale: float,
                   latency_in_s: float) -> FrontendConfig:
    """An API server whose ingress takes `ingress_s` of CPU per request (many engine steps) and whose output path
    costs `output_scale` x the vLLM preset's."""
    out = {k: v * output_scale for k, v in {"c_step_s": 1.0e-4, "c_token_out_s": 1.0e-5, "c_chunk_s": 3.0e-5,
                                          "c_finish_s": 3.0e-4}.items()}
    coefficients = {"base": "vllm", "coefficients": {"c_req_s": ingress_s, "c_chat_s": ingress_s / 2,
                                                     "latency_in_s": latency_in_s, **out}}
    return FrontendConfig("api_server", endpoint, coefficients, api_server_count=count, ingress=ingress)


@settings(max_examples=30, deadline=None)
@given(count=st.integers(1, 3), ingress=st.sampled_from(["shared", "in_order"]),
       endpoint=st.sampled_from(["chat", "completions"]), ingress_s=st.sampled_from([1e-4, 2e-3, 1.5e-2]),
       output_scale=st.sampled_from([0.0, 1.0, 30.0]), latency_in_s=st.sampled_from([0.0, 1e-12, 1e-3, 1e-2]),
       burst=st.integers(1, 6), rate=st.sampled_from([50.0, 400.0, 3000.0]), running=st.integers(1, 8),
       out_hi=st.integers(20, 300), timeout_s=st.sampled_from([None, None, 0.2]), seed=st.integers(0, 500))
def test_windows_during_ingress_equal_the_run_without_them(count, ingress, endpoint, ingress_s, output_scale,
                                                           latency_in_s, burst, rate, running, out_hi, timeout_s,
                                                           seed):
    """A batch decoding while bursts of requests reach a busy front end (ingress of a few steps to hundreds,
    shared or in order, one to three API servers, output work from none to heavy, hand-over latencies down to
    0 - no deferral then): windows run on while an ingress is on the CPU, their outputs handed to the front end
    at its wake-ups and arrivals, and the run is the same (deliveries, CPU time, completions, every row)."""
    engine_kw = dict(enable_prefix_caching=True, block_size=16, num_gpu_blocks=800, max_num_seqs=running + burst,
                     max_model_len=512, async_scheduling=True)
    extra = {"timeout_s": timeout_s} if timeout_s is not None else {}
    workload = {"requests": running + 3 * burst, "seed": seed,
                "prompt_tokens": {"type": "uniform", "low": 1, "high": 60},
                "output_tokens": {"type": "uniform", "low": 1, "high": out_hi},
                "arrival": {"type": "stages", "stages": [{"rate": 1e6, "duration_s": running / 1e6},
                                                         {"rate": rate, "duration_s": 3 * burst / rate}]}, **extra}
    frontend = _busy_frontend(count, ingress, endpoint, ingress_s, output_scale, latency_in_s)
    num_windows, steps = _assert_same(engine_kw, workload, frontend)
    assert steps >= num_windows


@pytest.mark.parametrize("ingress, count", [("shared", 1), ("in_order", 1), ("shared", 2)])
def test_windows_run_on_while_an_ingress_is_on_the_cpu(ingress, count):
    """A steady batch while requests keep the front end's CPU busy with their ingress (60 ms each, arriving
    every ~50 ms): nearly all steps still run in windows - the front end gets their outputs at its own
    wake-ups - and the run is the same."""
    engine_kw = dict(enable_prefix_caching=True, block_size=64, num_gpu_blocks=900, max_num_seqs=24,
                     max_model_len=1024, async_scheduling=True)
    workload = {"requests": 8 + 16, "seed": 3, "prompt_tokens": 40, "output_tokens": 500,
                "arrival": {"type": "stages", "stages": [{"rate": 1e6, "duration_s": 8 / 1e6},
                                                         {"rate": 20.0, "duration_s": 16 / 20.0}]}}
    frontend = _busy_frontend(count, ingress, "chat", 4e-2, 1.0, 1e-2)
    num_windows, in_windows, steps = _assert_same_steps(engine_kw, workload, frontend)
    assert num_windows > 0
    # (an ingress is on the CPU about half of the time: refusing windows then left 46-69% of the steps in them)
    assert in_windows > 0.9 * steps


@settings(max_examples=25, deadline=None)
@given(async_scheduling=st.booleans(), caching=st.booleans(), block_size=st.sampled_from([1, 2, 4, 8]),
       max_num_seqs=st.integers(2, 10), rate=st.sampled_from([None, 100.0, 400.0]), requests=st.integers(3, 12),
       out_hi=st.integers(40, 150), window=st.sampled_from([None, 5, 9, 24]), extra_blocks=st.sampled_from([0, 8, 60]),
       shared=st.booleans(), frontend=st.sampled_from(["offline", "api_server"]), seed=st.integers(0, 500))
def test_windows_across_member_kv_events_equal_the_run_without_them(async_scheduling, caching, block_size,
                                                                    max_num_seqs, rate, requests, out_hi, window,
                                                                    extra_blocks, shared, frontend, seed):
    """Member KV events every few steps (blocks of 1 to 8 tokens: a new block, a full block registered, a
    sliding window's drop - of blocks shared by a prefix group too), pools with a few blocks to spare
    (the windows' KV check) or none (preemption): windows run across the events done in place, and the run
    is the same."""
    if not async_scheduling:
        frontend = "offline"  # (sync scheduling with a front end takes no windows)
    engine_kw = small_engine(window, block_size, 200, extra_blocks, enable_prefix_caching=caching,
                           max_num_seqs=max_num_seqs, async_scheduling=async_scheduling)
    workload = small_workload(requests, seed, out_hi, 30, rate, shared, max_output_tokens=150)
    with window_model(window):
        num_windows, steps = _assert_same(engine_kw, workload, frontend)
    assert steps >= num_windows


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("block_size, window", [(4, None), (16, None), (4, 9)])
def test_windows_span_member_kv_events(async_scheduling, block_size, window):
    """A steady batch of 8 whose members cross a block boundary every few steps (blocks of 4 tokens: with 8
    members, a KV event - a new block, a full block registered, a window's drop - almost every step): its
    windows run across the events done in place (its ~600 steps in a few windows, each up to
    `WINDOW_MAX_STEPS`), and the run is the same."""
    groups = 1 if window is None else NUM_KV_CACHE_GROUPS["gpt-oss-like"]
    engine_kw = dict(enable_prefix_caching=True, block_size=block_size, num_gpu_blocks=groups * 8 * 700 // block_size,
                     max_num_seqs=8, max_model_len=1024, async_scheduling=async_scheduling)
    workload = {"requests": 8, "seed": 2, "prompt_tokens": 40, "output_tokens": 600, "arrival": {"type": "offline"}}
    with window_model(window):
        num_windows, steps = _assert_same(engine_kw, workload, "offline")
    assert steps > 400
    assert steps / num_windows > 100  # (windows ended by every member event: a few steps each)


BASE = {**CLUSTER_BASE, "name": "windows"}
ROUTERS = CLUSTER_ROUTERS


def _without_windows(*args, **kwargs) -> Simulation:
    """An engine simulation with step windows off (a factory: no subclass of the compiled Simulation)."""
    return Simulation(*args, **{**kwargs, "step_windows": False})


def _cluster(exp, windows: bool, monkeypatch, scrapes: Optional[list] = None):
    """`scrapes`: gets (time, instance, counts) of every read of an instance's counts (the router's scrapes)."""
    with monkeypatch.context() as patch:
        if not windows:
            patch.setattr(cluster_module, "Simulation", _without_windows)
        if scrapes is not None:
            counts = cluster_module._Instance.counts

            def recorded(inst):
                out = counts(inst)
                scrapes.append((inst.env.now, inst.name, out))
                return out
            patch.setattr(cluster_module._Instance, "counts", recorded)
        sim, runs, _, _ = simulate_cluster(exp)
    return sim, runs


def _decisions(sim) -> list[str]:
    return [repr((d.request_id, d.t, d.pick, d.rank, d.candidates, d.scores)) for d in sim.result.decisions]


def assert_same_cluster(exp, monkeypatch) -> tuple[int, int]:
    """A cluster run with windows equals the one without: decisions, completions, every engine's rows,
    ITLs and deliveries; returns (windows, steps in them) over its engines."""
    off_scrapes: list = []
    on_scrapes: list = []
    off, off_runs = _cluster(exp, False, monkeypatch, off_scrapes)
    on, on_runs = _cluster(exp, True, monkeypatch, on_scrapes)
    assert off_scrapes == on_scrapes  # (a window's KV events before a scrape applied first: `Simulation.catch_up`)
    # (the scraper ran, more than its first tick, where the router reads what it scrapes: `scrapes_needed`)
    assert len(on_scrapes) > len(on.instances) if on.scrapes_needed() else not on_scrapes
    assert _decisions(off) == _decisions(on)
    assert (off.result.completion_s, off.result.rejected, off.result.aborted_s, off.result.end_time_s) \
        == (on.result.completion_s, on.result.rejected, on.result.aborted_s, on.result.end_time_s)
    assert_same_engine_runs(off_runs, on_runs)
    stats = [s.window_stats for _, _, s in on.simulations()]
    assert all(s == (0, 0) for _, _, s in ((None, None, s.window_stats) for _, _, s in off.simulations()))
    return sum(w for w, _ in stats), sum(n for _, n in stats)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(router=st.sampled_from(ROUTERS), instances=st.integers(2, 4), rate=st.sampled_from([20.0, 80.0, 400.0]),
       async_scheduling=st.booleans(), frontend=st.sampled_from(["offline", "api_server"]),
       window=st.sampled_from([None, 24, 40]), scrape_s=st.sampled_from([0.005, 0.05]),
       stages=st.booleans(), seed=st.integers(0, 50))
def test_a_cluster_with_windows_equals_its_run_without(router, instances, rate, async_scheduling, frontend, window,
                                                      scrape_s, stages, seed, monkeypatch):
    """Clusters behind routers reading scraped counts (waiting and running constant inside a window; the KV
    usage changed by member KV events done in place: a scrape sees it as of its time, `Simulation.catch_up`),
    Poisson or stage-ladder arrivals, sync and async engines, hybrid (sliding-window) models; blocks of 16
    tokens, the smallest the YAML takes (with up to 8 members, a KV event every few steps)."""
    raw = copy.deepcopy(BASE)
    raw["seed"] = seed
    raw["engine"]["async_scheduling"] = async_scheduling
    raw["workload"]["arrival"] = ({"type": "stages", "stages": [{"rate": rate, "duration_s": 10 / rate},
                                                                 {"rate": rate, "duration_s": 20 / rate}]}
                                  if stages else {"type": "poisson", "rate": rate})
    raw["frontend"] = {"type": frontend}
    raw["cluster"] = {"instances": [{"name": "r", "count": instances}],
                      "router": {**router, "scrape_interval_s": scrape_s}}
    exp = validate_config(raw)
    with window_model(window):
        num_windows, _ = assert_same_cluster(exp, monkeypatch)
    if not async_scheduling and frontend == "api_server":
        assert num_windows == 0
