"""benchmarks/fit_frontend.py's grid finds the front-end point that produced the figures (two tiny
API-server cases whose 'published' figures are the sim's own at a known `latency_in_s`), skips
offline cases, and refuses held-out directories."""
from __future__ import annotations

import pytest

from inttest_helpers import load_benchmark, publish, write_case_dir
from servetwin.experiments.validate.published import validate_cases

CASE = """\
name: {name}
seed: 0
model: llama-3.1-8b
hardware: a100-80g
backends: [sim]
frontend: {frontend}
engine: {{max_num_seqs: 4, max_num_batched_tokens: 2048, max_model_len: 4096, gpu_memory_utilization: 0.9}}
workload: {{requests: 4, prompt_tokens: {prompt}, output_tokens: 4, arrival: {{type: closed_loop, clients: 2}}, seed: 0}}
output: {{step_requests: false, plots: false}}
"""
TRUE_LATENCY = 0.02


def _case_dir(tmp_path):
    api = "{type: api_server, endpoint: completions}"
    cases = {"short": (api, 100), "long": (api, 800), "offline": ("{type: offline}", 100)}
    write_case_dir(tmp_path, {name: CASE.format(name=name, frontend=frontend, prompt=prompt)
                              for name, (frontend, prompt) in cases.items()}, "ttft_mean")
    truth = validate_cases(tmp_path, overrides=[
        f"frontend.coefficients={{base: vllm, coefficients: {{latency_in_s: {TRUE_LATENCY}}}}}"])
    publish(tmp_path, truth, "ttft_mean", "the sim at latency_in_s 0.02")
    return tmp_path


def test_grid_finds_the_generating_latency_and_skips_offline_cases(tmp_path, capsys):
    fit = load_benchmark("fit_frontend")
    case_dir = _case_dir(tmp_path)
    assert fit.api_server_cases(str(case_dir)) == ["long", "short"]
    assert fit.main([str(case_dir), "--grid", "latency_in_s=0.005,0.02"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "score 0.0000  latency_in_s=0.02"
    assert any(line.startswith("score ") and "latency_in_s=0.005" in line and "0.0000" not in line for line in lines)


def test_refuses_held_out_cases_and_unknown_coefficients(tmp_path):
    fit = load_benchmark("fit_frontend")
    with pytest.raises(SystemExit, match="held-out"):
        fit.main([str(tmp_path / "benchmarks" / "published_cases"), "--grid", "latency_in_s=0.01"])
    with pytest.raises(SystemExit, match="c_nope"):
        fit.main([str(tmp_path), "--grid", "c_nope=1"])
