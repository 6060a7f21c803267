"""`servetwin calibrate`: fitting on synthetic step times through the CLI path, a real quick run, --from-run."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
from cmptest_helpers import tiny_config

import servetwin.experiments.calibrate.calibrate as calmod
import servetwin.experiments.calibrate.design as designmod
from servetwin.experiments.cli import main
from servetwin.sim.coefficients import CostCoefficients
from servetwin.sim.cost_model import CostModel, StepSummary, curve_fraction
from servetwin.sim.hardware import load_hardware
from servetwin.sim.model_spec import load_model_spec

# the "true" machine of the synthetic test (tiny-llama, fp32, the cpu preset's peaks)
TRUTH = {"c_step": 2.0e-3, "c_req": 1.5e-4, "c_token": 8.0e-6, "c_linear": 3.0, "c_attn_prefill": 2.0,
         "c_attn_decode": 4.0, "c_attn_shared": 1.0, "c_lm_head": 1.5}
PROVENANCE_FIELDS = ("source", "calibrated", "date", "device", "versions", "model", "dtype", "attention_backend",
                     "cuda_graphs", "torch_threads", "samples", "residuals", "design", "measured")


def _synthetic_step(noise: float, outliers: dict[int, float]):
    """A `_Driver.step` that runs the real engine but reports a duration from TRUTH's cost model;
    `outliers[k]` slows the k-th recorded step by that factor (its CPU time stays that of the normal step)."""
    truth = CostModel(load_model_spec("tiny-llama", dtype="float32"), "cpu", cuda_graphs=False,
                      coefficients=CostCoefficients(**{**CostCoefficients().to_dict(), "c_layer": 0.0, **TRUTH}))
    rng = np.random.default_rng(7)
    state = {"t": 0.0, "k": 0}  # k: recorded steps so far (warm-up steps are not recorded)

    def step(self):
        result = self.engine.step()
        so, mro = result.scheduled, result.model_output
        dur = 1e-6
        if so is not None and so.total_num_scheduled_tokens:
            sampled = {rid for rid, toks in zip(mro.req_ids, mro.sampled_token_ids) if toks}
            rows = [(q, so.num_computed_before[rid], rid in sampled) for rid, q in so.num_scheduled_tokens.items()]
            summary = dataclasses.replace(StepSummary.from_rows(rows), shared_kv=so.shared_kv_tokens)
            dur = truth.predict(summary).duration_s * (1 + noise * rng.standard_normal())
            slow = outliers.get(state["k"], 1.0) if self.recorder is not None else 1.0
            state["k"] += self.recorder is not None
            self.cpu_s[so.step] = dur  # a slowed step lost its CPU meanwhile: its CPU time stays
            dur *= slow
        t0 = state["t"]
        state["t"] += dur
        if self.recorder is not None:
            self.recorder.on_step(result, t0, state["t"])
        return result

    return step, truth


@pytest.fixture
def no_link_measurements(monkeypatch):
    """The synthetic tests check the fit of the steps they fake; the CPU calibration's gloo all-reduce and
    TP=2 step measurements after the fit (two worker launches each, about half of such a test's time) run for
    real, end to end, in test_calibrate_real_quick_run_and_use_in_experiment and are checked in
    tests/experiments/test_calibrate_allreduce.py."""
    monkeypatch.setattr(calmod, "calibrate_allreduce", lambda *args: None)
    monkeypatch.setattr(calmod, "calibrate_tp_step", lambda *args: None)


@pytest.mark.usefixtures("no_link_measurements")
def test_calibrate_cli_recovers_synthetic_coefficients(tmp_path, monkeypatch):
    step, truth = _synthetic_step(noise=0.0, outliers={})
    monkeypatch.setattr(designmod._Driver, "step", step)
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "--model", "tiny-llama", "--backend", "torch", "--design", "quick", "--no-trim",
                 "--no-gemm-curve", "-o", str(out)]) == 0  # the truth is on the preset's smooth GEMM basis
    hw = load_hardware(str(out))
    fitted = hw.coefficients
    res = hw.provenance["residuals"]
    # exact data: the fit reproduces every step and recovers the identified coefficients
    assert res["all_samples"]["max_abs_rel_err"] < 1e-6
    for name in ("c_step", "c_req", "c_token", "c_attn_prefill", "c_attn_decode", "c_attn_shared"):
        assert getattr(fitted, name) == pytest.approx(TRUTH[name], rel=1e-3), name
    assert fitted.c_layer == 0.0  # eager CPU: folded into c_step, not left at the preset's placeholder
    # predictions with the written file equal the truth on shapes outside the design
    cm = CostModel(load_model_spec("tiny-llama", dtype="float32"), str(out), cuda_graphs=False)
    for rows in ([(200, 0, True)], [(1, 300, True)] * 12, [(37, 50, False), (1, 90, True), (1, 7, True)]):
        assert cm.predict(rows).duration_s == pytest.approx(truth.predict(rows).duration_s, rel=1e-4)


@pytest.mark.usefixtures("no_link_measurements")
def test_calibrate_drops_contended_and_outlier_steps(tmp_path, monkeypatch):
    # the 20th and 30th recorded steps are 3x slow and lost their CPU (contended)
    step, _ = _synthetic_step(noise=0.01, outliers={20: 3.0, 30: 3.0})
    monkeypatch.setattr(designmod._Driver, "step", step)
    out = tmp_path / "cal.yaml"
    trace = tmp_path / "trace"
    assert main(["calibrate", "--model", "tiny-llama", "--design", "quick", "--trace-dir", str(trace),
                 "--no-gemm-curve", "-o", str(out)]) == 0
    prov = load_hardware(str(out)).provenance
    assert prov["contention"]["contended_steps"] == 2
    assert prov["residuals"]["dropped_as_contended"] == 2
    used = prov["residuals"]["used_samples"]
    assert used["median_abs_rel_err"] < 0.02 and used["max_abs_rel_err"] < 0.06  # 1% noise only
    assert prov["residuals"]["all_samples"]["max_abs_rel_err"] > 0.6  # 3x slow: -67%, reported, not hidden
    assert prov["samples"] == len(pd.read_parquet(trace / "steps.parquet"))


def test_fit_from_tables_trims_outliers_without_contention_info():
    cm = CostModel(load_model_spec("tiny-llama", dtype="float32"), "cpu", cuda_graphs=False)

    def truth(rows):
        return 1e-3 + 2e-4 * len(rows) + 5e-6 * sum(q for q, _, _ in rows) + cm.basis(rows)["attn_prefill"]

    rng = np.random.default_rng(3)
    steps, sreq = [], []
    for k in range(60):
        rows = [(int(rng.integers(1, 200)), int(rng.integers(0, 300)), True) for _ in range(int(rng.integers(1, 6)))]
        if k % 3 == 0:
            rows = [(1, int(rng.integers(1, 500)), True) for _ in range(int(rng.integers(1, 9)))]
        dur = truth(rows) * (1 + 0.005 * rng.standard_normal())
        if k in (5, 17):
            dur *= 4  # two disturbed steps
        steps.append({"step": k, "duration_s": dur, "num_context_reqs": int(any(q > 1 for q, _, _ in rows)),
                      "num_generation_reqs": int(any(q == 1 for q, _, _ in rows))})
        sreq += [{"step": k, "num_tokens": q, "num_computed_before": s, "samples": smp} for q, s, smp in rows]
    cal = calmod.fit_from_tables(pd.DataFrame(steps), pd.DataFrame(sreq), cm, trim=4.0)
    assert cal.summary["dropped_as_outliers"] == 2
    assert not cal.used[5] and not cal.used[17]
    assert cal.summary["used_samples"]["p90_abs_rel_err"] < 0.02
    fitted = CostModel(cm.model, cm.hw, cuda_graphs=False, coefficients=cal.fit.to_coefficients())
    for rows in ([(150, 20, True)], [(1, 400, True)] * 7, [(64, 0, False), (1, 33, True)]):
        assert fitted.predict(rows).duration_s == pytest.approx(truth(rows), rel=0.02)


def test_calibrate_real_quick_run_and_use_in_experiment(tmp_path):
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "--model", "tiny-llama", "--design", "quick", "--threads", "1", "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Written by `servetwin calibrate`")
    hw = load_hardware(str(out))
    prov = hw.provenance
    for field in PROVENANCE_FIELDS:
        assert field in prov, field
    assert prov["calibrated"] is True and prov["model"] == "tiny-llama" and prov["torch_threads"] == 1
    assert prov["dtype"] == "float32" and prov["attention_backend"] == "torch-paged" and prov["cuda_graphs"] is False
    assert {"torch", "servetwin", "python"} <= set(prov["versions"])
    assert prov["samples"] >= 40
    assert 0 <= prov["residuals"]["all_samples"]["median_abs_rel_err"] < 1
    # the layer GEMMs timed at every token count the design schedules: the curve the fit used
    curve = hw.efficiency.gemm_m_curve
    ms = [m for m, _ in curve]
    assert ms[:64] == list(range(1, 65)) and ms[-1] == prov["design"]["max_num_batched_tokens"]
    assert all(0 < f <= 1 for _, f in curve)
    assert sorted(int(m) for m in prov["gemm_m_curve"]["seconds"]) == [int(m) for m in ms]
    cm = CostModel(load_model_spec("tiny-llama", dtype="float32"), hw, cuda_graphs=False)
    assert cm.basis([(7, 0, True)])["linear"] == pytest.approx(max(
        2 * cm.model.num_layers * cm.model.layer_matmul_params * 7 / (hw.peak_flops_fp32 * curve_fraction(curve, 7)),
        cm.model.num_layers * cm.model.layer_params * 4 / hw.memory_bandwidth))
    # self-contained: carries the base preset's peaks as well as `base: cpu`
    base = load_hardware("cpu")
    assert "base: cpu" in text and hw.memory_bandwidth == base.memory_bandwidth
    assert hw.peak_flops_fp32 == base.peak_flops_fp32
    # usable as an experiment's `hardware:`; the simulator then predicts with the fitted coefficients
    cfg = tiny_config(tmp_path / "exp.yaml", hardware=str(out), backends=["sim"])
    run = tmp_path / "run"
    assert main(["run", str(cfg), "-o", str(run), "--no-progress", "--no-plots"]) == 0
    steps = pd.read_parquet(run / "sim" / "steps.parquet")
    sr = pd.read_parquet(run / "sim" / "step_requests.parquet")
    cm = CostModel(load_model_spec("tiny-llama"), str(out), cuda_graphs=False)
    first = sr[sr.step == steps.step.iloc[0]]
    rows = list(zip(first.num_tokens, first.num_computed_before, first.samples))
    assert steps.duration_s.iloc[0] == pytest.approx(cm.predict(rows).duration_s, rel=1e-9)


def test_calibrate_from_run_fits_a_runs_torch_trace(tmp_path):
    cfg = tiny_config(tmp_path / "exp.yaml", backends=["torch"])
    run = tmp_path / "run"
    assert main(["run", str(cfg), "-o", str(run), "--no-progress", "--no-plots"]) == 0
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "--model", "tiny-llama", "--from-run", str(run), "-o", str(out)]) == 0
    prov = load_hardware(str(out)).provenance
    assert prov["source"].endswith(f"--from-run {run}")
    assert prov["samples"] == len(pd.read_parquet(run / "torch" / "steps.parquet"))
    assert prov["design"] is None


def test_calibrate_errors_name_the_option(tmp_path, capsys):
    assert main(["calibrate", "--model", "tiny-llama", "--design", "huge", "-o", str(tmp_path / "x.yaml")]) == 2
    assert "--design" in capsys.readouterr().err
    assert main(["calibrate", "--model", "tiny-llama", "--from-run", str(tmp_path), "-o", str(tmp_path / "x.yaml")]) == 2
    assert "--from-run" in capsys.readouterr().err
