"""benchmarks/fit_gpu_presets.py's grid search finds the point that produced the figures, in-sample and
leave-one-case-out (two tiny compute-bound cases whose 'published' figures are the sim's own at a
known A100 GEMM rate)."""
from __future__ import annotations

import pytest

from inttest_helpers import load_benchmark, publish, write_case_dir

CASE = """\
name: {name}
seed: 0
model: llama-3.1-8b
hardware: a100-80g
backends: [sim]
frontend: {{type: offline}}
engine: {{max_num_seqs: 16, max_num_batched_tokens: 2048, max_model_len: 4096, gpu_memory_utilization: 0.9}}
workload: {{requests: 6, prompt_tokens: {prompt}, output_tokens: 4, arrival: {{type: offline}}, seed: 0}}
output: {{step_requests: false, plots: false}}
"""
TRUE_GEMM = 0.7


def _case_dir(tmp_path, fit):
    names = {"long_prompts": 1500, "short_prompts": 600}
    write_case_dir(tmp_path, {name: CASE.format(name=name, prompt=prompt) for name, prompt in names.items()}, "dur_s")
    truth = fit.evaluate(tmp_path, {("efficiency", "gemm_compute"): TRUE_GEMM}, None, "a100-80g")
    publish(tmp_path, truth, "dur_s", "the sim at gemm_compute 0.7")
    return tmp_path


def test_grid_fit_recovers_the_generating_point(tmp_path, capsys):
    fit = load_benchmark("fit_gpu_presets")
    case_dir = _case_dir(tmp_path, fit)
    assert fit.main([str(case_dir), "--preset", "a100-80g", "--grid", "gemm_compute=0.5,0.7,0.85", "--loo"]) == 0
    out = capsys.readouterr().out
    assert "efficiency.gemm_compute: 0.7\n" in out and "loss 0.0000" in out
    assert "LOO median |error| throughput/duration: 0.0%" in out


def test_grid_values_are_checked(tmp_path, capsys):
    fit = load_benchmark("fit_gpu_presets")
    with pytest.raises(SystemExit):
        fit.main([str(tmp_path), "--grid", "gemm_compute=2.0"])
    assert "must lie in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fit.main([str(tmp_path), "--params", "no_such_parameter"])
    assert "--params: unknown parameter 'no_such_parameter'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fit.main([str(tmp_path), "--grid", "no_such_parameter=0.5"])
    assert "--grid: unknown parameter 'no_such_parameter'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fit.main([str(tmp_path), "--grid", "gemm_compute,c_step=0.5"])
    assert "one parameter per --grid" in capsys.readouterr().err


def test_coordinate_search_moves_toward_the_generating_point(tmp_path, capsys):
    fit = load_benchmark("fit_gpu_presets")
    case_dir = _case_dir(tmp_path, fit)  # the a100-80g preset starts at gemm_compute 0.80
    assert fit.main([str(case_dir), "--preset", "a100-80g", "--params", "gemm_compute", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    fitted = float(out.split("efficiency.gemm_compute: ")[1].split()[0])
    assert abs(fitted - TRUE_GEMM) < abs(0.80 - TRUE_GEMM)


def test_validate_prints_leave_one_case_out_over_a_grid(tmp_path, capsys):
    from servetwin.experiments.cli import main
    case_dir = _case_dir(tmp_path, load_benchmark("fit_gpu_presets"))
    assert main(["validate", str(case_dir), "-q", "--loo", "gemm_compute=0.5,0.7"]) == 0
    out = capsys.readouterr().out
    loo = out[out.index("leave-one-case-out"):]
    assert "| throughput/duration | 0.0% |" in loo and "cases run: 2/2" in loo
    assert "in-sample best point of the grid: gemm_compute 0.7" in out
    assert main(["validate", str(case_dir), "--loo", "gemm_compute=2.0"]) == 2  # refused before any run
    assert "--loo 'gemm_compute=2.0': values must lie in" in capsys.readouterr().err
