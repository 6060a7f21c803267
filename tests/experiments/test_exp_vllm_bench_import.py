"""`servetwin import vllm-bench`: every real result file in tests/data/vllm_bench imports without hand
edits (the flags of its manifest entry), a detailed file's requests are replayed exactly in order,
`servetwin validate` runs an imported case, and bad input gets exit 2 naming the field."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.experiments.cli import main
from servetwin.experiments.vllm_import.bench_case import ImportOptions, build_case
from servetwin.experiments.vllm_import.bench_file import load_bench_file, parse_record

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_bench"
MANIFEST = json.loads((DATA / "manifest.json").read_text())["files"]


@pytest.mark.parametrize("entry", MANIFEST, ids=[e["file"][:24] for e in MANIFEST])
def test_every_public_file_builds_a_case(entry):
    records = load_bench_file(DATA / entry["file"])
    assert len(records) == entry["records"]
    opts = ImportOptions(model=entry["model"], hardware=entry["hardware"])
    for record, expected in zip(records, entry["expected_requests"]):
        case = build_case(record, opts)
        n = len(case.trace_rows) if case.trace_rows is not None else case.config["workload"]["requests"]
        assert n in expected
        assert (case.trace_rows is not None) == entry["detailed"]
        assert case.published["published"], "no figure to compare"
        assert any(a.field == "engine.tensor_parallel_size" for a in case.assumptions)  # from a name, or assumed
        assert "tensor_parallel_size" in case.assumption_block()


def test_detailed_requests_keep_lengths_and_order():
    raw = json.loads((DATA / "lambdalabs_vllm-2024-09_h100_llama31-8b-fp8_tp1_p10_detailed.json").read_text())
    case = build_case(parse_record(raw, "x.json"), ImportOptions(model="llama-3.1-8b", hardware="h100-sxm"))
    assert [p for _, p, _ in case.trace_rows] == raw["input_lens"]
    assert [o for _, _, o in case.trace_rows] == [max(o, 1) for o in raw["output_lens"]]
    assert all(t == 0.0 for t, _, _ in case.trace_rows)  # request rate inf
    assert any("returned no tokens" in n for n in case.notes)


def test_formats_differences():
    sweep, = load_bench_file(DATA / "er0080_vllm0.25.1_sweep_opt125m_c2_p8_run0.json")  # indent=4, vllm bench sweep
    assert sweep.engine == {"max_num_seqs": 4} and sweep.max_concurrency == 2 and math.isinf(sweep.request_rate)
    case = build_case(sweep, ImportOptions(model="llama-3.1-8b", hardware="h100-sxm", tensor_parallel_size=1))
    assert case.config["workload"]["arrival"] == {"type": "closed_loop", "clients": 2}
    assert case.config["workload"]["prompt_tokens"] == 32 and case.config["engine"]["max_num_seqs"] == 4
    sg = load_bench_file(DATA / "sglang_datacrunch_4xh200_llama33-70b_online.jsonl")
    assert [r.where.rsplit(":", 1)[1] for r in sg] == [str(i) for i in range(1, 8)]
    assert sg[0].client == "sglang" and "ttft_p50" in sg[0].metrics and sg[0].request_rate == 1.0
    lam, = load_bench_file(DATA / "lambdalabs_vllm-2024-09_h100_llama31-8b-fp8_tp1_p10_detailed.json")
    assert lam.metrics["e2e_mean"] == pytest.approx(290.35341650014743)  # the non-upstream *_latency_ms
    hy, = load_bench_file(DATA / "hy3dcu_vllm0.18.1_hy3-int8_c1_p3.json")
    with pytest.raises(ConfigError, match="--model.*model_id '/data/model"):
        build_case(hy, ImportOptions(hardware="h100-sxm"))


def test_inferencemax_aggregate_needs_the_workload_flags():
    # Built here from the keys InferenceMAX's aggregation writes (InferenceMAX/InferenceMAX utils/process_result.py:
    # hw, tp, ep, conc, model, framework, precision, *_per_gpu throughputs, the *_ms latencies renamed without the
    # suffix, in seconds); the values are made up, not a measurement.
    rec = parse_record({"hw": "h200", "tp": 8, "ep": 1, "conc": 64, "model": "deepseek-ai/DeepSeek-R1",
                        "framework": "vllm", "precision": "fp8", "tput_per_gpu": 1000.0,
                        "output_tput_per_gpu": 400.0, "mean_ttft": 0.25, "median_tpot": 0.02}, "agg.json")
    assert rec.tensor_parallel_size == 8 and rec.metrics["tot_tok_s"] == 8000.0
    assert rec.metrics["ttft_mean"] == pytest.approx(250.0) and rec.metrics["tpot_p50"] == pytest.approx(20.0)
    opts = ImportOptions(model="llama-3.1-8b", hardware="h200")
    with pytest.raises(ConfigError, match="--num-prompts"):
        build_case(rec, opts)
    opts.num_prompts = 640
    with pytest.raises(ConfigError, match="--input-len"):
        build_case(rec, opts)
    opts.input_len, opts.output_len = 1024, 1024
    case = build_case(rec, opts)
    assert case.config["engine"]["tensor_parallel_size"] == 8
    assert case.config["workload"]["arrival"] == {"type": "closed_loop", "clients": 64}


def test_import_then_validate_runs(tmp_path, capsys):
    src = DATA / "er0080_vllm0.25.1_sweep_opt125m_c2_p8_run0.json"
    out = tmp_path / "case"
    assert main(["import", "vllm-bench", str(src), "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
                 "-o", str(out)]) == 0
    assert "servetwin validate" in capsys.readouterr().out
    assert main(["validate", str(out), "-q"]) == 0
    table = capsys.readouterr().out
    assert "| er0080_vllm0.25.1_sweep_opt125m_c2_p8_run0 | ttft_mean | 217.3 |" in table
    assert "cases run: 1/1" in table
    # importing again refuses to replace the case without --overwrite, and writes nothing
    assert main(["import", "vllm-bench", str(src), "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
                 "-o", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_missing_flags_and_bad_files_exit_2(tmp_path, capsys):
    src = DATA / "kvcached_vllm0.19.0_h100_qwen3-0.6b_inf_p500.json"
    assert main(["import", "vllm-bench", str(src), "-o", str(tmp_path / "o")]) == 2
    assert "--hardware" in capsys.readouterr().err and not (tmp_path / "o").exists()
    raw = json.loads(src.read_text())
    for change, field in (({"request_rate": "fast"}, "request_rate"), ({"completed": -3}, "completed"),
                          ({"duration": None}, "duration"), ({"max_concurrency": 1.5}, "max_concurrency")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**raw, **change}))
        assert main(["import", "vllm-bench", str(bad), "--hardware", "h100-sxm", "-o", str(tmp_path / "o")]) == 2
        assert f"bad.json.{field}:" in capsys.readouterr().err
    detailed = json.loads((DATA / "lambdalabs_vllm-2024-09_h100_llama31-8b-fp8_tp1_p10_detailed.json").read_text())
    bad.write_text(json.dumps({**detailed, "ttfts": detailed["ttfts"][:4]}))
    assert main(["import", "vllm-bench", str(bad), "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
                 "-o", str(tmp_path / "o")]) == 2
    assert "bad.json.ttfts: must be a list as long as input_lens (10), got 4" in capsys.readouterr().err


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 0.999), name=st.sampled_from([e["file"] for e in MANIFEST if e["records"] == 1
                                                          and not e["detailed"]]))
def test_a_truncated_file_is_an_error_naming_it(tmp_path, cut, name):
    text = (DATA / name).read_text()
    bad = tmp_path / "cut.json"
    bad.write_text(text[: int(len(text) * cut)])
    with pytest.raises(ConfigError) as err:  # never another exception
        load_bench_file(bad)
    assert "cut.json" in err.value.path


def test_run_writes_vllm_bench_json_that_imports_and_validates_exactly(tmp_path, capsys):
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: written\nseed: 0\nmodel: llama-3.1-8b\nhardware: h100-sxm\nbackends: [sim]\n"
                   "frontend: {type: api_server, endpoint: completions}\n"
                   "workload: {requests: 12, prompt_tokens: {type: uniform, low: 50, high: 600},\n"
                   "           output_tokens: {type: uniform, low: 5, high: 40}, arrival: {type: offline}}\n"
                   "output: {step_requests: false, plots: false}\n")
    bench = tmp_path / "bench.json"
    assert main(["run", str(exp), "-o", str(tmp_path / "run"), "--save-vllm-bench", str(bench)]) == 0
    doc = json.loads(bench.read_text())
    assert doc["backend"] == "servetwin-sim" and doc["request_rate"] == "inf" and doc["completed"] == 12
    assert len(doc["input_lens"]) == 12 and doc["mean_ttft_ms"] > 0 and "p99_e2el_ms" in doc
    assert main(["import", "vllm-bench", str(bench), "--hardware", "h100-sxm", "--tensor-parallel-size", "1",
                 "-o", str(tmp_path / "case")]) == 0
    capsys.readouterr()
    assert main(["validate", str(tmp_path / "case"), "-q"]) == 0
    out = capsys.readouterr().out
    for group in ("throughput/duration", "TPOT/ITL", "TTFT", "E2E"):
        assert f"| {group} | 0.0% |" in out  # the same run, replayed from vLLM's format


def test_engine_flags_the_file_cannot_record(tmp_path, capsys):
    src = str(DATA / "dstack_vllm0.6.3dev_8xh100_llama31-405b-fp8_qps16_p1000_detailed.json")
    base = ["import", "vllm-bench", src, "--model", "llama-3.1-405b", "--hardware", "h100-sxm", "-tp", "8"]
    assert main(base + ["--engine", "quantization", "-o", str(tmp_path / "bad")]) == 2
    assert "--engine: expected KEY=VALUE" in capsys.readouterr().err
    assert main(base + ["--engine", "quantization=fp8", "--engine", "max_num_seqs=256", "-o", str(tmp_path)]) == 0
    import yaml

    case = yaml.safe_load(next((tmp_path / "cases").glob("*.yaml")).read_text())
    assert case["engine"] == {"tensor_parallel_size": 8, "quantization": "fp8", "max_num_seqs": 256}
