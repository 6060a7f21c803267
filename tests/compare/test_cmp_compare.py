"""`servetwin compare` on tiny-llama: offline (identical steps, all keys), online, and refusing a mismatch."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pandas as pd
import pytest
from cmptest_helpers import CALIBRATIONS, REQUIRED_KEYS, read_json, tiny_config

import servetwin.experiments.compare.compare as cmpmod
import servetwin.experiments.calibrate.torch_measure as measuremod
from servetwin.experiments.cli import main
from servetwin.sim.cost_model import CostModel
from servetwin.sim.model_spec import load_model_spec

TINY_CAL = str(CALIBRATIONS / "cpu_tiny-llama.yaml")


def _check_stats(d: dict, keys=("p50", "p90", "mean")) -> None:
    for k in keys:
        assert isinstance(d[k], float) and math.isfinite(d[k]) and d[k] >= 0, (k, d)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    cfg = tiny_config(tmp / "off.yaml", hardware="cpu")  # the preset; --calibration replaces it
    out = tmp / "out"
    rc = main(["compare", str(cfg), "-o", str(out), "--calibration", TINY_CAL, "--repeats", "2"])
    return rc, out


def test_offline_compare_identical_steps_and_all_keys(offline_run):
    rc, out = offline_run
    assert rc == 0
    res = read_json(out / "comparison.json")
    for key in REQUIRED_KEYS:
        assert key in res, key
    assert res["mode"] == "offline"
    assert res["identical_composition"] is True and res["identical_step_share"] == 1.0
    sim_steps = pd.read_parquet(out / "sim" / "steps.parquet")
    assert res["steps"] == len(sim_steps) > 5
    _check_stats(res["step_abs_pct_error"])
    assert set(res["by_phase"]) <= {"prefill", "decode", "mixed"} and "decode" in res["by_phase"]
    for stats in res["by_phase"].values():
        _check_stats(stats)
    assert sum(s["count"] for s in res["by_phase"].values()) == res["steps"] * 2  # steps x repeats
    assert res["makespan_pct_error"] == pytest.approx(abs(res["makespan_signed_pct_error"]))
    for name in ("ttft", "tpot", "e2e"):
        _check_stats(res[f"{name}_pct_error"], ("p50", "p90", "p99"))
    assert res["throughput_pct_error"] >= 0
    assert res["calibration"].endswith("cpu_tiny-llama.yaml")
    assert res["calibration_provenance"]["model"] == "tiny-llama"
    assert res["repeats"] == 2 and len(res["per_repeat"]) == 2 and res["torch_threads"] == 1
    # machine noise: measured vs measured between the two repeats
    _check_stats(res["noise"]["step_abs_pct_error"])
    assert res["noise"]["makespan_pct_error"]["pairs"] == 1
    for name in ("comparison.md", "step_scatter.png", "step_residuals.png", "timeline_overlay.png",
                 "latency_cdf.png", "steps_paired.parquet", "torch/steps.parquet", "torch_r1/steps.parquet"):
        assert (out / name).is_file(), name
    md = (out / "comparison.md").read_text()
    assert "per-step abs. error p50" in md and "Identical in every repeat: **True**" in md


def test_offline_pairs_match_the_traces_and_the_calibration(offline_run):
    _, out = offline_run
    res = read_json(out / "comparison.json")
    paired = pd.read_parquet(out / "steps_paired.parquet")
    sim = pd.read_parquet(out / "sim" / "steps.parquet")
    torch_runs = [pd.read_parquet(out / d / "steps.parquet") for d in ("torch", "torch_r1")]
    assert len(paired) == 2 * len(sim)
    for r, t in enumerate(torch_runs, start=1):
        p = paired[paired.repeat == r].set_index("step")
        assert list(p.index) == sim.step.tolist() == t.step.tolist()
        assert np.allclose(p.predicted_s, sim.duration_s) and np.allclose(p.measured_s, t.duration_s)
        assert (t.annotation.to_numpy() == sim.annotation.to_numpy()).all()
    # the headline p50 is the median of the paired absolute errors
    assert res["step_abs_pct_error"]["p50"] == pytest.approx(float(np.median(paired.abs_pct_error)))
    # the simulator really used the calibration: its durations are that cost model on the torch compositions
    cm = CostModel(load_model_spec("tiny-llama"), TINY_CAL, cuda_graphs=False)
    frames = {n: pd.read_parquet(out / "torch" / f"{n}.parquet") for n in ("steps", "step_requests", "requests")}
    assert np.allclose(cmpmod.predicted_durations(frames, cm), sim.duration_s.to_numpy(), rtol=1e-9)
    # makespan error is the sim's makespan against the median of the measured ones
    spans = [t.t_end_s.max() for t in torch_runs]
    expect = (sim.t_end_s.max() - np.median(spans)) / np.median(spans) * 100
    assert res["makespan_signed_pct_error"] == pytest.approx(expect)


def test_compare_refuses_differing_offline_compositions(tmp_path, monkeypatch, capsys):
    real = cmpmod.sim_engine_args

    def skewed(exp, torch_info):  # the simulator's scheduler gets a smaller token budget
        args = real(exp, torch_info)
        args.max_num_batched_tokens = 48
        return args

    monkeypatch.setattr(cmpmod, "sim_engine_args", skewed)
    cfg = tiny_config(tmp_path / "off.yaml")
    out = tmp_path / "out"
    assert main(["compare", str(cfg), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "step sequences differ at recorded step #0" in err
    assert "sim ran engine step 0" in err and "torch ran engine step 0" in err
    res = read_json(out / "comparison.json")
    assert res["identical_composition"] is False and res["first_differing_step"] == 0
    assert "step_abs_pct_error" not in res  # nothing is scored


def test_first_difference_names_the_step():
    def frames(tokens_at_3):
        steps = pd.DataFrame({"step": range(6), "num_preempted": [0] * 6,
                              "annotation": [f"a{i}" for i in range(6)]})
        sr = pd.DataFrame({"step": [0, 1, 2, 3, 4, 5], "request_id": ["r"] * 6,
                           "num_tokens": [10, 1, 1, tokens_at_3, 1, 1], "num_computed_before": [0, 10, 11, 12, 13, 14]})
        return {"steps": steps, "step_requests": sr}

    assert cmpmod.first_difference(frames(1), frames(1)) is None
    idx, msg = cmpmod.first_difference(frames(1), frames(2))
    assert idx == 3 and "recorded step #3" in msg and "r:1@12" in msg and "r:2@12" in msg
    short = frames(1)
    short["steps"] = short["steps"].iloc[:4]
    idx, msg = cmpmod.first_difference(frames(1), short)
    assert idx == 4 and "no step (the run had ended)" in msg
    assert cmpmod.identical_share(frames(1), short) == (4 / 6, 4)


def test_online_compare_reports_divergence_and_latency_errors(tmp_path):
    cfg = tiny_config(tmp_path / "on.yaml", workload__arrival={"type": "poisson", "rate": 150.0},
                      workload__requests=10)
    out = tmp_path / "out"
    assert main(["compare", str(cfg), "-o", str(out), "--calibration", TINY_CAL, "--no-plots"]) == 0
    res = read_json(out / "comparison.json")
    for key in REQUIRED_KEYS:
        assert key in res, key
    assert res["mode"] == "online"
    assert 0.0 <= res["identical_step_share"] <= 1.0
    assert res["identical_composition"] == (res["identical_step_share"] == 1.0)
    _check_stats(res["step_abs_pct_error"])
    for name in ("ttft", "tpot", "e2e"):
        _check_stats(res[f"{name}_pct_error"], ("p50", "p90", "p99"))
    assert res["noise"] is None  # one repeat: no measured-vs-measured figure
    # the per-step error of online runs is the cost model on each measured step's own composition
    paired = pd.read_parquet(out / "steps_paired.parquet")
    torch_steps = pd.read_parquet(out / "torch" / "steps.parquet")
    assert len(paired) == len(torch_steps) == res["steps"]
    # the simulator replayed the same arrival times
    sreq = pd.read_parquet(out / "sim" / "requests.parquet").set_index("request_id").sort_index()
    treq = pd.read_parquet(out / "torch" / "requests.parquet").set_index("request_id").sort_index()
    assert np.allclose(sreq.arrival_s, treq.arrival_s) and sreq.arrival_s.max() > 0


def test_compare_config_errors_name_the_field(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "bad.yaml", engine__max_num_seq=4)
    assert main(["compare", str(cfg), "-o", str(tmp_path / "o")]) == 2
    assert "engine.max_num_seq" in capsys.readouterr().err
    cfg = tiny_config(tmp_path / "ok.yaml")
    assert main(["compare", str(cfg), "-o", str(tmp_path / "o"), "--calibration", str(tmp_path / "nope.yaml")]) == 2
    assert "--calibration" in capsys.readouterr().err


def test_contended_repeats_are_flagged_and_retried(tmp_path, monkeypatch):
    real = measuremod.cpu_timed
    calls = {"n": 0}

    @contextlib.contextmanager
    def first_run_starved(executor, cpu_s):
        """The first measured run "loses its CPU" in every step, the others get all of it (set through
        the executor's step_observers after the real one, so the machine's own load does not matter)."""
        calls["n"] += 1
        starved = calls["n"] == 1
        with real(executor, cpu_s):
            def fake_cpu(so, out):
                # all of it: twice the executor's step time, so that a loaded machine, where the recorded
                # step (scheduling included) outlasts the executor's, cannot make it look contended
                cpu_s[so.step] = 0.0 if starved else 2.0 * out.timing.duration_s

            executor.step_observers.append(fake_cpu)
            try:
                yield
            finally:
                executor.step_observers.remove(fake_cpu)

    monkeypatch.setattr(measuremod, "cpu_timed", first_run_starved)
    cfg = tiny_config(tmp_path / "off.yaml")
    out = tmp_path / "out"
    assert main(["compare", str(cfg), "-o", str(out), "--no-plots", "--retry-contended", "1"]) == 0
    res = read_json(out / "comparison.json")
    assert len(res["discarded_repeats"]) == 1 and res["discarded_repeats"][0]["contended_step_share"] == 1.0
    assert res["repeats"] == 1 and res["contention"]["contended_step_share"] < 0.5
    assert calls["n"] == 2
    # without retries the contended run is kept, and says so
    calls["n"] = 0
    assert main(["compare", str(cfg), "-o", str(tmp_path / "out2"), "--no-plots", "--retry-contended", "0"]) == 0
    res = read_json(tmp_path / "out2" / "comparison.json")
    assert res["discarded_repeats"] == [] and res["contention"]["contended_step_share"] == 1.0
    assert "lost their core" in (tmp_path / "out2" / "comparison.md").read_text()
