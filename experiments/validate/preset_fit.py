"""Fit a hardware set's end-to-end parameters (GPU efficiencies, engine CPU terms) on `servetwin
validate` case directories: the search `benchmarks/fit_gpu_presets.py` and `servetwin calibrate
--from-vllm` both run.

The per-kernel efficiencies from public measurements stay fixed (servetwin.sim.gpu_calibration) unless
named; the parameters searched (default: every entry of FIT) move coordinate-wise on a log grid - or,
with a grid, every combination of the values given is run once and the best taken - minimising the
mean over cases of each case's mean |log(predicted / published)| over the figures the GPU side
determines (throughput/duration, TPOT/ITL, and TTFT where it is queueing-dominated). Figures the API
server dominates (a low-load TTFT, the 1000-request chat burst) are left to the front-end model.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Optional

from servetwin.experiments.validate.published import metric_group, validate_cases
from servetwin.sim.gpu_calibration import GPU_CALIBRATION

# (section, field, low, high): searched on a log grid between the bounds
FIT = [
    ("efficiency", "gemm_compute", 0.25, 0.86),  # at most A100's isolated-matmul fraction (MAMF 85.9%)
    ("efficiency", "gemm_half_m", 8.0, 1024.0),
    ("efficiency", "gemm_bandwidth", 0.6, 0.92),
    ("efficiency", "attn_decode_bandwidth", 0.25, 0.92),
    ("coefficients", "c_step", 2e-4, 4e-3),
    ("coefficients", "c_req", 1e-6, 1e-4),
]
# searched only when named
EXTRA = [
    ("efficiency", "attn_prefill_compute", 0.25, 0.9),
    ("efficiency", "attn_mixed_decode_rows", 1.0, 128.0),
    # MoE (benchmarks/published_moe): the MoE block's kernel floor and the MXFP4 expert kernel's rates
    ("coefficients", "c_moe_layer", 1e-6, 2e-4),
    ("moe_kernels.mxfp4", "mxfp4_bandwidth", 0.2, 0.95),
    ("moe_kernels.mxfp4", "mxfp4_compute", 0.1, 0.9),
    ("moe_kernels.mxfp4", "mxfp4_half_rows", 1.0, 256.0),
]
# figures left to the front-end model (API-server CPU and HTTP): not fitted here
# (gpt-oss's TP4/TP8 64-client TTFT left here while the API server's first output path, 150 us per streamed
# token, kept it above 90% busy; with the refitted one, docs/frontend_model.md, the GPU's queue sets it again)
FRONTEND_BOUND = {"B5_qwen3_14b_h100_random_128": "all", "B1_qwen3_8b_h100_sharegpt_c4": "TTFT"}
# one figure per group and case is enough: req_s, tot_tok_s and dur_s say the same thing
FIT_METRICS = ("dur_s", "req_s", "lat_ms", "tpot_mean", "tpot_p50", "itl_p50", "itl_p99", "ttft_mean", "ttft_p50")
Values = dict[tuple[str, str], float]


def hardware_mapping(values: Values, preset: str = "h100-sxm", start: Optional[dict[str, Any]] = None) -> dict:
    """The hardware mapping of `values` over the preset's calibration (or `start`: {"efficiency",
    "coefficients"} replacing it, e.g. a step-level fit's coefficients)."""
    cal = start or GPU_CALIBRATION[preset]
    eff, coef = dict(cal["efficiency"]), dict(cal["coefficients"])
    eff["moe_kernels"] = {k: dict(c) for k, c in eff.get("moe_kernels", {}).items()}
    for (section, name), v in values.items():
        if section.startswith("moe_kernels."):  # one field of one storage format's expert kernel
            fmt = section.removeprefix("moe_kernels.")
            eff["moe_kernels"][fmt][name.removeprefix(fmt + "_")] = v
        else:
            (eff if section == "efficiency" else coef)[name] = v
    return {"base": preset, "efficiency": eff, "coefficients": coef}


def _current(cal: dict[str, Any], section: str, name: str) -> float:
    if section.startswith("moe_kernels."):
        fmt = section.removeprefix("moe_kernels.")
        return float(cal["efficiency"]["moe_kernels"][fmt][name.removeprefix(fmt + "_")])
    return float((cal["efficiency"] if section == "efficiency" else cal["coefficients"])[name])


