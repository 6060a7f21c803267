"""NNLS and the coefficient fit."""
import dataclasses

import numpy as np
import pytest

from servetwin.sim.calibration import calibrated_hardware, fit_coefficients, nnls
from servetwin.sim.coefficients import BASIS_TERMS, CostCoefficients
from servetwin.sim.cost_model import CostModel, RowShape, StepSummary
from servetwin.sim.hardware import load_hardware, save_hardware


def test_nnls_satisfies_kkt_on_random_problems():
    rng = np.random.default_rng(0)
    for _ in range(100):
        m, n = int(rng.integers(3, 25)), int(rng.integers(1, 9))
        A, b = rng.normal(size=(m, n)), rng.normal(size=m)
        x, rnorm = nnls(A, b)
        w = A.T @ (b - A @ x)
        assert (x >= 0).all()
        assert (w <= 1e-9).all()                      # no descent direction into x >= 0
        assert np.allclose(w[x > 0], 0.0, atol=1e-9)  # stationarity on the active set
        assert rnorm == pytest.approx(np.linalg.norm(A @ x - b))


def test_nnls_exact_and_clamped_cases():
    A = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x, r = nnls(A, A @ np.array([2.0, 3.0]))
    assert np.allclose(x, [2.0, 3.0]) and r == pytest.approx(0.0, abs=1e-12)
    x, _ = nnls(np.eye(2), np.array([1.0, -5.0]))
    assert np.allclose(x, [1.0, 0.0])


