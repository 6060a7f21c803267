"""The API-server front end as its own process: processor sharing, ingress queueing, delivery times."""
import math

import pytest

from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.sim.arrivals import ClosedLoop, Offline, Poisson
from servetwin.sim.coefficients import CostCoefficients
from servetwin.sim.cost_model import CostModel
from servetwin.sim.engine import Simulation
from servetwin.sim.executor import SimExecutor
from servetwin.sim.frontend import (FrontendConfig, FrontendSpec, FrontendCoefficients, SharedCPU, _Job,
                                    default_frontend, load_frontend_spec, parse_frontend)
from servetwin.sim.workload import WorkloadRequest, build_workload

STEP_S = 0.01
FIXED_STEPS = CostCoefficients(c_step=STEP_S, c_linear=0.0, c_attn_prefill=0.0, c_attn_decode=0.0,
                               c_lm_head=0.0, c_comm=0.0)


def _engine(async_scheduling=False, max_num_seqs=64):
    cm = CostModel("tiny-llama", "cpu", coefficients=FIXED_STEPS)
    return EngineCore(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=max_num_seqs, max_model_len=512,
                                      async_scheduling=async_scheduling),
                      CacheConfig(num_gpu_blocks=2000, block_size=16), SimExecutor(cost_model=cm))


def _api(**coeffs) -> FrontendConfig:
    return FrontendConfig("api_server", "completions", FrontendSpec("test", FrontendCoefficients(**coeffs)))


def _reqs(n, prompt=8, out=3, t=0.0):
    return [WorkloadRequest(f"r{i}", t, [1 + i % 200] + list(range(prompt - 1)), out) for i in range(n)]


def _run(reqs, frontend, arrival=None, **kw):
    sim = Simulation(_engine(kw.pop("async_scheduling", False)), reqs, arrival or Offline(), frontend=frontend,
                     **kw)
    sim.run()
    return sim, sim.recorder.frames()["requests"].set_index("request_id")


# -- the shared CPU ---------------------------------------------------------------------------------
def test_processor_sharing_equal_jobs_finish_together_and_weights_share():
    cpu, done = SharedCPU(), {}
    for name, work, weight in (("a", 1.0, 1.0), ("b", 1.0, 1.0), ("c", 3.0, 2.0)):
        cpu.add(0.0, _Job(work, weight, lambda t, n=name: done.setdefault(n, t)))
    cpu.advance(100.0)
    # total weight 4: a and b get 1/4 each, c gets 1/2 -> a, b done at 4 (c has done 2 of 3),
    # then c alone finishes its last unit at 5
    assert done["a"] == pytest.approx(4.0) and done["b"] == pytest.approx(4.0)
    assert done["c"] == pytest.approx(5.0)
    assert cpu.busy_s == pytest.approx(5.0)


def test_processor_sharing_late_arrival_slows_the_running_job():
    cpu, done = SharedCPU(), {}
    cpu.add(0.0, _Job(2.0, 1.0, lambda t: done.setdefault("a", t)))
    cpu.add(1.0, _Job(0.5, 1.0, lambda t: done.setdefault("b", t)))
    assert cpu.next_finish() == pytest.approx(2.0)  # b: 0.5 of work at half speed
    cpu.advance(10.0)
    assert done["b"] == pytest.approx(2.0) and done["a"] == pytest.approx(2.5)


# -- in the simulation --------------------------------------------------------------------------------
def test_single_request_pays_ingress_latency_and_delivery_exactly():
    c = dict(c_req_s=0.004, c_prompt_token_s=1e-4, c_hop_s=0.001, latency_in_s=0.02,
             c_step_s=0.0005, c_chunk_s=0.0002, c_finish_s=0.0003, latency_out_s=0.001)
    _, r = _run(_reqs(1, prompt=10, out=3), _api(**c))
    row = r.loc["r0"]
    ingress = 0.004 + 10 * 1e-4 + 0.001
    assert row.engine_arrival_s == pytest.approx(ingress + 0.02)
    assert row.frontend_in_s == pytest.approx(ingress + 0.02)
    assert row.engine_ttft_s == pytest.approx(STEP_S)  # one prefill step
    first_out = 0.0005 + 0.0002
    assert row.ttft_s == pytest.approx(ingress + 0.02 + STEP_S + first_out + 0.001)
    last_out = 0.0005 + 0.0002 + 0.0003  # the final chunk carries the finish work
    assert row.client_finish_s == pytest.approx(row.finish_s + last_out + 0.001)
    assert row.e2e_s == pytest.approx(row.client_finish_s)
    assert row.engine_e2e_s == pytest.approx(3 * STEP_S)


