"""The torch backend path of `servetwin run` (tiny-llama on the CPU, a few requests)."""
import json
import subprocess
import sys

import pandas as pd
import pytest
from exptest_helpers import CONFIGS, tiny, write_yaml

from servetwin.core.testbed.trace import REQUEST_COLUMNS, STEP_COLUMNS, STEP_REQUEST_COLUMNS
from servetwin.experiments.cli import main
from servetwin.experiments.config.schema import load_config


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
    report = (out / "report.md").read_text()
    assert "torch measured makespan / sim predicted makespan" in report
    assert "from the `cpu` hardware cost model (uncalibrated coefficients)" in report


def test_torch_run_is_warmed_up_and_checked_for_contention(tmp_path, capsys, monkeypatch):
    _torch_backend_or_skip()
    import servetwin.experiments.calibrate.calibrate as calmod  # noqa: PLC0415

    # another machine than the calibration's: said, as compare says it
    monkeypatch.setattr(calmod, "device_name", lambda device="cpu": "Test CPU (999 logical CPUs)")
    monkeypatch.setattr(calmod, "machine_fingerprint",
                        lambda device="cpu": {"cpu_model": "Test CPU", "logical_cpus": 999, "arch": "x86_64"})
    cfg = tiny(backends=["sim", "torch"], engine__device="cpu",
               hardware=str(CONFIGS.parent / "calibrations" / "cpu_tiny-llama.yaml"))
    cfg["workload"]["requests"] = 4
    out = tmp_path / "out"
    assert main(["run", str(write_yaml(tmp_path / "t.yaml", cfg)), "-o", str(out), "--no-progress", "--no-plots"]) == 0
    err = capsys.readouterr().err
    # the warm-up ran first and is not in the trace: only the workload's requests, steps numbered from 0
    assert "[torch] warm-up: 4 requests" in err
    reqs = pd.read_parquet(out / "torch" / "requests.parquet")
    assert not reqs.request_id.str.contains("__warmup").any() and len(reqs) == 4
    assert pd.read_parquet(out / "torch" / "steps.parquet").step.iloc[0] == 0
    # the thread count came from the calibration (1 thread), the check is in the summary and the report
    m = json.loads((out / "summary.json").read_text())["backends"]["torch"]["measurement"]
    assert m["torch_threads"] == 1 and m["warmup_s"] > 0 and m["discarded_runs"] == []
    assert 0 <= m["contention"]["contended_step_share"] <= 1 and m["contention"]["median_cpu_share"] > 0
    assert "[torch] 1 torch thread(s) (the calibration's torch_threads)" in err
    assert "warning: [torch] the calibration was made on " in err
    # files with a machine fingerprint name the CPU model; older ones (device text only) the device text
    assert any("here 'Test CPU'" in n or "this machine is 'Test CPU (999 logical CPUs)'" in n
               for n in m["calibration_mismatches"])
    report = (out / "report.md").read_text()
    assert "contention check:" in report and "the simulator's calibration does not describe this run" in report
    # the sim/torch ratio names the calibration by its file name (no absolute path in the report)
    assert "the sim's step times come from the calibration `cpu_tiny-llama.yaml`, fitted on " in report
    ratio = next(line for line in report.splitlines() if "torch measured makespan" in line)
    assert str(CONFIGS.parent) not in ratio


