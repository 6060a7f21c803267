"""Profiler traces with vLLM's step ranges: the torch backend's own torch.profiler trace (CPU, tiny model)
and the simulator's written trace read back into the step table; `compare --measured`; bad traces."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from servetwin.core.config_error import ConfigError
from servetwin.experiments.cli import main
from servetwin.experiments.config.schema import load_config
from servetwin.experiments.vllm_import.measured_steps import load_sim_experiment, match_steps, simulate
from servetwin.experiments.vllm_import.profiler_trace import (
    detailed_annotation, parse_annotation, read_profiler_traces, write_profiler_trace)

EXPERIMENT = """\
name: profiled
seed: 0
model: tiny-llama
hardware: cpu
backends: [torch]
engine: {max_num_seqs: 8, max_num_batched_tokens: 64, num_gpu_blocks: 256, max_model_len: 1024}
workload: {requests: 6, prompt_tokens: 40, output_tokens: 5, arrival: {type: offline}}
output: {step_requests: true, plots: false}
"""


@pytest.fixture(scope="module")
def torch_trace(tmp_path_factory):
    from servetwin.experiments.vllm_import.torch_profile import profile_torch_run

    d = tmp_path_factory.mktemp("profiled")
    (d / "exp.yaml").write_text(EXPERIMENT)
    frames, path, _ = profile_torch_run(load_config(d / "exp.yaml"), d / "prof")
    return d / "exp.yaml", frames, path


def test_torch_backend_trace_reads_back_its_steps(torch_trace):
    _, frames, path = torch_trace
    steps = read_profiler_traces([path])
    own = frames["steps"]
    assert steps.annotation.tolist() == own.annotation.tolist()  # vLLM's range names, in order
    for col in ("num_context_reqs", "num_context_tokens", "num_generation_reqs", "num_generation_tokens"):
        assert steps[col].tolist() == own[col].tolist()
    assert (steps.duration_s > 0).all() and steps.gpu_duration_s.isna().all()  # CPU: no GPU annotations
    assert (steps.gap_before_s.iloc[1:] >= 0).all() and np.isnan(steps.gap_before_s.iloc[0])
    # the profiler range sits inside the engine step the torch backend times
    assert (steps.duration_s.to_numpy() <= own.duration_s.to_numpy() * 1.05 + 1e-3).all()


def test_compare_measured_matches_every_step(torch_trace, tmp_path, capsys):
    exp_path, _, path = torch_trace
    assert main(["compare", "--measured", str(path), str(exp_path), "-o", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "matched 8 of 8 measured steps (100.0%" in out and "| all | 8 |" in out
    doc = json.loads((tmp_path / "cmp" / "measured_comparison.json").read_text())
    assert doc["by_phase"]["all"]["steps"] == 8


def test_simulator_trace_round_trip(tmp_path):
    exp_path = tmp_path / "exp.yaml"
    exp_path.write_text(EXPERIMENT.replace("requests: 6", "requests: 12"))
    frames, _ = simulate(load_sim_experiment(str(exp_path)))
    steps, rows = frames["steps"], frames["step_requests"]
    for name, detailed in (("plain.json", False), ("detailed.json.gz", True)):
        path = write_profiler_trace(steps, tmp_path / name, rows, detailed=detailed)
        back = read_profiler_traces([path])
        assert np.allclose(back.gpu_duration_s, steps.duration_s, atol=1e-6)  # GPU annotation: the device time
        assert np.allclose(back.duration_s, steps.duration_s, atol=1e-6)
        assert back.num_context_tokens.tolist() == steps.num_context_tokens.tolist()
    # the detailed form carries the per-class sums the cost model needs
    first = rows[rows.step == steps.step.iloc[0]]
    ctx = first[first.phase == "context"]
    seq = ctx.num_computed_before + ctx.num_tokens
    assert back.ctx_sum_seq.iloc[0] == seq.sum() and back.ctx_sum_q2.iloc[0] == (ctx.num_tokens ** 2).sum()
    # the simulator's own trace matches its own run step for step
    m = match_steps(read_profiler_traces([tmp_path / "plain.json"]), None, frames=frames, cost_model=None)
    assert m.share == 1.0 and np.allclose(m.predicted_s, m.steps.duration_s, atol=1e-6)


def test_ranks_take_the_slowest(tmp_path):
    exp_path = tmp_path / "exp.yaml"
    exp_path.write_text(EXPERIMENT)
    steps = simulate(load_sim_experiment(str(exp_path)))[0]["steps"]
    write_profiler_trace(steps, tmp_path / "r0.json", gpu=False)
    slow = steps.copy()
    slow["duration_s"] = slow.duration_s * 2
    slow["t_start_s"] = slow.t_start_s * 2  # the slower rank's steps still follow one another
    write_profiler_trace(slow, tmp_path / "r1.json", gpu=False)
    both = read_profiler_traces([tmp_path / "r0.json", tmp_path / "r1.json"])
    assert np.allclose(both.duration_s, slow.duration_s, atol=1e-6) and (both.rank_count == 2).all()
    write_profiler_trace(steps.iloc[1:], tmp_path / "short.json", gpu=False)
    with pytest.raises(ConfigError, match="short.json: its steps differ"):
        read_profiler_traces([tmp_path / "r0.json", tmp_path / "short.json"])


def test_annotations_parse_both_forms():
    assert parse_annotation("execute_context_2(1024)_generation_30(30)") == {
        "num_context_reqs": 2, "num_context_tokens": 1024, "num_generation_reqs": 30, "num_generation_tokens": 30}
    name = detailed_annotation([(100, 28, True), (1, 63, False), (1, 9, False)])
    assert name == "execute_102_context_1(sq100sk128sqsq10000sqsk12800)_generation_2(sq2sk74sqsq2sqsk74)"
    got = parse_annotation(name)
    assert got["num_context_tokens"] == 100 and got["gen_sum_seq"] == 74 and got["num_generation_reqs"] == 2
    assert parse_annotation("execute_model") is None


def test_bad_traces_name_the_problem(tmp_path, capsys):
    cases = {"notjson.json": b"{\"traceEvents\": [", "cut.json.gz": gzip.compress(b"{\"traceEvents\": [")[:12],
             "noranges.json": json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                                            "ts": 1, "dur": 2}]}).encode(),
             "baddur.json": json.dumps({"traceEvents": [{"ph": "X", "cat": "user_annotation", "ts": 5,
                                                         "name": "execute_context_1(4)_generation_0(0)",
                                                         "dur": "x"}]}).encode()}
    expected = {"notjson.json": "notjson.json is not valid JSON", "cut.json.gz": "cut.json.gz is not a readable gzip",
                "noranges.json": "no execute_context_X(a)_generation_Y(b) ranges",
                "baddur.json": "traceEvents[0].dur: must be a number"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        assert main(["import", "vllm-trace", str(tmp_path / name), "-o", str(tmp_path / "out")]) == 2
        assert expected[name] in capsys.readouterr().err


def test_import_writes_a_run_folder_the_notebook_reads(torch_trace, tmp_path):
    import pandas as pd

    _, frames, path = torch_trace
    assert main(["import", "vllm-trace", str(path), "-o", str(tmp_path)]) == 0
    tables = {n: pd.read_parquet(tmp_path / "measured" / f"{n}.parquet") for n in ("steps", "step_requests", "requests")}
    assert tables["steps"].annotation.tolist() == frames["steps"].annotation.tolist()
    assert len(tables["step_requests"]) == 0 and "request_id" in tables["requests"].columns