def start_values(params: list, preset: str, start: Optional[dict[str, Any]] = None) -> Values:
    cal = start or GPU_CALIBRATION[preset]
    return {(s, n): _current(cal, s, n) for s, n, _, _ in params}


def loss(results) -> float:
    per_case = []
    for r in results:
        skip = FRONTEND_BOUND.get(r.name)
        if skip == "all":
            continue
        if r.error:
            return math.inf
        errs = []
        for m, pub, p in r.rows:
            if m not in FIT_METRICS or p is None or p <= 0 or (skip and metric_group(m) == skip):
                continue
            errs.append(abs(math.log(p / pub)))
        if errs:
            per_case.append(sum(errs) / len(errs))
    return sum(per_case) / len(per_case) if per_case else math.inf


def evaluate(case_dir, values: Values, cases, preset: str, start: Optional[dict[str, Any]] = None):
    return validate_cases(case_dir, hardware=hardware_mapping(values, preset, start), only=cases)


def fit(case_dir, start_at: Values, cases, rounds: int, log: Callable[[str], None], params, preset: str,
        start: Optional[dict[str, Any]] = None) -> tuple[Values, float]:
    """Coordinate search from `start_at`: each round tries 4 log-grid moves per parameter, halving the step."""
    values = dict(start_at)
    best = loss(evaluate(case_dir, values, cases, preset, start))
    for rnd in range(rounds):
        for section, name, lo, hi in params:
            key = (section, name)
            cur = values[key]
            span = (math.log(hi) - math.log(lo)) / (4 * (rnd + 1))
            for mult in (-2, -1, 1, 2):
                cand = min(hi, max(lo, math.exp(math.log(cur) + mult * span)))
                if cand == values[key]:
                    continue
                trial = {**values, key: cand}
                val = loss(evaluate(case_dir, trial, cases, preset, start))
                if val < best:
                    best, values = val, trial
            log(f"  round {rnd + 1} {name} = {values[key]:.4g} (loss {best:.4f})")
    return values, best


def grid_fit(case_dir, grid, cases, preset: str, log: Callable[[str], None]):
    """Every point of the grid ({(section, name): [values]}) run once on every case:
    {point: {case: CaseResult}}, point = the tuple of values in the grid's key order."""
    table = {}
    for point in itertools.product(*grid.values()):
        results = evaluate(case_dir, dict(zip(grid, point)), cases, preset)
        table[point] = {r.name: r for r in results}
        log(f"  grid {point}: loss {loss(results):.4f}")
    return table


def grid_best(table, names):
    return min(table, key=lambda point: loss([table[point][n] for n in names]))


def parse_grid(specs: list[str], flag: str = "--grid") -> dict[tuple[str, str], list[float]]:
    """{(section, name): [values]} from "NAME=V1,V2" specs over FIT + EXTRA, each value inside its
    parameter's bounds; a bad spec is a ValueError naming the flag and the spec."""
    known = {entry[1]: entry for entry in FIT + EXTRA}
    grid = {}
    for spec in specs:
        name, _, values = spec.partition("=")
        name = name.strip()
        if "," in name:
            raise ValueError(f"{flag} {spec!r}: one parameter per {flag}, e.g. gemm_compute=0.7,0.8")
        if name not in known:
            raise ValueError(f"{flag}: unknown parameter {name!r} (known: {', '.join(known)})")
        section, _, lo, hi = known[name]
        try:
            points = [float(v) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: values must be numbers, e.g. {name}=0.7,0.8") from None
        if any(not lo <= v <= hi for v in points):
            raise ValueError(f"{flag} {spec!r}: values must lie in [{lo}, {hi}]")
        grid[(section, name)] = points
    return grid


def grid_loo(case_dir, grid, selected, preset: str, log: Callable[[str], None]):
    """(in-sample results at the grid's best point, leave-one-case-out results): each left-out case is
    predicted at the grid point best without it; the grid runs once."""
    table = grid_fit(case_dir, grid, selected, preset, log)
    best = grid_best(table, selected)
    held = []
    for name, others in loo_cases(selected):
        point = grid_best(table, others)
        log(f"  without {name}: {dict(zip((n for _, n in grid), point))}")
        held.append(table[point][name])
    return dict(zip(grid, best)), [table[best][n] for n in selected], held


def loo_cases(selected):
    """(left-out case, the others) for every case the GPU fit sees."""
    return [(name, [c for c in selected if c != name]) for name in selected if FRONTEND_BOUND.get(name) != "all"]
