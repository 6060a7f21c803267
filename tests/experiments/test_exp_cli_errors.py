"""Command-line failure modes a first-time user hits: each is a one-line error (exit 2) naming what is
wrong, found before any work is done - never a traceback."""
import json

import pytest
from exptest_helpers import SCENARIOS, tiny, write_yaml

from servetwin.experiments.cli import main


def _torch_available() -> bool:
    try:
        import servetwin.gpu.executor as executor  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "taken"
    f.write_text("not a folder")
    return f


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_output_that_is_a_file_is_a_clear_error(tmp_path, a_file, capsys, command):
    cfg = tiny(sweep={"engine.max_num_seqs": [2, 4]})
    path = write_yaml(tmp_path / "c.yaml", cfg)
    assert main([command, str(path), "-o", str(a_file), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"servetwin {command}: error: -o/--output: {a_file} exists and is not a folder" in err
    assert main([command, str(path), "-o", str(a_file / "sub" / "dir"), "--no-progress"]) == 2
    assert f"{a_file} is a file, not a folder" in capsys.readouterr().err
    assert a_file.read_text() == "not a folder"


def test_compare_output_that_is_a_file_is_a_clear_error(tmp_path, a_file, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny())
    assert main(["compare", str(path), "-o", str(a_file), "--no-plots"]) == 2
    assert "servetwin compare: error: -o/--output:" in capsys.readouterr().err


def test_replay_output_errors_are_clear(tmp_path, a_file, capsys):
    scenario = str(SCENARIOS / "a_production_shaped.json")
    assert main(["replay", scenario, "-o", str(tmp_path)]) == 2
    assert "servetwin replay: error: -o/--output: " in capsys.readouterr().err
    assert main(["replay", scenario, "-o", str(tmp_path / "missing" / "out.jsonl")]) == 2
    assert "-o/--output: cannot write" in capsys.readouterr().err
    assert main(["replay", scenario, "-o", str(a_file / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "-o/--output: cannot create" in err and "is a file, not a folder" in err


@pytest.mark.skipif(not _torch_available(), reason="torch backend (servetwin.gpu.executor) not importable")
def test_unknown_torch_model_is_a_clear_error(tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny(model="no-such-model-xyz", backends=["torch"]))
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "servetwin run: error: model: 'no-such-model-xyz' is neither a built-in model" in err
    assert "[torch backend]" in err and "Traceback" not in err


def test_requests_that_are_all_rejected_are_reported(tmp_path, capsys):
    cfg = tiny(workload__prompt_tokens=300, workload__requests=3)  # max_model_len is 256
    path = write_yaml(tmp_path / "c.yaml", cfg)
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--no-plots"]) == 2
    captured = capsys.readouterr()
    assert "sim: 0/3 requests" in captured.out
    assert "error: sim: 3 of 3 requests were rejected as never servable" in captured.err
    assert "max_model_len is 256" in captured.err


def test_run_refuses_a_non_empty_folder_unless_overwrite(tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny())
    out = tmp_path / "out"
    (out / "torch").mkdir(parents=True)
    (out / "torch" / "steps.parquet").write_bytes(b"old")
    (out / "config.yaml").write_text("name: old\n")  # an earlier servetwin's run folder
    (out / "old.png").write_bytes(b"png")
    assert main(["run", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "-o/--output:" in err and "is not empty" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "old.png", "torch"]  # untouched
    assert main(["run", str(path), "-o", str(out), "--no-progress", "--no-plots", "--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names == ["config.yaml", "report.md", "sim", "summary.json"]  # the old backend and PNG are gone
    printed = capsys.readouterr().out
    assert "<backend>" not in printed and "config.yaml, report.md, summary.json, sim/ (5 files)" in printed


@pytest.mark.skipif(not _torch_available(), reason="torch backend (servetwin.gpu.executor) not importable")
def test_sweep_over_backends_reports_each_points_own_backends(tmp_path, capsys):
    cfg = tiny(sweep={"backends": [["sim"], ["torch"]]}, engine__device="cpu", workload__requests=2)
    path = write_yaml(tmp_path / "c.yaml", cfg)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 0
    assert "2 points x ['sim', 'torch']" in capsys.readouterr().err
    import pandas as pd

    df = pd.read_csv(out / "sweep.csv")
    assert list(zip(df.point, df.backend, df.status)) == [("backends=sim", "sim", "ok"),
                                                          ("backends=torch", "torch", "ok")]
    assert (df.completed == 2).all()
    summary = json.loads((out / "backends=torch" / "summary.json").read_text())
    assert list(summary["backends"]) == ["torch"]


def test_a_key_given_twice_is_an_error_not_silently_dropped(tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text("model: tiny-llama\nhardware: cpu\nengine: {max_num_seqs: 2}\n"
                    "workload: {requests: 2, prompt_tokens: 8, output_tokens: 2}\nengine: {block_size: 32}\n")
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is not valid YAML: duplicate key 'engine' (first given on line 3)" in err and "line 5" in err
    assert not (tmp_path / "out").exists()
    # YAML merge keys still work (an override after `<<` is not a duplicate)
    path.write_text("model: tiny-llama\nhardware: cpu\nbase: &b {max_num_seqs: 2, block_size: 16}\n"
                    "engine: {<<: *b, max_num_seqs: 4}\nworkload: {requests: 2, prompt_tokens: 8, output_tokens: 2}\n")
    from servetwin.experiments.config.schema import ConfigError, load_yaml

    assert load_yaml(path)["engine"] == {"max_num_seqs": 4, "block_size": 16}
    with pytest.raises(ConfigError, match="base: unknown key"):
        from servetwin.experiments.config.schema import load_config

        load_config(path)


@pytest.mark.parametrize("extra, message", [
    (["--repeats", "0"], "--repeats: must be >= 1, got 0"),  # was accepted: a fit on decode steps only
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--trim", "0"], "--trim: must be > 0"),
])
def test_calibrate_rejects_bad_numbers_before_measuring(tmp_path, capsys, extra, message):
    out = tmp_path / "c.yaml"
    assert main(["calibrate", "--model", "tiny-llama", "--design", "quick", "-o", str(out), *extra]) == 2
    assert f"servetwin calibrate: error: {message}" in capsys.readouterr().err
    assert not out.exists()


def test_calibrate_output_problems_are_found_before_measuring(tmp_path, a_file, capsys):
    assert main(["calibrate", "--model", "tiny-llama", "-o", str(tmp_path)]) == 2
    assert f"-o/--output: {tmp_path} is a folder; give the file to write" in capsys.readouterr().err
    assert main(["calibrate", "--model", "tiny-llama", "-o", str(a_file / "c.yaml")]) == 2
    assert f"{a_file} is a file, not a folder" in capsys.readouterr().err
    out = str(tmp_path / "c.yaml")
    assert main(["calibrate", "--model", "tiny-llama", "-o", out, "--trace-dir", str(a_file)]) == 2
    assert "--trace-dir: " in capsys.readouterr().err


@pytest.mark.parametrize("change, field", [
    ({"workload__n": 1_000_000}, "workload.n: must be in [1, 16384]"),
    ({"workload__requests": 1_000_000_000_000}, "workload.requests: at most 10,000,000 requests"),
    ({"workload__requests": 1000, "workload__prompt_tokens": 10**9},
     "workload.prompt_tokens: 1,000 requests draw 1,000,000,000,000 prompt tokens"),
])
def test_impossible_workloads_are_named_errors(tmp_path, capsys, change, field):
    path = write_yaml(tmp_path / "c.yaml", tiny(**change))
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err
    assert not out.exists()  # nothing written (the folder this run would have created is gone)


def test_a_config_without_model_is_an_error(tmp_path, capsys):
    cfg = tiny()
    del cfg["model"]
    path = write_yaml(tmp_path / "c.yaml", cfg)
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "model: required field is missing" in capsys.readouterr().err
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--set", "model=tiny-llama"]) == 0


@pytest.mark.parametrize("target", ["/sys/servetwin_x", "/proc/servetwin_x"])
def test_run_output_the_os_refuses_names_the_flag(tmp_path, capsys, target):
    path = write_yaml(tmp_path / "c.yaml", tiny())
    assert main(["run", str(path), "-o", target, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "servetwin run: error: -o/--output: cannot create" in err


def test_workload_options_a_backend_cannot_honour_are_errors(tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny(workload__timeout_s=1.0, backends=["sim", "torch"]))
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "workload.timeout_s: client timeouts are only modelled by the sim backend" in capsys.readouterr().err
    scenario = tmp_path / "events.json"
    scenario.write_text(json.dumps({
        "settings": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_gpu_blocks": 64},
        "requests": [{"id": "r0", "prompt_token_ids": [1, 2, 3], "max_tokens": 4}],
        "aborts": [{"step": 1, "id": "r0"}]}))
    cfg = tiny(workload={"scenario": str(scenario), "arrival": {"type": "offline"}})
    path = write_yaml(tmp_path / "s.yaml", cfg)
    assert main(["run", str(path), "-o", str(tmp_path / "out2"), "--no-progress"]) == 2
    assert "uses scenario events" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["engine", "sweep"])
def test_a_vllm_argument_not_supported_yet_says_so(tmp_path, capsys, where):
    # the case read "unknown key (did you mean tensor_parallel_size?)"
    cfg = tiny(engine__enable_lora=True) if where == "engine" else \
        tiny(sweep={"engine.cpu_offload_gb": [1, 2]})
    path = write_yaml(tmp_path / "c.yaml", cfg)
    assert main(["sweep" if where == "sweep" else "run", str(path), "-o", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    key = "engine.enable_lora" if where == "engine" else "sweep.engine.cpu_offload_gb"
    assert f"{key}: vLLM's {key.rsplit('.', 1)[1]}" in err and "not supported yet" in err
    assert "did you mean" not in err and "Traceback" not in err


def test_data_parallel_size_in_a_single_engine_yaml_points_at_the_cluster_section(tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny(engine__data_parallel_size=2))
    assert main(["run", str(path), "-o", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "engine.data_parallel_size: vLLM's data_parallel_size is set per instance in a cluster section" in err
    assert "did you mean" not in err and "Traceback" not in err
