"""The Python API and the server show the twin's predictions on the sim backend, clearly named:
`RequestOutput.metrics.predicted_*` / `sim_*`, `get_stats()["sim_time_s"]`, `servetwin:predicted_*`
histograms on /metrics."""
from __future__ import annotations

import httpx
import pytest

from servetwin.core.engine.llm import LLM
from servetwin.core.engine.metrics import parse_prometheus_text, sample
from servetwin.core.sampling_params import SamplingParams
from frontend_utils import ServerProcess, backend_available

pytestmark = pytest.mark.skipif(not backend_available("sim"), reason="sim backend not importable")

SIM = dict(model="llama-3.1-8b", backend="sim", hardware="h100-sxm")
PROMPTS = [[100 + i] + [5] * 999 for i in range(8)]  # 8 x 1000 tokens, no shared prefix blocks


def _simulated_engine_ttfts(max_tokens: int) -> list[float]:
    """The same prompts through the simulator itself (servetwin.sim.engine, offline front end)."""
    from servetwin.core.engine.engine_args import EngineArgs
    from servetwin.core.engine.engine_factory import create_engine_core
    from servetwin.sim.arrivals import Offline
    from servetwin.sim.engine import simulate
    from servetwin.sim.workload import WorkloadRequest

    engine, _ = create_engine_core(EngineArgs.from_kwargs(**SIM))
    reqs = [WorkloadRequest(f"r{i}", 0.0, p, max_tokens) for i, p in enumerate(PROMPTS)]
    rows = simulate(engine, reqs, Offline()).recorder.frames()["requests"]
    return rows.sort_values("request_id").engine_ttft_s.tolist()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_llm_generate_reports_predicted_times_from_the_cost_model(multiprocess):
    with LLM(**SIM, multiprocess=multiprocess) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
        stats = llm.get_stats()
        again = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))[0].metrics
    expected = _simulated_engine_ttfts(16)
    got = [o.metrics.predicted_ttft_s for o in outs]
    assert got == pytest.approx(expected, rel=1e-9)
    # 8 x 1000 prompt tokens on an 8B model: milliseconds to a few hundred ms, whatever the calibration
    assert all(1e-3 < t < 1.0 for t in got)
    for o in outs:
        m = o.metrics
        assert m.sim_arrival_time == 0.0 and m.sim_first_token_time == m.predicted_ttft_s
        assert m.predicted_e2e_s == pytest.approx(m.sim_finished_time) and m.predicted_e2e_s > m.predicted_ttft_s
        assert m.predicted_tpot_s == pytest.approx((m.sim_finished_time - m.sim_first_token_time) / 15)
    # the engine's simulated clock: the whole batch, then the next call starts where it ended
    assert stats["sim_time_s"] == pytest.approx(max(o.metrics.sim_finished_time for o in outs))
    assert stats["sim_busy_s"] == pytest.approx(stats["sim_time_s"])
    assert again.sim_arrival_time == pytest.approx(stats["sim_time_s"])
    assert 0 < again.predicted_ttft_s < got[0]  # a cached prefix: one block of prefill


def test_other_backends_have_no_predictions():
    with LLM(model="fake-model", backend="fake", multiprocess=False) as llm:
        m = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].metrics
        assert m.predicted_ttft_s is None and m.sim_first_token_time is None
        assert llm.get_stats()["sim_time_s"] == 0.0


def test_server_metrics_carry_predicted_latencies():
    srv = ServerProcess("--model", "llama-3.1-8b", "--backend", "sim", "--hardware", "h100-sxm", "--no-pace")
    try:
        for i in range(2):
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"model": "llama-3.1-8b", "prompt": PROMPTS[i], "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200, r.text
        values = parse_prometheus_text(httpx.get(srv.url + "/metrics", timeout=10).text)
    finally:
        srv.stop()
    assert sample(values, "servetwin:predicted_time_to_first_token_seconds_count") == 2
    assert sample(values, "servetwin:predicted_e2e_request_latency_seconds_count") == 2
    assert sample(values, "servetwin:predicted_inter_token_latency_seconds_count") == 8
    ttft_sum = sample(values, "servetwin:predicted_time_to_first_token_seconds_sum")
    assert 2e-3 < ttft_sum < 2.0
    assert sample(values, "servetwin:simulated_time_seconds") > 0


def test_the_offline_llm_takes_vllms_batch_defaults_for_the_simulated_gpu():
    from servetwin.core.engine.engine_args import apply_batch_defaults  # noqa: PLC0415

    llm = LLM("llama-3.1-8b", backend="sim", hardware="a100-80g", multiprocess=False)
    assert (llm.args.max_num_batched_tokens, llm.args.max_num_seqs) == (8192, 256)  # vLLM's LLM on an A100
    llm = LLM("llama-3.1-8b", backend="sim", hardware="h100-sxm", max_num_seqs=32, multiprocess=False)
    assert (llm.args.max_num_batched_tokens, llm.args.max_num_seqs) == (16384, 32)
    # backends without device defaults, CPU hardware, and given values are left alone
    assert apply_batch_defaults({"backend": "fake"}, api_server=True) == {"backend": "fake"}
    assert apply_batch_defaults({"backend": "sim", "hardware": "cpu"}, api_server=True) == {"backend": "sim", "hardware": "cpu"}
    given = {"backend": "sim", "max_num_seqs": 8, "max_num_batched_tokens": 64}
    assert apply_batch_defaults(given, api_server=True) == given
    assert apply_batch_defaults({"backend": "sim", "enable_chunked_prefill": False}, api_server=True) == {
        "backend": "sim", "enable_chunked_prefill": False, "max_num_seqs": 1024}  # budget >= max_model_len
