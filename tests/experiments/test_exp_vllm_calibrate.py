"""`servetwin calibrate --from-vllm`: coefficients recovered from profiler traces the simulator wrote with
known coefficients through a modelled API server (so the first matching, on the preset's step times, is
imperfect and the fit is iterated), in sample and leave one file out; the file then usable as `hardware:`; the
end-to-end search on a real bench file; missing inputs named."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from servetwin.core.config_error import ConfigError
from servetwin.experiments.cli import main
from servetwin.experiments.validate.preset_fit import FIT
from servetwin.experiments.config.schema import load_config
from servetwin.experiments.vllm_import.bench_case import ImportOptions
from servetwin.experiments.vllm_import.from_vllm import calibrate_from_vllm, nearest_preset
from servetwin.experiments.vllm_import.measured_steps import simulate
from servetwin.experiments.vllm_import.profiler_trace import write_profiler_trace
from servetwin.sim.hardware import load_hardware

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_bench"
TRUTH = {"c_step": 0.0021, "c_req": 1.5e-05, "c_token": 2.0e-07, "c_layer": 0.0, "c_layer_piecewise": 1.4e-05,
         "c_linear": 1.12, "c_elementwise": 0.0, "c_attn_prefill": 1.25, "c_attn_decode": 0.85, "c_lm_head": 1.1,
         "c_sampler": 0.0, "c_tp_step": 0.0}
EXPERIMENT = """\
name: rt{k}
seed: {k}
model: llama-3.1-8b
hardware: truth.yaml
backends: [sim]
frontend: {{type: api_server, endpoint: completions}}  # online: the schedule depends on the step times
engine: {{max_num_seqs: 32, max_num_batched_tokens: 1024}}
workload: {{requests: 30, prompt_tokens: {{type: uniform, low: {lo}, high: {hi}}},
            output_tokens: {{type: uniform, low: 4, high: {out}}}, arrival: {{type: offline}}}}
output: {{step_requests: true, plots: false}}
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    d = tmp_path_factory.mktemp("roundtrip")
    (d / "truth.yaml").write_text(yaml.safe_dump({"base": "h100-sxm", "coefficients": TRUTH}))
    files = []
    for k, (lo, hi, out) in enumerate(((20, 700, 60), (100, 1800, 30)), start=1):
        exp = d / f"exp{k}.yaml"
        exp.write_text(EXPERIMENT.format(k=k, lo=lo, hi=hi, out=out))
        frames, _ = simulate(load_config(exp))
        files.append((write_profiler_trace(frames["steps"], d / f"trace{k}.json.gz"), exp))
    return d, files


def test_round_trip_recovers_the_coefficients(measured, capsys):
    d, files = measured
    args = ["calibrate", "--from-vllm", *[str(t) for t, _ in files], "--hardware", "NVIDIA H100 80GB HBM3",
            "--no-trim", "-o", str(d / "fitted.yaml")]
    for _, exp in files:
        args += ["--experiment", str(exp)]
    assert main(args) == 0
    assert "leave_one_file_out" in capsys.readouterr().out
    doc = yaml.safe_load((d / "fitted.yaml").read_text())
    for term in ("c_step", "c_req", "c_linear", "c_attn_prefill", "c_attn_decode", "c_lm_head"):
        assert doc["coefficients"][term] == pytest.approx(TRUTH[term], rel=0.05), term
    prov = doc["provenance"]
    assert prov["base_preset"] == "h100-sxm" and len(prov["files"]["profiler_traces"]) == 2
    matched, total = prov["step_errors"]["matched_steps"].split(" ")[0].split("/")
    assert matched == total
    for part in ("in_sample", "leave_one_file_out"):
        assert all(e["median_abs_rel_err"] < 0.01 for e in prov["step_errors"][part].values())
    hw = load_hardware(str(d / "fitted.yaml"))
    assert hw.coefficients.c_step == pytest.approx(TRUTH["c_step"], rel=0.05)
    # the fitted file answers what-ifs: a run on it
    exp = d / "exp1.yaml"
    (d / "whatif.yaml").write_text(exp.read_text().replace("truth.yaml", "fitted.yaml").replace("rt1", "whatif"))
    assert main(["run", str(d / "whatif.yaml"), "-o", str(d / "whatif_run")]) == 0


