"""`hardware: auto`: calibrated on first use, cached by a fingerprint of what changes CPU kernel speed,
recalibrated when it changes (a fake calibration is injected: no test measures a CPU here)."""
import pytest
import yaml
from exptest_helpers import CONFIGS, tiny, write_yaml

from servetwin.core.config_error import ConfigError
from servetwin.experiments.calibrate import auto_calibration as auto
from servetwin.experiments.config.schema import load_config, validate_config

CALIBRATION = CONFIGS.parent / "calibrations" / "cpu_tiny-llama.yaml"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Calibrations land in a temporary cache; each one 'measured' is a copy of the shipped example."""
    monkeypatch.setenv("SERVETWIN_CALIBRATIONS", str(tmp_path / "cache"))
    made = []

    def run(model, path, dtype, threads, log):
        made.append((model, dtype, threads))
        log("calibrate: 3 steps measured")
        with open(path, "w") as f:
            f.write(CALIBRATION.read_text())
    monkeypatch.setattr(auto, "_run_calibration", run)
    return made


def test_first_use_calibrates_with_progress_then_the_cache_is_read(fake, capsys):
    exp = validate_config(tiny(hardware="auto"))
    err = capsys.readouterr().err
    assert "no calibration of the CPU cost model for tiny-llama on this machine yet" in err
    assert "calibrate: 3 steps measured" in err and "calibrated in" in err
    assert fake == [("tiny-llama", "float32", 1)] and exp.hardware.endswith(".yaml")
    assert exp.hardware_spec.coefficients is not None and exp.raw["hardware"] == "auto"  # config.yaml keeps auto
    again = validate_config(tiny(hardware="AUTO"))
    assert again.hardware == exp.hardware and len(fake) == 1 and capsys.readouterr().err == ""


def test_a_changed_fingerprint_is_calibrated_anew(fake, monkeypatch):
    first = validate_config(tiny(hardware="auto")).hardware
    monkeypatch.setattr(auto, "isa_flags", lambda cpuinfo="/proc/cpuinfo": ["avx2"])  # another CPU class
    second = validate_config(tiny(hardware="auto")).hardware
    monkeypatch.setattr(auto, "torch_version", lambda: "9.9.9")
    third = validate_config(tiny(hardware="auto")).hardware
    monkeypatch.setattr(auto, "backend_digest", lambda: "0" * 12)  # the torch backend's code changed
    fourth = validate_config(tiny(hardware="auto")).hardware
    assert len({first, second, third, fourth}) == 4 and len(fake) == 4


def test_fingerprint_holds_what_changes_kernel_speed(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: Test CPU\nflags\t\t: fpu sse avx avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert auto.isa_flags(str(info)) == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert auto.isa_flags(str(tmp_path / "missing")) == []
    fp = auto.fingerprint("tiny-llama", "float32", 1)
    assert {"cpu_model", "isa_flags", "logical_cpus", "torch_threads", "torch", "dtype", "model",
            "torch_backend"} <= set(fp)
    assert len(fp["torch_backend"]) == 12 and fp["torch_backend"] == auto.backend_digest()
    assert auto.cache_path(fp) != auto.cache_path(dict(fp, dtype="bfloat16"))


def test_auto_is_for_cpus_and_needs_no_calibration_without_the_simulator(fake):
    with pytest.raises(ConfigError, match="hardware: auto calibrates this machine's CPU"):
        validate_config(tiny(hardware="auto", engine__device="cuda"))
    exp = validate_config(tiny(hardware="auto", backends=["torch"], engine__device="cpu"))
    assert exp.hardware == "cpu" and fake == []


def test_make_run_config_uses_auto_and_the_shipped_calibrations_are_examples(fake):
    raw = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    assert raw["hardware"] == "auto"
    assert load_config(CONFIGS / "default.yaml").hardware.startswith(str(auto.cache_dir()))


@pytest.mark.parametrize("name, preset", [("H100", "h100-sxm"), ("h100", "h100-sxm"), ("A100", "a100-80g"),
                                          ("H200", "h200"), ("L40S", "l40s")])
def test_hardware_names_are_case_insensitive(name, preset):
    assert validate_config(tiny(hardware=name)).hardware == preset


def test_an_unknown_hardware_name_suggests_one_and_the_template():
    with pytest.raises(ConfigError, match=r"did you mean h200\?.*docs/hardware_template.md"):
        validate_config(tiny(hardware="h20O"))


def test_the_documented_hardware_template_loads(tmp_path):
    text = (CONFIGS.parents[1] / "docs" / "hardware_template.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "l4.yaml"
    path.write_text(block)
    exp = validate_config(tiny(hardware=str(path), engine__num_gpu_blocks=None), base_dir=tmp_path)
    assert exp.hardware_spec.name == "l4" and exp.hardware_spec.memory_bandwidth == 300e9


def test_compare_refreshes_an_auto_calibration_the_probe_finds_drifted(fake):
    """Two probes beyond +-10% of drift, same direction: the machine no longer runs as calibrated, measured
    again (the cache keeps the new file); within the limit, unconfirmed, unknown, or a file the user
    gave: nothing is."""
    from servetwin.experiments.compare.compare import refresh_drifted_calibration

    exp = validate_config(tiny(hardware="auto"))
    assert auto.is_auto_calibration(exp.hardware) and len(fake) == 1
    logs = []
    for probe in ({"drift_pct": -9.5, "drift_pct_confirming": -30.0}, {"drift_pct": None}, None,
                  {"drift_pct": -24.0}, {"drift_pct": -24.0, "drift_pct_confirming": 20.0},  # not confirmed
                  {"drift_pct": -24.0, "drift_pct_confirming": -8.0}):
        assert refresh_drifted_calibration(exp, probe, 1, logs.append) is None
    rec = refresh_drifted_calibration(exp, {"drift_pct": -24.0, "drift_pct_confirming": -20.0}, 1, logs.append)
    assert len(fake) == 2 and rec["drift_before"] == -22.0 and rec["file"] == exp.hardware
    assert "-22.0% off its speed when calibrated" in logs[0] and "calibrate: 3 steps measured" in logs
    given = validate_config(tiny(hardware=str(CALIBRATION)))
    assert not auto.is_auto_calibration(given.hardware)
    assert refresh_drifted_calibration(given, {"drift_pct": 60.0, "drift_pct_confirming": 60.0}, 1, logs.append) is None
    assert len(fake) == 2


def test_drift_is_the_ratio_of_the_two_probes_so_the_models_own_error_cancels():
    from servetwin.experiments.calibrate.drift_probe import PROBE, PROBE_BLOCK_SIZE, drift_pct, probe_at_calibration

    assert drift_pct(-12.0, -12.0) == pytest.approx(0.0)  # the model is 12% low on these shapes both times
    assert drift_pct(-34.0, -12.0) == pytest.approx(-25.0)  # the same steps take 4/3 as long: 25% slower
    assert drift_pct(10.0, -12.0) == pytest.approx(25.0)
    assert drift_pct(None, 1.0) is None and drift_pct(1.0, None) is None
    own = {"drift_probe": {"signed_pct_error_median": -7.0, "design": dict(PROBE, block_size=PROBE_BLOCK_SIZE)}}
    assert probe_at_calibration(own) == -7.0
    other = {"drift_probe": {"signed_pct_error_median": -7.0, "design": dict(PROBE, repeats=9)}}
    assert probe_at_calibration(other) is None and probe_at_calibration({}) is None


def test_probe_drift_confirms_refreshes_and_probes_the_new_calibration(fake, monkeypatch):
    """compare's probe flow: a reading beyond the limit is probed again; confirmed, a candidate
    calibration is measured and judged (`judge_candidate`), and the probe is read against the one in force."""
    from types import SimpleNamespace

    from servetwin.experiments.compare import compare as cmp

    exp = validate_config(tiny(hardware="auto"))
    readings = iter([-30.0, -25.0, -2.0])
    probes, builds = [], []
    monkeypatch.setattr(cmp, "calibration_probe", lambda e, info, cm, frames=None: probes.append(cm) or {
        "steps": 10, "signed_pct_error_median": 0.0, "drift_pct": next(readings)})
    monkeypatch.setattr(cmp, "build_sim_engine", lambda e, info: builds.append(1) or (
        f"engine{len(builds)}", SimpleNamespace(executor=SimpleNamespace(cost_model=f"model{len(builds)}"))))
    monkeypatch.setattr(cmp, "judge_candidate", lambda e, info, engine, model, refresh, log: (
        refresh.update(adopted=True, probe_frames="frames") or ("engine-new", "model-new")))
    engine, probe, refresh = cmp.probe_drift(exp, None, 1, lambda m: None)
    assert engine == "engine-new" and probes == ["model1", "model1", "model-new"] and len(fake) == 2
    assert refresh["drift_before"] == -27.5 and refresh["drift_after"] == -2.0 and probe["drift_pct"] == -2.0
    readings = iter([-30.0, 4.0])  # not confirmed: nothing re-measured, the first engine kept
    engine, probe, refresh = cmp.probe_drift(exp, None, 1, lambda m: None)
    assert engine == "engine2" and refresh is None and probe["drift_pct_confirming"] == 4.0 and len(fake) == 2


@pytest.mark.parametrize("old_err,new_err,adopted", [(-30.0, 2.0, True), (-3.0, 8.0, False), (5.0, -5.0, False)])
def test_a_re_measured_calibration_is_adopted_only_if_it_predicts_a_fresh_probe_better(
        fake, monkeypatch, old_err, new_err, adopted):
    """The drift probe never makes things worse: the candidate replaces the cache only when one fresh
    probe, scored by both calibrations, finds it closer; otherwise the cached file and spec stay."""
    from types import SimpleNamespace

    from servetwin.experiments.calibrate import drift_probe
    from servetwin.experiments.compare import compare as cmp

    exp = validate_config(tiny(hardware="auto"))
    cached_text = open(exp.hardware).read()
    old_spec = exp.hardware_spec
    rec = cmp.refresh_drifted_calibration(exp, {"drift_pct": -24.0, "drift_pct_confirming": -20.0}, 1, lambda m: None)
    candidate = auto.candidate_path(exp.hardware)
    with open(candidate, "a") as f:
        f.write("# re-measured\n")
    monkeypatch.setattr(cmp, "build_sim_engine", lambda e, info: (
        "engine", SimpleNamespace(executor=SimpleNamespace(cost_model="new" if e.hardware_spec is not old_spec
                                                          else "old"))))
    monkeypatch.setattr(drift_probe, "measure_probe", lambda args, info: {"steps": "probe"})
    monkeypatch.setattr(drift_probe, "score_probe", lambda frames, model: {
        "signed_pct_error_median": {"old": old_err, "new": new_err}[model]})
    logs = []
    engine, model = cmp.judge_candidate(exp, None, "engine-old", "old", rec, logs.append)
    assert rec["adopted"] is adopted and model == ("new" if adopted else "old")
    assert engine == ("engine" if adopted else "engine-old")  # the cached one's engine is reused, not rebuilt
    assert not __import__("os").path.exists(candidate)
    assert (open(exp.hardware).read() == cached_text) is not adopted
    assert (exp.hardware_spec is old_spec) is not adopted
    assert ("replaces the cache" if adopted else "the cached one is kept") in logs[-1]


# -- issue 38 item 6: a poisoned or damaged cache, an uncreatable cache folder ----------------------------
@pytest.mark.parametrize("change,needle", [
    ({"c_lm_head": 1e30}, "coefficients.c_lm_head = 1e+30, outside [0, 100000]"),
    ({"c_step": -1.0}, "coefficients.c_step = -1.0, outside [0, 10]"),
    ({"c_token": float("nan")}, "coefficients.c_token = nan"),
    ("zero", "prices a step at 0 s"),
    ("text", "the cached calibration is unreadable"),
    ("dev-zero", "is not a regular file"),
])
def test_a_poisoned_cache_is_refused_naming_the_file_and_the_fix(fake, capsys, change, needle):
    from servetwin.experiments.cli import main

    path = auto.cache_path(auto.fingerprint("tiny-llama", "float32", auto.THREADS))
    path.parent.mkdir(parents=True)
    doc = yaml.safe_load(CALIBRATION.read_text())
    if change == "zero":
        doc["coefficients"] = {k: 0.0 for k in doc["coefficients"]}
    elif isinstance(change, dict):
        doc["coefficients"].update(change)
    if change == "text":
        path.write_bytes(b"coefficients: [\x00\xff")
    elif change == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as err:
        validate_config(tiny(hardware="auto"))
    text = str(err.value)
    assert text.startswith("hardware: auto: ") and str(path) in text and needle in text, text
    assert f"delete {path}" in text or change == "dev-zero"
    assert not fake  # nothing re-measured behind the user's back
    cfg = write_yaml(path.parent.parent / "c.yaml", tiny(hardware="auto"))
    assert main(["run", str(cfg), "-o", str(path.parent.parent / "out")]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_an_uncreatable_cache_folder_exits_2_naming_the_variable(tmp_path, monkeypatch, capsys):
    from servetwin.experiments.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("SERVETWIN_CALIBRATIONS", str(blocker / "cache"))
    cfg = write_yaml(tmp_path / "c.yaml", tiny(hardware="auto"))
    assert main(["run", str(cfg), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot create the calibration cache folder" in err and "SERVETWIN_CALIBRATIONS" in err
