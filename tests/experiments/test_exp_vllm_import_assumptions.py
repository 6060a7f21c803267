"""What `servetwin import vllm-bench` and `calibrate --from-vllm` infer from a bench file's names (TP size,
FP8 weights, the vLLM version), the one block that lists every assumption, a changed rate on an imported
case, and a calibration that misses its own file: exit 1, nothing written, the term named."""
from __future__ import annotations

from pathlib import Path

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.experiments.cli import main
from servetwin.experiments.validate.preset_fit import FIT
from servetwin.experiments.vllm_import.assumptions import (infer_fp8, infer_tp_from_name, infer_version_from_name,
                                                            version_assumptions)
from servetwin.experiments.vllm_import.bench_case import ImportOptions, build_case
from servetwin.experiments.vllm_import.bench_file import load_bench_file
from servetwin.experiments.vllm_import.fit_check import FitFailed, checked_errors
from servetwin.experiments.vllm_import.from_vllm import calibrate_from_vllm
from servetwin.sim.workload import WorkloadSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_bench"
DSTACK = DATA / "dstack_vllm0.6.3dev_8xh100_llama31-405b-fp8_qps16_p1000_detailed.json"
QWEN = DATA / "kvcached_vllm0.19.0_h100_qwen3-0.6b_inf_p500.json"
C_STEP_ONLY = [p for p in FIT if p[1] == "c_step"]  # a short search: the check, not the fit, is under test


@pytest.mark.parametrize("name, tp", [
    ("dstack_vllm0.6.3dev_8xh100_llama31-405b-fp8_qps16_p1000_detailed.json", 8),
    ("gunther520_vllm-2024-11_llama31-8b_tp8_p80_detailed.json", 8),
    ("lambdalabs_vllm-2024-09_h100_llama31-8b-fp8_tp1_p10_detailed.json", 1),
    ("sglang_datacrunch_4xh200_llama33-70b_online.jsonl:3", 4),
    ("8xH100SXM5-serving/run.json", None),  # a folder's name is not the file's
    ("nvidia-vllm-16.0qps-Llama-3.1-405B-FP8-20241109-150547.json", None),
    ("kvcached_vllm0.19.0_h100_qwen3-0.6b_inf_p500.json", None),
])
def test_tp_from_the_file_name(name, tp):
    got = infer_tp_from_name(name)
    assert (got[0] if got else None) == tp


@pytest.mark.parametrize("model_id, fp8", [
    ("meta-llama/Llama-3.1-405B-FP8", True), ("neuralmagic/Meta-Llama-3.1-8B-FP8", True),
    ("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", True), ("Qwen/Qwen3-0.6B", False),
    ("fp8-org/Llama-3.1-8B", False), (None, False), ("/data/model/hygon/Hy3-Channel-INT8-w8a8", False),
])
def test_fp8_from_the_model_id(model_id, fp8):
    assert infer_fp8(model_id) is fp8


def test_version_from_the_file_name_and_what_differs_from_033():
    assert infer_version_from_name("dstack_vllm0.6.3dev_8xh100.json") == "0.6.3"
    assert infer_version_from_name("er0080_vllm0.25.1_sweep.json") == "0.25.1"
    assert infer_version_from_name("lambdalabs_vllm-2024-09_h100.json") is None  # a date, not a version
    old, new = version_assumptions("0.6.3"), version_assumptions("0.19.0")
    assert any("engine V0" in line for line in old) and any("scheduler_reserve_full_isl" in line for line in old)
    assert not any("engine V0" in line for line in new) and any("async scheduling" in line for line in new)


def test_the_dstack_405b_file_imports_as_tp8_fp8_on_063():
    record = load_bench_file(DSTACK)[0]
    case = build_case(record, ImportOptions(model="llama-3.1-405b", hardware="h100-sxm"))
    assert case.config["engine"] == {"tensor_parallel_size": 8, "quantization": "fp8"}
    assert case.published["engine_version"] == "vLLM 0.6.3"  # validate applies 0.6.3's admission rule
    assert "ingress" not in case.config["frontend"]  # before the single-thread tokeniser: shared
    block = case.assumption_block()
    for text in ("tensor_parallel_size: 8 (the file name says '8xh100'", "quantization: fp8 (the model id",
                 "vLLM version: 0.6.3 (the file name", "max_num_seqs 256", "async scheduling"):
        assert text in block
    # a flag wins over what the names say; quantization=null takes the inferred fp8 back
    opts = ImportOptions(model="llama-3.1-405b", hardware="h100-sxm", tensor_parallel_size=4, vllm_version="0.11.0",
                         engine={"quantization": None})
    case = build_case(record, opts)
    assert case.config["engine"] == {"tensor_parallel_size": 4}
    assert case.published["engine_version"] == "vLLM 0.11.0"


