"""Fit the cost model's coefficients from measured steps by non-negative least squares.

`fit_coefficients(basis_rows, measured_s)` solves `min ||A c - t||` subject to `c >= 0`, where row i of
`A` is `CostModel.basis(step_i)` and `t_i` the measured duration. `weighting="relative"` divides
each row by `t_i` (minimises relative error, so short decode steps count as much as long prefills).
Terms whose column is zero in every row are not identified by the data: they are reported in
`unidentified` and keep their previous value in `FitResult.to_coefficients(base)`. Collinear
terms make the coefficients non-unique (predictions stay fine): `rank` below the number of fitted
terms, or a huge `condition_number`, says so. A common case: when every step's LM head is
weight-read bound and every request samples, `lm_head` is affine in `step` and `req`; steps with
partial prefills (rows that do not sample) and large decode batches separate them.

NNLS is Lawson & Hanson's active-set algorithm ("Solving Least Squares Problems", 1974, ch. 23) in
numpy, on column-normalised data; scipy is not required.
"""
from __future__ import annotations

import copy
import datetime as _dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from servetwin.sim.coefficients import BASIS_TERMS, CostCoefficients
from servetwin.sim.hardware import HardwareSpec


def nnls(A: np.ndarray, b: np.ndarray, max_iter: Optional[int] = None,
         tol: Optional[float] = None) -> tuple[np.ndarray, float]:
    """Lawson-Hanson NNLS: `argmin_x ||A x - b||_2` with `x >= 0`. Returns (x, residual norm)."""
    A = np.asarray(A, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = A.shape
    if b.shape != (m,):
        raise ValueError(f"nnls: b has shape {b.shape}, expected ({m},)")
    if tol is None:
        tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, float(np.abs(A).sum(axis=0).max(initial=0)))
    max_iter = max_iter or 3 * n + 30
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    w = A.T @ (b - A @ x)
    it = 0
    while (~passive).any() and (w[~passive] > tol).any():
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            it += 1
            if it > max_iter:
                raise RuntimeError("nnls: iteration limit reached")
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            bad = passive & (z <= tol)
            alpha = float(np.min(x[bad] / (x[bad] - z[bad])))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = A.T @ (b - A @ x)
    return x, float(np.linalg.norm(A @ x - b))


@dataclass(slots=True)
class FitResult:
    coefficients: dict[str, float]  # fitted terms only: {term: c}
    unidentified: list[str]  # terms with an all-zero column (left out of the fit)
    n_samples: int
    rank: int  # numerical rank of the (normalised) design; < len(coefficients): not unique
    condition_number: float
    weighting: str
    rmse_s: float
    mae_s: float
    mean_abs_rel_err: float
    median_abs_rel_err: float
    p90_abs_rel_err: float
    max_abs_rel_err: float
    r2: float
    residuals_s: list[float] = field(default_factory=list)  # predicted - measured, per row

    def to_coefficients(self, base: Optional[CostCoefficients] = None) -> CostCoefficients:
        """Fitted terms replace `base`'s; a term the data could not identify keeps `base`'s value,
        except `attn_shared`, which then takes `attn_decode`'s fit (no evidence that shared reads differ)."""
        values = (base or CostCoefficients()).to_dict()
        for term, c in self.coefficients.items():
            values[f"c_{term}"] = c
        if "attn_shared" not in self.coefficients and "attn_decode" in self.coefficients:
            values["c_attn_shared"] = self.coefficients["attn_decode"]
        return CostCoefficients(**values)

    def stats(self) -> dict[str, Any]:
        return {"samples": self.n_samples, "weighting": self.weighting, "rank": self.rank,
                "condition_number": self.condition_number, "rmse_s": self.rmse_s,
                "mae_s": self.mae_s, "mean_abs_rel_err": self.mean_abs_rel_err,
                "median_abs_rel_err": self.median_abs_rel_err,
                "p90_abs_rel_err": self.p90_abs_rel_err, "max_abs_rel_err": self.max_abs_rel_err,
                "r2": self.r2, "unidentified": list(self.unidentified)}


def fit_coefficients(basis_rows: Sequence[Mapping[str, float]], measured_s: Sequence[float],
                     terms: Optional[Iterable[str]] = None,
                     weighting: str = "absolute") -> FitResult:
    """NNLS fit of `measured_s ~ sum_k c_k * basis_rows[i][k]` over `terms` (default: all)."""
    terms = list(terms) if terms is not None else list(BASIS_TERMS)
    if len(basis_rows) != len(measured_s):
        raise ValueError(f"fit: {len(basis_rows)} basis rows but {len(measured_s)} measurements")
    if not basis_rows:
        raise ValueError("fit: no samples")
    if weighting not in ("absolute", "relative"):
        raise ValueError(f"fit.weighting: must be 'absolute' or 'relative', got {weighting!r}")
    t = np.asarray(measured_s, dtype=float)
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError("fit: measured durations must be finite and > 0")
    A = np.array([[float(row.get(k, 0.0)) for k in terms] for row in basis_rows])
    used = np.abs(A).sum(axis=0) > 0
    unidentified = [k for k, u in zip(terms, used) if not u]
    A_used = A[:, used]
    wts = 1.0 / t if weighting == "relative" else np.ones_like(t)
    Aw, tw = A_used * wts[:, None], t * wts
    scale = np.linalg.norm(Aw, axis=0)
    An = Aw / scale
    c_scaled, _ = nnls(An, tw)
    sv = np.linalg.svd(An, compute_uv=False)
    rank = int(np.sum(sv > sv[0] * max(An.shape) * np.finfo(float).eps)) if sv.size else 0
    cond = float(sv[0] / sv[-1]) if sv.size and sv[-1] > 0 else float("inf")
    c = c_scaled / scale
    fitted = {k: float(v) for k, v in zip([k for k, u in zip(terms, used) if u], c)}
    pred = A_used @ c
    res = pred - t
    rel = np.abs(res) / t
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    return FitResult(
        coefficients=fitted, unidentified=unidentified, n_samples=len(t), rank=rank,
        condition_number=cond, weighting=weighting,
        rmse_s=float(np.sqrt(np.mean(res ** 2))), mae_s=float(np.mean(np.abs(res))),
        mean_abs_rel_err=float(rel.mean()), median_abs_rel_err=float(np.median(rel)),
        p90_abs_rel_err=float(np.quantile(rel, 0.9)), max_abs_rel_err=float(rel.max()),
        r2=1.0 - float(np.sum(res ** 2)) / ss_tot if ss_tot > 0 else float("nan"),
        residuals_s=[float(r) for r in res])


def calibrated_hardware(hw: HardwareSpec, fit: FitResult, *, source: str, device: str,
                        versions: Mapping[str, str], model: str,
                        date: Optional[str] = None) -> HardwareSpec:
    """A copy of `hw` with the fitted coefficients and a provenance record of the fit."""
    new = copy.deepcopy(hw)
    new.coefficients = fit.to_coefficients(hw.coefficients)
    new.provenance = {
        "source": source, "calibrated": True,
        "date": date or _dt.date.today().isoformat(), "device": device,
        "versions": dict(versions), "model": model, "samples": fit.n_samples,
        "residuals": fit.stats(), "previous": copy.deepcopy(hw.provenance),
    }
    return new