def _synthetic_steps(seed=1, n=300):
    """Decode batches (up to 512 rows, so the LM head is sometimes compute-bound), prefill chunks
    after cached prefixes (some not sampling: partial prefills) and mixed batches."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(n):
        kind = rng.integers(0, 3)
        if kind == 0:  # some decode batches share prefix blocks
            summary = StepSummary.from_rows([RowShape(1, int(s)) for s in rng.integers(10, 8000, rng.integers(1, 513))])
            shared = int(rng.integers(0, summary.decode_sum_kv // 2)) if rng.integers(0, 2) else 0
            steps.append(dataclasses.replace(summary, shared_kv=shared))
        elif kind == 1:
            steps.append([RowShape(int(rng.integers(16, 8192)), int(rng.integers(0, 4096)),
                                   bool(rng.integers(0, 2)))])
        else:
            steps.append([RowShape(int(rng.integers(16, 2048)), 0, bool(rng.integers(0, 2)))]
                         + [RowShape(1, int(s)) for s in rng.integers(10, 4000, rng.integers(1, 64))])
    return steps


def test_fit_recovers_known_coefficients():
    truth = CostCoefficients(c_step=8e-4, c_req=2e-5, c_token=0.0, c_layer_piecewise=3e-5, c_linear=1.4,
                             c_attn_prefill=1.9, c_attn_decode=1.2, c_attn_shared=0.4, c_lm_head=1.1, c_comm=1.5)
    cm = CostModel("llama-3.1-8b", "h100-sxm", tp=2, cuda_graphs=True, coefficients=truth)
    steps = _synthetic_steps()
    rows = [cm.basis(s) for s in steps]
    exact = [cm.predict(s).duration_s for s in steps]
    # elementwise ~ token, sampler ~ sampling rows, tp_step ~ step at a fixed tp: collinear, left out
    # (a dense model: the MoE terms are 0 on every step)
    terms = [t for t in BASIS_TERMS if t not in ("elementwise", "sampler", "tp_step", "moe", "moe_layer")]
    fit = fit_coefficients(rows, exact, terms=terms)
    assert fit.unidentified == ["layer", "ipc_step", "ipc_req"]  # graphs on: no fully eager step
    assert fit.rank == 10  # step, req, token, layer_piecewise, linear, attn x3, lm_head, comm
    for term in ("step", "req", "layer_piecewise", "linear", "attn_prefill", "attn_decode", "attn_shared",
                 "lm_head", "comm"):
        assert fit.coefficients[term] == pytest.approx(truth.for_term(term), rel=1e-4), term
    assert fit.coefficients["token"] == pytest.approx(0.0, abs=1e-9)
    assert fit.max_abs_rel_err < 1e-6 and fit.r2 > 0.999999
    # 1% multiplicative noise: the dominant roofline multipliers are still recovered and the
    # fitted model predicts the noise-free times closely (c_step and c_lm_head are nearly
    # collinear - the LM head mostly reads the same weights every step - so not checked here).
    rng = np.random.default_rng(7)
    noisy = [t * (1 + 0.01 * rng.normal()) for t in exact]
    for weighting in ("absolute", "relative"):
        nfit = fit_coefficients(rows, noisy, terms=terms, weighting=weighting)
        for term in ("linear", "attn_prefill", "attn_decode"):  # (attn_shared shares decode steps' shape)
            assert nfit.coefficients[term] == pytest.approx(truth.for_term(term), rel=0.1), term
        refit = CostModel("llama-3.1-8b", "h100-sxm", tp=2, coefficients=nfit.to_coefficients())
        errs = [abs(refit.predict(s).duration_s - t) / t for s, t in zip(steps, exact)]
        assert np.median(errs) < 0.01


def test_unidentified_terms_keep_their_base_value():
    base = CostCoefficients(c_comm=1.7, c_ipc_req=3e-5)
    rows = [{"step": 1.0, "linear": x} for x in (0.001, 0.002, 0.004)]
    fit = fit_coefficients(rows, [0.0015, 0.0025, 0.0045])
    assert fit.coefficients == pytest.approx({"step": 5e-4, "linear": 1.0})
    assert fit.rank == 2
    merged = fit.to_coefficients(base)
    assert merged.c_comm == 1.7 and merged.c_ipc_req == 3e-5 and merged.c_linear == pytest.approx(1.0)


def test_fit_input_errors():
    with pytest.raises(ValueError, match="2 basis rows but 1"):
        fit_coefficients([{"step": 1}, {"step": 1}], [0.1])
    with pytest.raises(ValueError, match="> 0"):
        fit_coefficients([{"step": 1}], [0.0])
    with pytest.raises(ValueError, match="fit.weighting"):
        fit_coefficients([{"step": 1}], [0.1], weighting="log")


def test_calibrated_hardware_round_trips_with_provenance(tmp_path):
    hw = load_hardware("h200")
    rows = [{"step": 1.0, "linear": x} for x in (0.001, 0.002, 0.004)]
    fit = fit_coefficients(rows, [0.0012, 0.0022, 0.0042])
    new = calibrated_hardware(hw, fit, source="unit test", device="H200", model="qwen3-0.6b",
                              versions={"servetwin": "0.1.0"}, date="2025-01-01")
    assert new.provenance["calibrated"] is True and new.provenance["samples"] == 3
    assert new.provenance["residuals"]["max_abs_rel_err"] < 1e-9
    assert new.coefficients.c_step == pytest.approx(2e-4)
    assert hw.coefficients.c_step != new.coefficients.c_step  # the input is not modified
    back = load_hardware(str(save_hardware(new, tmp_path / "cal.yaml")))
    assert back == new


def test_collinear_terms_are_reported_by_rank():
    # every request samples and the LM head is weight-bound: lm_head = 3e-4 + 1e-6 * req
    rows = [{"step": 1.0, "req": float(r), "lm_head": 3e-4 + 1e-6 * r} for r in (1, 5, 50, 200)]
    fit = fit_coefficients(rows, [1e-3 + 2e-5 * r for r in (1, 5, 50, 200)])
    assert len(fit.coefficients) == 3 and fit.rank == 2
    assert fit.max_abs_rel_err < 1e-6  # predictions are still exact


def test_unidentified_shared_reads_take_the_decode_fit():
    """No step with shared prefix blocks: `attn_shared` cannot be fitted and is priced like any KV read."""
    rows = [{"step": 1.0, "attn_decode": x} for x in (0.001, 0.002, 0.004)]
    fit = fit_coefficients(rows, [0.0013, 0.0021, 0.0037], terms=["step", "attn_decode", "attn_shared"])
    assert fit.unidentified == ["attn_shared"]
    merged = fit.to_coefficients(CostCoefficients())
    assert merged.c_attn_shared == merged.c_attn_decode == pytest.approx(fit.coefficients["attn_decode"])


def test_hardware_files_without_a_shared_coefficient_keep_their_predictions(tmp_path):
    """A calibration written before `c_attn_shared` existed prices shared reads like decode reads."""
    path = tmp_path / "old.yaml"
    path.write_text("base: cpu\ncoefficients: {c_attn_decode: 14.0, c_step: 0.05}\n")
    hw = load_hardware(str(path))
    assert hw.coefficients.c_attn_shared == 14.0
    assert CostCoefficients(c_attn_decode=3.0).c_attn_shared == 3.0
    assert CostCoefficients(c_attn_decode=3.0, c_attn_shared=0.5).c_attn_shared == 0.5