def test_burst_is_admitted_together_after_n_times_ingress():
    n, work = 50, 0.01
    sim, r = _run(_reqs(n), _api(c_req_s=work))
    # processor sharing: equal requests sent at t = 0 all leave the front end at n x work
    assert r.engine_arrival_s.tolist() == pytest.approx([n * work] * n)
    assert (r.ttft_s - r.engine_ttft_s).min() >= n * work - 1e-9
    steps = sim.recorder.frames()["steps"]
    assert steps.t_start_s.min() == pytest.approx(n * work)
    assert sim.frontend.cpu.busy_s == pytest.approx(n * work)


@pytest.mark.parametrize("servers", [1, 2])
def test_in_order_ingress_admits_a_burst_one_request_after_another(servers):
    n, work = 40, 0.01
    fe = _api(c_req_s=work)
    in_order = FrontendConfig(fe.type, fe.endpoint, fe.coefficients, api_server_count=servers, ingress="in_order")
    sim, r = _run(_reqs(n), in_order)
    # each server's requests leave in the order sent, one ingress apart: k x work for its k-th request
    expected = sorted([k * work for k in range(1, n // servers + 1)] * servers)
    assert sorted(r.engine_arrival_s.tolist()) == pytest.approx(expected)
    order = r.loc[[f"r{i}" for i in range(0, n, servers)]].engine_arrival_s.tolist()
    assert order == sorted(order)
    # the same CPU work as processor sharing, and the last request leaves at the same time
    assert sum(c.busy_s for c in sim.frontend.cpus) == pytest.approx(n * work)
    assert sim.frontend.summary(1.0).get("endpoint") == "completions" and in_order.describe()["ingress"] == "in_order"


def test_in_order_ingress_shares_the_cpu_with_the_output_path_and_keeps_its_order():
    fe = _api(c_req_s=0.01, c_token_out_s=0.002, c_chunk_s=0.003)
    in_order = FrontendConfig(fe.type, fe.endpoint, fe.coefficients, ingress="in_order")
    sim, r = _run(_reqs(30, out=6), in_order)
    arrivals = r.loc[[f"r{i}" for i in range(30)]].engine_arrival_s.to_numpy()
    assert (arrivals[1:] > arrivals[:-1]).all()  # strictly in the order sent
    # output work competes: some ingress took longer than its own work
    assert (arrivals[1:] - arrivals[:-1]).max() > 0.01 + 1e-9
    assert (r.finish_s.notna()).all()


def test_front_end_sets_the_pace_under_a_stream_of_cheap_requests():
    # 200 requests at 400/s, each needing 5 ms of front-end CPU: the front end serves at most 200/s
    reqs = _reqs(200, out=1)
    for i, q in enumerate(reqs):
        q.arrival_s = i / 400.0
    _, r = _run(reqs, _api(c_req_s=0.005))
    last_in = r.engine_arrival_s.max()
    assert last_in >= 200 * 0.005 - 1e-9  # the CPU did 1 s of ingress work
    assert r.frontend_in_s.iloc[-1] > r.frontend_in_s.iloc[0]  # queueing grows


def test_closed_loop_client_waits_for_the_last_chunk():
    reqs = _reqs(6, out=2)
    c = dict(c_req_s=0.002, c_chunk_s=0.001, latency_out_s=0.005)
    _, r = _run(reqs, _api(**c), arrival=ClosedLoop(clients=1))
    rows = r.sort_values("arrival_s")
    for prev, nxt in zip(rows.itertuples(), list(rows.itertuples())[1:]):
        assert nxt.arrival_s == pytest.approx(prev.client_finish_s)
        assert prev.client_finish_s > prev.finish_s


def test_no_front_end_keeps_both_boundaries_equal():
    _, r = _run(_reqs(5, out=4), None)
    assert (r.ttft_s == r.engine_ttft_s).all() and (r.e2e_s == r.engine_e2e_s).all()
    assert (r.frontend_in_s == 0).all() and (r.client_finish_s == r.finish_s).all()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_client_times_equal_with_and_without_the_decode_shortcuts(async_scheduling):
    """Fast-forwarded (sync) and implicit decode steps deliver exactly what step-by-step steps do."""
    spec, reqs = build_workload({"requests": 30, "seed": 3, "prompt_tokens": {"type": "uniform", "low": 4, "high": 60},
                                 "output_tokens": {"type": "uniform", "low": 1, "high": 40},
                                 "arrival": {"type": "poisson", "rate": 200.0}}, vocab_size=1000)
    fe = _api(c_req_s=0.003, c_prompt_token_s=2e-5, c_step_s=2e-4, c_token_out_s=4e-4, c_chunk_s=3e-4, c_finish_s=1e-4,
              latency_in_s=0.001, latency_out_s=0.0005)
    runs = []
    for kw in (dict(record_step_requests=True, fast_forward=False, lazy_decode=False),
               dict(record_step_requests=True, fast_forward=True, lazy_decode=False),
               dict(record_step_requests=False, lazy_decode=True)):
        sim, r = _run([WorkloadRequest(q.request_id, q.arrival_s, list(q.prompt_token_ids), q.max_tokens)
                       for q in reqs], fe, arrival=spec.arrival, async_scheduling=async_scheduling, **kw)
        runs.append((r.sort_index(), sorted(sim.recorder.itls())))
    base, base_itl = runs[0]
    for r, itl in runs[1:]:
        for col in ("ttft_s", "e2e_s", "client_finish_s", "engine_ttft_s", "frontend_in_s"):
            assert r[col].tolist() == pytest.approx(base[col].tolist(), rel=1e-9, abs=1e-12), col
        assert itl == pytest.approx(base_itl, rel=1e-9, abs=1e-12)


def test_every_token_is_delivered_in_order():
    spec, reqs = build_workload({"requests": 40, "seed": 1, "prompt_tokens": 32, "output_tokens": 20,
                                 "arrival": {"type": "poisson", "rate": 500.0}}, vocab_size=1000)
    sim, r = _run(reqs, _api(c_req_s=0.002, c_chunk_s=0.002, c_step_s=0.001), arrival=spec.arrival,
                  record_step_requests=False)
    assert r.client_first_token_s.notna().all() and r.client_finish_s.notna().all()
    assert (r.client_first_token_s >= r.first_token_s).all() and (r.client_finish_s >= r.finish_s).all()
    assert min(sim.recorder.itls()) > 0  # one output handler: deliveries strictly ordered
    assert sim.result.end_time_s == pytest.approx(r.client_finish_s.max())


# -- config ---------------------------------------------------------------------------------------------
def test_parse_frontend_and_defaults():
    assert parse_frontend({"type": "offline"}) == FrontendConfig("offline")
    cfg = parse_frontend({"type": "api_server", "endpoint": "chat"})
    assert (cfg.type, cfg.endpoint, cfg.coefficients) == ("api_server", "chat", None)
    assert cfg.resolved("cuda").coefficients.name == "vllm"
    assert cfg.resolved("cpu").coefficients.name == "servetwin"
    assert default_frontend(online=True).type == "api_server"
    assert default_frontend(online=False).type == "offline"
    spec = load_frontend_spec({"base": "vllm", "coefficients": {"c_req_s": 0.5}})
    assert spec.coefficients.c_req_s == 0.5
    assert spec.coefficients.c_chat_s == load_frontend_spec("vllm").coefficients.c_chat_s


@pytest.mark.parametrize("cfg, field", [
    ({"type": "http"}, "frontend.type"),
    ({"type": "api_server", "endpoint": "embeddings"}, "frontend.endpoint"),
    ({"type": "api_server", "port": 80}, "frontend.port"),
    ({"type": "offline", "endpoint": "chat"}, "frontend.endpoint"),
    ({"type": "api_server", "coefficients": {"coefficients": {"c_req_s": -1}}}, "frontend.coefficients.coefficients.c_req_s"),
    ({"type": "api_server", "coefficients": {"coefficients": {"c_reqs": 1}}}, "frontend.coefficients.coefficients.c_reqs"),
    ({"type": "api_server", "coefficients": "no-such-preset"}, "frontend.coefficients"),
    ({"type": "api_server", "ingress": "lifo"}, "frontend.ingress"),
])
def test_bad_frontend_config_names_the_field(cfg, field):
    with pytest.raises(ValueError) as e:
        parse_frontend(cfg)
    assert str(e.value).startswith(field), str(e.value)


def test_coefficients_are_finite_non_negative():
    with pytest.raises(ValueError, match="c_chunk_s"):
        FrontendCoefficients(c_chunk_s=math.inf)


def test_chat_first_token_arrives_as_role_and_content_chunks():
    """vLLM's chat stream sends the role chunk, then the first token's content: `vllm bench serve` takes
    the role chunk as the first token and records a ~0 gap before the content (ITL mean = 3/4 TPOT for
    4-token answers in the published runs)."""
    reqs = _reqs(1, out=4)
    chat = FrontendConfig("api_server", "chat", FrontendSpec("t", FrontendCoefficients(c_req_s=0.001)))
    sim, _ = _run([WorkloadRequest(r.request_id, 0.0, r.prompt_token_ids, 4) for r in reqs], chat)
    itl = sim.recorder.itls()
    assert len(itl) == 4 and itl[0] == 0.0 and itl[1:] == pytest.approx([STEP_S] * 3)
    sim, _ = _run(_reqs(1, out=4), _api(c_req_s=0.001))
    assert sim.recorder.itls() == pytest.approx([STEP_S] * 3)  # completions: one event per token


def test_a_front_end_behind_sends_the_waiting_steps_as_one_chunk_per_request():
    """Output work per step (40 requests x 0.4 ms = 16 ms) exceeds the 10 ms steps: the waiting steps
    go out together (one chunk per request per batch), so the backlog stays bounded instead of growing
    with every step, and every token is still delivered after it was computed."""
    reqs = _reqs(40, out=60)
    sim, r = _run(reqs, _api(c_chunk_s=4e-4, c_token_out_s=5e-5), record_step_requests=False)
    d = sim.frontend.deliveries
    assert sim.frontend.num_messages < len(d)  # batches of several steps
    lag = [d.client_time(t) - t for t in d._ends]
    assert max(lag) < 0.1 and (r.client_finish_s >= r.finish_s).all()
    engine_end = float(r.finish_s.max())
    assert sim.result.end_time_s - engine_end < 0.05


# -- several API-server processes (vLLM's --api-server-count) -----------------------------------------
def test_api_server_count_spreads_a_burst_over_its_servers():
    n, work = 40, 0.01
    fe = _api(c_req_s=work)
    two = FrontendConfig(fe.type, fe.endpoint, fe.coefficients, api_server_count=2)
    sim1, r1 = _run(_reqs(n), fe)
    sim2, r2 = _run(_reqs(n), two)
    # each of the two CPUs admits half of the burst: everything reaches the engine in half the time
    assert r1.engine_arrival_s.max() == pytest.approx(n * work)
    assert r2.engine_arrival_s.max() == pytest.approx(n * work / 2)
    s1, s2 = sim1.frontend.summary(1.0), sim2.frontend.summary(1.0)
    assert s2["api_server_count"] == 2 and s2["cpu_busy_s"] == pytest.approx(s1["cpu_busy_s"])
    assert s2["cpu_utilization"] == pytest.approx(s1["cpu_utilization"] / 2)  # the busiest server's share


def test_api_server_count_splits_output_work_and_delivers_when_the_last_part_is_done():
    c = dict(c_step_s=0.001, c_token_out_s=0.002, latency_out_s=0.0)
    fe = _api(**c)
    four = FrontendConfig(fe.type, fe.endpoint, fe.coefficients, api_server_count=4)
    _, r1 = _run(_reqs(8, out=4), fe)
    _, r4 = _run(_reqs(8, out=4), four)
    # one step's output: 1 message + 8 tokens on one CPU, or per server 1 message + 2 tokens in parallel
    assert (r1.ttft_s - r1.engine_ttft_s).min() == pytest.approx(0.001 + 8 * 0.002)
    assert (r4.ttft_s - r4.engine_ttft_s).min() == pytest.approx(0.001 + 2 * 0.002)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_api_server_count_must_be_a_positive_integer(bad):
    from servetwin.core.config_error import ConfigError

    with pytest.raises(ConfigError, match="frontend.api_server_count"):
        parse_frontend({"type": "api_server", "api_server_count": bad})


def _chunks(sim, request_id):
    """The client's chunks of one request: its tokens grouped by the time they reached the client."""
    times = [sim.frontend.deliveries.client_time(t) for t in sim.recorder.requests[request_id].token_times]
    assert None not in times and times == sorted(times)  # every token delivered, in order
    return [times.count(t) for t in dict.fromkeys(times)]


def test_chunks_carry_one_token_when_idle_and_merge_when_the_front_end_is_busy():
    """vLLM's per-request output collector merges the outputs its streaming task has not written yet
    (DELTA mode): an idle front end writes one chunk per token, a busy one fewer chunks of several
    tokens each (what a client then sees as ITL > TPOT)."""
    sim, _ = _run(_reqs(4, out=20), _api(c_chunk_s=1e-5, c_token_out_s=1e-6), record_step_requests=False)
    assert all(_chunks(sim, f"r{i}") == [1] * 20 for i in range(4))
    # 40 requests x (0.4 ms per chunk + 0.05 ms per token) = 18 ms of output work per 10 ms step
    sim, _ = _run(_reqs(40, out=60), _api(c_chunk_s=4e-4, c_token_out_s=5e-5), record_step_requests=False)
    chunks = [_chunks(sim, f"r{i}") for i in range(40)]
    assert all(sum(c) == 60 and len(c) < 60 and max(c) > 1 for c in chunks)
    assert len(sim.recorder.itls()) == sum(len(c) - 1 for c in chunks)  # the client records one ITL per chunk
