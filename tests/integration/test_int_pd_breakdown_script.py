"""benchmarks/published_cluster/pd_breakdown.py: the published figures' token accounting on made-up numbers
(exact arithmetic), and the simulated P/D path of a small run (tiny-llama, API-server front ends): every
request's parts, in path order, add up to its TTFT, none is negative, the KV read sits inside the KV wait,
and the busy shares are fractions (no figure of the real case is asserted)."""
from __future__ import annotations

import math

import pytest
import yaml
from inttest_helpers import load_benchmark

from servetwin.experiments.cli import main

PD_RUN = {
    "name": "pd_parts", "model": "tiny-llama", "hardware": "h100-sxm",
    "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 16, "max_model_len": 512},
    "frontend": {"type": "api_server", "endpoint": "completions"},
    "workload": {"requests": 40, "prompt_tokens": 200, "output_tokens": 12, "finish": "max_tokens",
                 "arrival": {"type": "poisson", "rate": 80}},
    "output": {"step_requests": False, "plots": False},
    "cluster": {"instances": [{"name": "prefill", "count": 2, "role": "prefill"},
                              {"name": "decode", "count": 1, "role": "decode",
                               "engine": {"tensor_parallel_size": 2}}],
                "router": {"type": "llm_d", "scorers": [{"type": "active-request"}]},
                "links": {"kv_transfer": "roce-400g"}},
}
TTFT_PARTS = ("prefill front end", "prefill queue", "prefill", "prefill response", "decode front end",
              "KV wait (read incl.)", "first decode step", "decode output")


def test_harness_view_is_the_reports_own_arithmetic():
    bench = load_benchmark("published_cluster/pd_breakdown")
    # 300 client-counted tokens per request for 100 decoded; a 2.99 s first->last chunk span
    pub = {"out_tok_s": 3000.0, "req_s": 10.0, "tpot_mean": 10.0, "itl_mean": 5.0, "e2e_mean": 4000.0,
           "ttft_mean": 1000.0}
    pct = {"ttft": {"p25": 1.0, "p75": 1.3}, "tpot": {"p25": 0.010, "p75": 0.011},
           "e2e": {"p25": 4.0, "p75": 4.5}}
    view = bench.harness_view(pub, pct, served=100, decode_instances=2, rate=10.0)
    assert view["client_tokens_per_request"] == pytest.approx(300.0)
    assert view["served_req_s_out_tok_s"] == pytest.approx(1000.0)
    assert view["tpot_served_ms"] == pytest.approx(10.0 * 299 / 99)
    assert view["e2e_minus_ttft_per_token_ms"] == pytest.approx(3000.0 / 99)
    assert view["chunk_tokens_per_request"] == pytest.approx(2990.0 / 5.0 + 1)
    iqr_span = 0.001 * 299
    assert view["ttft_span_correlation"] == pytest.approx((0.25 - 0.09 - iqr_span ** 2) / (2 * 0.3 * iqr_span))
    assert view["in_flight_per_decode_instance"] == pytest.approx(5.0 * 100 * 10.0 * 299 / 99 / 1e3)


def test_the_simulated_parts_add_up_to_each_requests_ttft(tmp_path):
    case = tmp_path / "pd_parts.yaml"
    case.write_text(yaml.safe_dump(PD_RUN))
    run = tmp_path / "run"
    assert main(["run", str(case), "-o", str(run), "--no-progress", "--no-plots"]) == 0
    bench = load_benchmark("published_cluster/pd_breakdown")
    parts = bench.path_parts(str(run))
    assert len(parts) == 40
    assert (parts[list(TTFT_PARTS)] >= -1e-12).all().all()
    assert (parts[list(TTFT_PARTS)].sum(axis=1) - parts["ttft"]).abs().max() < 1e-9
    assert (parts["KV read"] > 0).all() and (parts["KV read"] <= parts["KV wait (read incl.)"] + 1e-12).all()
    assert (parts["span per token"] > 0).all()
    for role in ("prefill", "decode"):
        share = bench.busy_fraction(str(run), role)
        assert 0.0 < share <= 1.0 and not math.isnan(share)
    rows = bench.path_rows(str(run))
    assert len([r for r in rows if r.startswith("| ") and not r.startswith("| part")]) == len(parts.columns)