def test_a_finite_rate_case_takes_a_new_rate_and_an_inf_one_says_why_not():
    record = load_bench_file(DSTACK)[0]
    workload = build_case(record, ImportOptions(model="llama-3.1-405b", hardware="h100-sxm")).config["workload"]
    assert workload["arrival"] == {"type": "poisson", "rate": 16.0}  # the client's process: --set can change it
    spec = WorkloadSpec.from_dict({"seed": 0, "requests": 4, "prompt_tokens": 8, "output_tokens": 2,
                                   "arrival": {**workload["arrival"], "rate": 32.0}}, "workload")
    assert spec.arrival.rate == 32.0
    inf = build_case(load_bench_file(QWEN)[0], ImportOptions(model="qwen3-0.6b", hardware="h100-sxm"))
    assert inf.config["frontend"]["ingress"] == "in_order"  # vLLM 0.19 from the name: one tokeniser thread
    assert "frontend.ingress: in_order" in inf.assumption_block()
    arrival = {**inf.config["workload"]["arrival"], "rate": 32}
    with pytest.raises(ConfigError, match="t = 0.*type: poisson, rate: 32"):
        WorkloadSpec.from_dict({"seed": 0, "requests": 4, "prompt_tokens": 8, "output_tokens": 2,
                                "arrival": arrival}, "workload")


def test_checked_errors_take_the_first_tpot_and_throughput_figure():
    errs = {"ttft_mean": 3.0, "tpot_mean": 0.2, "tpot_p50": 0.1, "out_tok_s": -0.3, "req_s": 0.05}
    assert checked_errors(errs) == {"tpot_p50": 0.1, "req_s": 0.05}


def test_the_qwen3_burst_fits_with_its_versions_in_order_admission(tmp_path):
    out = tmp_path / "gpu.yaml"
    doc = calibrate_from_vllm([str(QWEN)], str(out), hardware="h100-sxm", experiments=[],
                              opts=ImportOptions(model="qwen3-0.6b"), params=C_STEP_ONLY)
    (errors,) = doc["provenance"]["bench_errors"]["in_sample"].values()
    checked = checked_errors(errors["signed_errors"])
    assert set(checked) == {"tpot_p50", "req_s"} and all(abs(e) <= 0.15 for e in checked.values())
    assert out.exists()


def test_a_fit_that_misses_its_file_writes_nothing_and_names_the_front_end(tmp_path):
    out = tmp_path / "gpu.yaml"
    with pytest.raises(FitFailed) as e:  # the same burst as if from vLLM 0.11: admitted all together
        calibrate_from_vllm([str(QWEN)], str(out), hardware="h100-sxm", experiments=[],
                            opts=ImportOptions(model="qwen3-0.6b", vllm_version="0.11.0"), params=C_STEP_ONLY)
    msg = str(e.value)
    assert "nothing written" in msg and "tpot_p50" in msg and "API server" in msg
    assert "the engine's TPOT p50 is" in msg  # measured: the engine alone at the file's request rate
    assert not out.exists()


def test_a_case_that_cannot_run_is_a_failed_fit_not_an_infinite_loss(tmp_path):
    out = tmp_path / "gpu.yaml"
    with pytest.raises(FitFailed, match="does not run") as e:  # bf16 405B weights do not fit 8 x 80 GB
        calibrate_from_vllm([str(DSTACK)], str(out), hardware="h100-sxm", experiments=[],
                            opts=ImportOptions(model="llama-3.1-405b", engine={"quantization": None}),
                            params=C_STEP_ONLY)
    assert "term: the setup" in str(e.value)
    assert not out.exists()


def test_the_cli_exits_1_on_a_failed_fit_and_takes_engine_flags(tmp_path, capsys, monkeypatch):
    seen = {}

    def fail(files, out_path, **kw):
        seen.update(kw["opts"].engine)
        raise FitFailed("the fit does not reach its own files; term: X")

    monkeypatch.setattr("servetwin.experiments.vllm_import.from_vllm.calibrate_from_vllm", fail)
    out = tmp_path / "gpu.yaml"
    rc = main(["calibrate", "--from-vllm", str(QWEN), "--model", "qwen3-0.6b", "--hardware", "h100-sxm",
               "--engine", "quantization=fp8", "-o", str(out)])
    assert rc == 1 and seen == {"quantization": "fp8"}
    assert "term: X" in capsys.readouterr().err and not out.exists()


def test_parameters_at_the_edge_of_their_range_and_which_side_is_slow():
    from servetwin.experiments.vllm_import.fit_check import _slow_edge, at_bounds

    values = {("efficiency", "gemm_compute"): 0.25, ("efficiency", "gemm_half_m"): 1024.0,
              ("coefficients", "c_step"): 4e-3, ("coefficients", "c_req"): 1e-6,
              ("efficiency", "gemm_bandwidth"): 0.8}
    edged = [p for p in FIT if at_bounds(values, [p])]
    assert [p[1] for p in edged] == ["gemm_compute", "gemm_half_m", "c_step", "c_req"]  # not gemm_bandwidth
    assert [_slow_edge(values, p) for p in edged] == [True, True, True, False]  # a tiny c_req makes steps faster
