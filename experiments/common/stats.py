"""Statistics over repeated runs (seeds): mean, spread and Student-t confidence bounds.

Runs with different seeds are independent draws of the same workload, so a summary metric over N seeds
is N independent samples; its mean gets the usual t interval `mean +- t(1 - a/2, N - 1) * s / sqrt(N)`.
The t quantile is computed here (regularised incomplete beta, Numerical Recipes' continued fraction)
so that the base install needs no scipy.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t (bisection on the CDF; |error| < 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return 0.5 * (lo + hi)


def _finite(values: Iterable[Any]) -> list[float]:
    out = []
    for v in values:
        if isinstance(v, bool) or v is None:
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x):
            out.append(x)
    return out


def mean_ci(values: Iterable[Any], level: float = 0.95,
            within: tuple[Optional[float], Optional[float]] = (0.0, None)) -> dict[str, Optional[float]]:
    """Mean, sample standard deviation, min/max and the two-sided `level` t interval of the mean.
    Missing values (None, NaN) are left out; `n` says how many counted. One value: no interval.
    `within`: the quantity's physical bounds, where the interval is clipped (default: >= 0, as every
    latency, rate, load and share is; two seeds' t interval otherwise reaches below zero)."""
    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return {"mean": None, "std": None, "ci_lo": None, "ci_hi": None, "min": None, "max": None, "n": 0}
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "std": None, "ci_lo": None, "ci_hi": None, "min": mean, "max": mean, "n": 1}
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
    lo, hi = within
    return {"mean": mean, "std": std, "ci_lo": mean - half if lo is None else max(lo, mean - half),
            "ci_hi": mean + half if hi is None else min(hi, mean + half), "min": min(xs), "max": max(xs), "n": n}


def mean_bound(values: Iterable[Any], confidence: float, upper: bool = True) -> Optional[float]:
    """One-sided `confidence` bound on the mean: with probability `confidence` the true mean is below
    (upper=True) / above the returned value. One value: the value itself (no spread to bound)."""
    xs = _finite(values)
    n = len(xs)
    if n == 0:
        return None
    mean = sum(xs) / n
    if n == 1:
        return mean
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(confidence, n - 1) * std / math.sqrt(n)
    return mean + half if upper else mean - half
