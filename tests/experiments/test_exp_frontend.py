"""`frontend:` in an experiment: the API-server front end in `servetwin run`, its summary keys and report."""
import json

import pandas as pd
import pytest
from exptest_helpers import tiny, write_yaml

from servetwin.experiments.cli import main
from servetwin.experiments.config.schema import ConfigError, validate_config

ENGINE_KEYS = ("engine_ttft_s", "engine_tpot_s", "engine_itl_s", "engine_e2e_s", "frontend_in_s")
FE = {"type": "api_server", "endpoint": "chat",
      "coefficients": {"coefficients": {"c_req_s": 0.01, "c_chat_s": 0.002, "c_chunk_s": 0.0005,
                                        "latency_in_s": 0.003}}}


def _run(tmp_path, cfg):
    out = tmp_path / "out"
    assert main(["run", str(write_yaml(tmp_path / "c.yaml", cfg)), "-o", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())["backends"]["sim"]
    return summary, pd.read_parquet(out / "sim/requests.parquet"), (out / "report.md").read_text()


def test_api_server_front_end_reports_client_and_engine_boundaries(tmp_path):
    s, reqs, report = _run(tmp_path, tiny(frontend=FE))
    for key in ENGINE_KEYS:
        if key != "engine_itl_s":
            assert s[key]["count"] == 6
    # chat: every request's client ITLs start with the role chunk's ~0 gap; tokens that reach the
    # client in one chunk give one ITL (the client's count), the engine has one per token
    assert s["itl_s"]["count"] >= 6 and s["itl_s"]["p50"] >= 0
    assert s["engine_itl_s"]["count"] == int((reqs.output_tokens - 1).sum())
    # all 6 requests sent at t = 0 share the front-end CPU: 6 x 12 ms of ingress before the engine
    assert reqs.engine_arrival_s.tolist() == pytest.approx([6 * 0.012 + 0.003] * 6)
    assert s["frontend_in_s"]["mean"] == pytest.approx(6 * 0.012 + 0.003)
    assert s["ttft_s"]["mean"] > s["engine_ttft_s"]["mean"] + 0.075
    assert s["frontend"]["type"] == "api_server" and s["frontend"]["endpoint"] == "chat"
    assert s["frontend"]["cpu_busy_s"] >= 6 * 0.012
    assert s["duration_s"] == pytest.approx(float(reqs.client_finish_s.max()))
    assert s["duration_s"] > s["engine_duration_s"]
    assert "front end = API server (chat endpoint" in report and "engine TTFT mean" in report


def test_offline_front_end_keeps_boundaries_equal(tmp_path):
    s, reqs, report = _run(tmp_path, tiny(frontend={"type": "offline"}))
    assert s["ttft_s"] == s["engine_ttft_s"] and s["e2e_s"] == s["engine_e2e_s"]
    assert s["duration_s"] == s["engine_duration_s"] and s["frontend"] == {"type": "offline"}
    assert "front end = offline" in report


def test_default_front_end_follows_the_arrivals():
    assert validate_config(tiny()).frontend.type == "offline"
    online = validate_config(tiny(workload__arrival={"type": "poisson", "rate": 10.0}))
    assert (online.frontend.type, online.frontend.endpoint) == ("api_server", "completions")


@pytest.mark.parametrize("fe, field", [({"type": "grpc"}, "frontend.type"),
                                       ({"type": "api_server", "endpont": "chat"}, "frontend.endpont"),
                                       ("chat", "frontend")])
def test_bad_frontend_names_the_field(fe, field):
    with pytest.raises(ConfigError) as e:
        validate_config(tiny(frontend=fe))
    assert str(e.value).startswith(field), str(e.value)
