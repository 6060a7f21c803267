"""The torch backend path of `servetwin run` (tiny-llama on the CPU, a few requests)."""
import json

import pandas as pd
import pytest
from exptest_helpers import tiny, write_yaml

from servetwin.core.testbed.trace import REQUEST_COLUMNS, STEP_COLUMNS, STEP_REQUEST_COLUMNS
from servetwin.experiments.cli import main


def _torch_backend_or_skip():
    try:
        import servetwin.gpu.executor as executor  # noqa: F401,PLC0415
    except Exception as e:  # noqa: BLE001  (ImportError, or a half-finished module)
        pytest.skip(f"servetwin.gpu.executor does not import: {type(e).__name__}: {e}")


def test_torch_and_sim_backends_run_the_same_requests(tmp_path):
    _torch_backend_or_skip()
    cfg = tiny(backends=["sim", "torch"], engine__device="cpu")
    cfg["workload"]["requests"] = 4
    path = write_yaml(tmp_path / "both.yaml", cfg)
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--no-progress"]) == 0
    tables = {}
    for backend in ("sim", "torch"):
        steps = pd.read_parquet(out / backend / "steps.parquet")
        assert list(steps.columns) == STEP_COLUMNS
        assert list(pd.read_parquet(out / backend / "step_requests.parquet").columns) == STEP_REQUEST_COLUMNS
        reqs = pd.read_parquet(out / backend / "requests.parquet")
        assert list(reqs.columns) == REQUEST_COLUMNS
        assert (steps.backend == backend).all()
        assert (out / backend / "trace.json").is_file()
        tables[backend] = (steps, reqs.set_index("request_id").sort_index())
    (s_steps, s_reqs), (t_steps, t_reqs) = tables["sim"], tables["torch"]
    # same requests, same output lengths (ignore_eos), same scheduling decisions offline
    assert s_reqs.prompt_tokens.tolist() == t_reqs.prompt_tokens.tolist()
    assert s_reqs.output_tokens.tolist() == t_reqs.output_tokens.tolist()
    assert s_steps.annotation.tolist() == t_steps.annotation.tolist()
    assert (t_steps.duration_s > 0).all()  # measured with perf_counter
    summary = json.loads((out / "summary.json").read_text())["backends"]
    assert summary["torch"]["completed"] == summary["sim"]["completed"] == 4
    assert summary["torch"]["simulated_s"] is None and summary["torch"]["wall_s"] > 0
    assert summary["torch"]["num_gpu_blocks"] == summary["sim"]["num_gpu_blocks"] == 64
    assert summary["torch"]["ttft_s"]["p50"] > 0
    assert "torch measured makespan / sim predicted makespan" in (out / "report.md").read_text()