def test_contended_torch_run_warns_and_is_retried(tmp_path, monkeypatch, capsys):
    _torch_backend_or_skip()
    import numpy as np  # noqa: PLC0415

    import servetwin.experiments.calibrate.torch_measure as measuremod  # noqa: PLC0415

    real = measuremod.cpu_shares
    calls = {"n": 0}

    def first_run_starved(steps, cpu_s, nthreads):
        """The first measured run "lost its CPU" in every step (share 0), later ones kept all of it."""
        calls["n"] += 1
        assert len(real(steps, cpu_s, nthreads)) == len(steps)  # the executor reported every step
        return np.full(len(steps), 0.0 if calls["n"] == 1 else 1.0)

    monkeypatch.setattr(measuremod, "cpu_shares", first_run_starved)
    cfg = tiny(backends=["torch"], engine__device="cpu")
    cfg["workload"]["requests"] = 3
    path = write_yaml(tmp_path / "t.yaml", cfg)
    # kept (no retries): a warning naming the share, in the console, summary.json and report.md
    assert main(["run", str(path), "-o", str(tmp_path / "a"), "--no-progress", "--no-plots", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "warning: [torch] 100% of the measured steps lost their CPU to other processes" in err
    m = json.loads((tmp_path / "a" / "summary.json").read_text())["backends"]["torch"]["measurement"]
    assert m["contention"]["contended_step_share"] == 1.0 and m["torch_threads"] == 1
    assert "100.0% of the steps lost their CPU" in (tmp_path / "a" / "report.md").read_text()
    assert "**Warning**: more than 5% of the steps were contended" in (tmp_path / "a" / "report.md").read_text()
    # with --retry-contended the starved run is discarded and run again; the kept one is clean
    calls["n"] = 0
    assert main(["run", str(path), "-o", str(tmp_path / "b"), "--no-progress", "--no-plots", "--threads", "1",
                 "--retry-contended", "1", "--no-warmup"]) == 0
    err = capsys.readouterr().err
    assert calls["n"] == 2 and "discarded, running it again (1/1)" in err and "warning: [torch]" not in err
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())["backends"]["torch"]
    m = summary["measurement"]
    assert [d["contended_step_share"] for d in m["discarded_runs"]] == [1.0]
    assert m["contention"]["contended_step_share"] == 0.0 and m["warmup_s"] is None
    assert summary["completed"] == 3 and len(pd.read_parquet(tmp_path / "b" / "torch" / "requests.parquet")) == 3


def test_measure_flags_are_checked(tmp_path, capsys):
    path = write_yaml(tmp_path / "t.yaml", tiny())
    for flags, name in ((["--threads", "0"], "--threads"), (["--retry-contended", "-1"], "--retry-contended"),
                        (["--max-contended-share", "2"], "--max-contended-share")):
        assert main(["run", str(path), "-o", str(tmp_path / "o"), *flags]) == 2
        assert name in capsys.readouterr().err
        assert not (tmp_path / "o").exists()  # refused before the output folder is touched
    assert main(["run", str(path), "-o", str(tmp_path / "o"), "--seeds", "2", "--retry-contended", "1"]) == 2
    assert "not supported with seeds" in capsys.readouterr().err


def test_a_bad_torch_max_model_len_fails_at_config_time_without_torch(tmp_path):
    # an HF model folder with only its config.json: no weights, so any model load would fail otherwise
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 128}))
    cfg = tiny(backends=["torch"], model=str(model), engine__device="cpu", engine__max_model_len=256)
    path = write_yaml(tmp_path / "t.yaml", cfg)
    code = ("import sys\nfrom servetwin.experiments.config.schema import ConfigError, load_config\n"
            f"try:\n    load_config({str(path)!r})\nexcept ConfigError as e:\n    print(e.path, '|', e.message)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines() == [
        "engine.max_model_len | 256 exceeds the model's max_position_embeddings (128) [torch backend]", "no torch"]
    # within the limit the config is fine; the CLI says the same and exits 2 before building anything
    cfg["engine"]["max_model_len"] = 128
    load_config(write_yaml(tmp_path / "ok.yaml", cfg))
    assert main(["run", str(path), "-o", str(tmp_path / "o"), "--no-progress"]) == 2
    assert not (tmp_path / "o").exists()


def test_the_torch_check_reads_only_configs_on_disk(tmp_path, monkeypatch):
    from servetwin.gpu.models import model_files  # noqa: PLC0415

    monkeypatch.setenv("SERVETWIN_CACHE", str(tmp_path / "cache"))
    assert model_files.config_on_disk("tiny-llama") is None  # not built yet: checked when it loads
    built = tmp_path / "cache" / "models" / "tiny-llama"
    built.mkdir(parents=True)
    (built / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert model_files.config_on_disk("tiny-llama") == built / "config.json"
    assert model_files.max_position_embeddings(built / "config.json") == 4096
    (built / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # absent: the type's default
    assert model_files.max_position_embeddings(built / "config.json") is None
    assert model_files.config_on_disk(str(tmp_path / "nowhere")) is None
    from servetwin.gpu.models.tiny import TINY_MODELS  # noqa: PLC0415

    assert tuple(TINY_MODELS) == model_files.TINY_MODEL_NAMES
