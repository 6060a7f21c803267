"""Fit the H100 preset's end-to-end parameters on a published-case directory; in-sample and
leave-one-case-out errors.

    .venv/bin/python benchmarks/fit_gpu_presets.py DIR [--loo] [--rounds 2]

DIR has the shape `servetwin validate` reads (cases/*.yaml + published.json). The per-kernel
efficiencies from public measurements stay fixed (servetwin.sim.gpu_calibration); the parameters in
FIT below are searched coordinate-wise on a log grid, minimising the mean over cases of each case's
mean |log(predicted / published)| over the figures the GPU side determines (throughput/duration,
TPOT/ITL, and TTFT where it is queueing-dominated). Figures the API server dominates (a low-load
TTFT, the 1000-request chat burst) are left to the front-end model. Prints the fitted values, then
the validation table for the fitted set; `--loo` refits once per left-out case and predicts it.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from servetwin.experiments.published import (
    group_medians, load_published, metric_group, render_table, validate_cases)
from servetwin.sim.gpu_calibration import GPU_CALIBRATION

# (section, field, low, high): searched on a log grid between the bounds
FIT = [
    ("efficiency", "gemm_compute", 0.25, 0.8),
    ("efficiency", "gemm_half_m", 8.0, 1024.0),
    ("efficiency", "gemm_bandwidth", 0.6, 0.92),
    ("efficiency", "attn_decode_bandwidth", 0.25, 0.92),
    ("coefficients", "c_step", 2e-4, 4e-3),
    ("coefficients", "c_req", 1e-6, 1e-4),
]
# figures left to the front-end model (API-server CPU and HTTP): not fitted here
FRONTEND_BOUND = {"B5_qwen3_14b_h100_random_128": "all", "B1_qwen3_8b_h100_sharegpt_c4": "TTFT"}
# one figure per group and case is enough: req_s, tot_tok_s and dur_s say the same thing
FIT_METRICS = ("dur_s", "req_s", "lat_ms", "tpot_mean", "tpot_p50", "itl_p50", "itl_p99", "ttft_mean", "ttft_p50")


def hardware_mapping(values: dict[tuple[str, str], float]) -> dict:
    cal = GPU_CALIBRATION["h100-sxm"]
    eff, coef = dict(cal["efficiency"]), dict(cal["coefficients"])
    for (section, name), v in values.items():
        (eff if section == "efficiency" else coef)[name] = v
    return {"base": "h100-sxm", "efficiency": eff, "coefficients": coef}


def loss(results, exclude=()) -> float:
    per_case = []
    for r in results:
        if r.name in exclude:
            continue
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


def evaluate(case_dir, values, cases):
    return validate_cases(case_dir, hardware=hardware_mapping(values), only=cases)


def fit(case_dir, start, cases, rounds, log):
    values = dict(start)
    best = loss(evaluate(case_dir, values, cases))
    for rnd in range(rounds):
        for section, name, lo, hi in FIT:
            key = (section, name)
            cur = values[key]
            span = (math.log(hi) - math.log(lo)) / (4 * (rnd + 1))
            for mult in (-2, -1, 1, 2):
                cand = min(hi, max(lo, math.exp(math.log(cur) + mult * span)))
                if cand == values[key]:
                    continue
                trial = {**values, key: cand}
                val = loss(evaluate(case_dir, trial, cases))
                if val < best:
                    best, values = val, trial
            log(f"  round {rnd + 1} {name} = {values[key]:.4g} (loss {best:.4f})")
    return values, best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--loo", action="store_true", help="also leave each case out, refit, predict it")
    args = p.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    cases, _ = load_published(args.dir)
    cal = GPU_CALIBRATION["h100-sxm"]
    start = {(s, n): float((cal["efficiency"] if s == "efficiency" else cal["coefficients"])[n]) for s, n, _, _ in FIT}
    t0 = time.perf_counter()
    values, best = fit(args.dir, start, None, args.rounds, log)
    print("fitted (in-sample):")
    for (s, n), v in values.items():
        print(f"  {s}.{n}: {v:.4g}")
    print(f"loss {best:.4f} ({time.perf_counter() - t0:.0f} s)\n")
    results = evaluate(args.dir, values, None)
    print(render_table(results))
    if args.loo:
        print("\nleave-one-case-out (refit without the case, then predict it):")
        held = []
        for name in cases:
            if FRONTEND_BOUND.get(name) == "all":
                continue
            others = [c for c in cases if c != name]
            v_loo, _ = fit(args.dir, values, others, 1, lambda m: None)
            held += evaluate(args.dir, v_loo, [name])
            log(f"  {name}: refit done")
        print(render_table(held, "leave-one-case-out"))
        for g, v in group_medians(held).items():
            print(f"  LOO median |error| {g}: {'-' if v is None else f'{100 * v:.1f}%'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
