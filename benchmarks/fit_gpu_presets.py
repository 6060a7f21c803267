"""Fit a GPU preset's end-to-end parameters on a published-case directory; in-sample and
leave-one-case-out errors.

    .venv/bin/python benchmarks/fit_gpu_presets.py DIR [--loo] [--rounds 2]
    .venv/bin/python benchmarks/fit_gpu_presets.py benchmarks/published_cases --preset a100-80g \
        --grid gemm_compute=0.7,0.75,0.8,0.85 --grid attn_prefill_compute=0.4,0.45,0.5,0.55,0.6 \
        --match qwen3_14b_a100 --loo

DIR has the shape `servetwin validate` reads (cases/*.yaml + published.json); `--match` keeps the
cases whose name contains the string. The per-kernel efficiencies from public measurements stay
fixed (servetwin.sim.gpu_calibration); the parameters searched (`--params`, default: every entry of
FIT, the H100 set) move coordinate-wise on a log grid - or, with `--grid`, every combination of the
values given is run once and the best taken (leave-one-out then reuses those runs) - minimising the
mean over cases of each case's mean |log(predicted / published)| over the figures the GPU side
determines (throughput/duration, TPOT/ITL, and TTFT where it is queueing-dominated). Figures the
API server dominates (a low-load TTFT, the 1000-request chat burst) are left to the front-end model.
Prints the fitted values, then the validation table for the fitted set; `--loo` refits once per
left-out case and predicts it.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

from servetwin.experiments.published import (
    group_medians, load_published, metric_group, render_table, validate_cases)
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
# searched only when named in --params
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
FRONTEND_BOUND = {"B5_qwen3_14b_h100_random_128": "all", "B1_qwen3_8b_h100_sharegpt_c4": "TTFT",
                  # gpt-oss at 64 clients, TP 4/8: 6-8k streamed tokens/s keep the modelled API server's CPU
                  # above 90% busy, so its queue, not the GPU, sets the predicted TTFT
                  "M_h100_tp4_1024x1024_c64_v013": "TTFT", "M_h100_tp8_1024x1024_c64_v013": "TTFT"}
# one figure per group and case is enough: req_s, tot_tok_s and dur_s say the same thing
FIT_METRICS = ("dur_s", "req_s", "lat_ms", "tpot_mean", "tpot_p50", "itl_p50", "itl_p99", "ttft_mean", "ttft_p50")


def hardware_mapping(values: dict[tuple[str, str], float], preset: str = "h100-sxm") -> dict:
    cal = GPU_CALIBRATION[preset]
    eff, coef = dict(cal["efficiency"]), dict(cal["coefficients"])
    eff["moe_kernels"] = {k: dict(c) for k, c in eff.get("moe_kernels", {}).items()}
    for (section, name), v in values.items():
        if section.startswith("moe_kernels."):  # one field of one storage format's kernel
            fmt = section.removeprefix("moe_kernels.")
            eff["moe_kernels"][fmt][name.removeprefix(fmt + "_")] = v
        else:
            (eff if section == "efficiency" else coef)[name] = v
    return {"base": preset, "efficiency": eff, "coefficients": coef}


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


def evaluate(case_dir, values, cases, preset):
    return validate_cases(case_dir, hardware=hardware_mapping(values, preset), only=cases)


def fit(case_dir, start, cases, rounds, log, params, preset):
    values = dict(start)
    best = loss(evaluate(case_dir, values, cases, preset))
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
                val = loss(evaluate(case_dir, trial, cases, preset))
                if val < best:
                    best, values = val, trial
            log(f"  round {rnd + 1} {name} = {values[key]:.4g} (loss {best:.4f})")
    return values, best


def grid_fit(case_dir, grid, cases, preset, log):
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


def parse_params(p, spec, flag="--params"):
    known = {entry[1]: entry for entry in FIT + EXTRA}
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"{flag}: unknown parameter {unknown[0]!r} (known: {', '.join(known)})")
    return [known[n] for n in names]


def parse_grid(p, specs):
    grid = {}
    for spec in specs:
        name, _, values = spec.partition("=")
        entries = parse_params(p, name, "--grid")
        if len(entries) != 1:
            p.error(f"--grid {spec!r}: one parameter per --grid, e.g. gemm_compute=0.7,0.8")
        (section, _, lo, hi), = entries
        try:
            points = [float(v) for v in values.split(",")]
        except ValueError:
            p.error(f"--grid {spec!r}: values must be numbers, e.g. gemm_compute=0.7,0.8")
        if not points or any(not lo <= v <= hi for v in points):
            p.error(f"--grid {spec!r}: values must lie in [{lo}, {hi}]")
        grid[(section, name.strip())] = points
    return grid


def print_fit(title, values, best_loss, t0, results):
    print(f"fitted (in-sample{title}):")
    for (s, n), v in values.items():
        print(f"  {s}.{n}: {v:.4g}")
    print(f"loss {best_loss:.4f} ({time.perf_counter() - t0:.0f} s)\n")
    print(render_table(results))


def loo_cases(selected):
    """(left-out case, the others) for every case the GPU fit sees."""
    return [(name, [c for c in selected if c != name]) for name in selected if FRONTEND_BOUND.get(name) != "all"]


def print_loo(held):
    print(render_table(held, "leave-one-case-out"))
    for g, v in group_medians(held).items():
        print(f"  LOO median |error| {g}: {'-' if v is None else f'{100 * v:.1f}%'}")


def main_grid(args, grid, selected, log) -> int:
    t0 = time.perf_counter()
    table = grid_fit(args.dir, grid, selected, args.preset, log)
    best = grid_best(table, selected)
    results = [table[best][n] for n in selected]
    print_fit(", grid", dict(zip(grid, best)), loss(results), t0, results)
    if args.loo:
        print("\nleave-one-case-out (the grid's best point without the case, then the case at it):")
        held = []
        for name, others in loo_cases(selected):
            point = grid_best(table, others)
            log(f"  without {name}: {point}")
            held.append(table[point][name])
        print_loo(held)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--loo", action="store_true", help="also leave each case out, refit, predict it")
    p.add_argument("--preset", default="h100-sxm", choices=sorted(GPU_CALIBRATION),
                   help="the GPU preset whose values are the start and the rest of the set")
    p.add_argument("--params", help="comma-separated parameter names to search (default: the H100 set)")
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2,...",
                   help="search this parameter over these values, every combination (repeatable; "
                        "replaces the coordinate search)")
    p.add_argument("--match", help="only the cases whose name contains this string")
    args = p.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    params = parse_params(p, args.params) if args.params else FIT
    grid = parse_grid(p, args.grid)
    cases, _ = load_published(args.dir)
    selected = [c for c in cases if not args.match or args.match in c]
    if not selected:
        p.error(f"--match: no case name contains {args.match!r}")
    if grid:
        return main_grid(args, grid, selected, log)
    cal = GPU_CALIBRATION[args.preset]
    start = {(s, n): float((cal["efficiency"] if s == "efficiency" else cal["coefficients"])[n])
             for s, n, _, _ in params}
    t0 = time.perf_counter()
    values, best = fit(args.dir, start, selected, args.rounds, log, params, args.preset)
    print_fit("", values, best, t0, evaluate(args.dir, values, selected, args.preset))
    if args.loo:
        print("\nleave-one-case-out (refit without the case, then predict it):")
        held = []
        for name, others in loo_cases(selected):
            v_loo, _ = fit(args.dir, values, others, 1, lambda m: None, params, args.preset)
            held += evaluate(args.dir, v_loo, [name], args.preset)
            log(f"  {name}: refit done")
        print_loo(held)
    return 0


if __name__ == "__main__":
    sys.exit(main())