def test_traces_need_the_run_and_the_gpu(measured, capsys):
    d, files = measured
    trace = str(files[0][0])
    assert main(["calibrate", "--from-vllm", trace, "--hardware", "h100-sxm", "-o", str(d / "x.yaml")]) == 2
    assert "--experiment: profiler traces name each step's composition" in capsys.readouterr().err
    assert main(["calibrate", "--from-vllm", trace, "--experiment", str(files[0][1]), "-o", str(d / "x.yaml")]) == 2
    assert "--hardware: the GPU the files were measured on is not in them" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="names no GPU"):
        nearest_preset("Hygon DCU K100")
    assert nearest_preset("NVIDIA A100-SXM4-80GB") == "a100-80g"
    assert main(["calibrate", "-o", str(d / "x.yaml")]) == 2  # the torch calibration still needs --model
    assert "--model: required" in capsys.readouterr().err


def test_bench_results_fit_end_to_end(tmp_path, monkeypatch):
    # the plumbing (a log's settings, provenance, the written file) on a one-parameter search of an OPT-125m
    # run modelled as Llama-8B, which no bound of 15% accepts: the bound is widened here (its check has
    # tests of its own, test_exp_vllm_import_assumptions.py)
    monkeypatch.setattr("servetwin.experiments.vllm_import.fit_check.FIT_BOUND", 10.0)
    src = str(DATA / "er0080_vllm0.25.1_sweep_opt125m_c2_p8_run0.json")
    params = [p for p in FIT if p[1] == "c_step"]
    log = str(DATA.parent / "vllm_logs" / "pr24162_v0.10.2dev_qwen2.5-0.5b_tp2.log")  # a server log joins the mix
    doc = calibrate_from_vllm([src, log], str(tmp_path / "gpu.yaml"), hardware="h100-sxm", experiments=[],
                              opts=ImportOptions(model="llama-3.1-8b", tensor_parallel_size=1), params=params)
    prov = doc["provenance"]
    assert prov["files"]["bench_results"] == [src] and "coefficients.c_step" in prov["fitted"]
    assert prov["files"]["server_logs"] == [log]
    case = "f0_er0080_vllm0.25.1_sweep_opt125m_c2_p8_run0"
    assert prov["bench_errors"]["in_sample"][case]["signed_errors"]
    assert load_hardware(str(tmp_path / "gpu.yaml")).coefficients.c_step == pytest.approx(prov["fitted"]["coefficients.c_step"])


def test_a_hardware_file_can_be_the_start(measured, tmp_path):
    from servetwin.experiments.vllm_import.from_vllm import start_set

    d, files = measured
    start = tmp_path / "start.yaml"
    start.write_text(yaml.safe_dump({"base": "h100-sxm", "efficiency": {"gemm_compute": 0.5}}))
    s = start_set(str(start))
    assert s.base == "h100-sxm" and s.values["efficiency"]["gemm_compute"] == 0.5
    doc = calibrate_from_vllm([str(files[0][0])], str(tmp_path / "out.yaml"), hardware=str(start),
                              experiments=[str(files[0][1])], opts=ImportOptions(), trim=None)
    assert doc["efficiency"]["gemm_compute"] == 0.5 and doc["provenance"]["start"] == str(start)
    (tmp_path / "nobase.yaml").write_text(yaml.safe_dump({"efficiency": {"gemm_compute": 0.5}}))
    with pytest.raises(ConfigError, match="must name its preset"):
        start_set(str(tmp_path / "nobase.yaml"))
