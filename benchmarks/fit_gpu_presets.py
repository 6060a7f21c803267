"""Fit a GPU preset's end-to-end parameters on a published-case directory; in-sample and
leave-one-case-out errors.

    .venv/bin/python benchmarks/fit_gpu_presets.py DIR [--loo] [--rounds 2]
    .venv/bin/python benchmarks/fit_gpu_presets.py benchmarks/published_cases --preset a100-80g \
        --grid gemm_compute=0.7,0.75,0.8,0.85 --grid attn_prefill_compute=0.4,0.45,0.5,0.55,0.6 \
        --match qwen3_14b_a100 --loo

The search is `servetwin.experiments.validate.preset_fit` (shared with `servetwin calibrate --from-vllm`);
this script prints its result. DIR has the shape `servetwin validate` reads (cases/*.yaml + published.json); `--match` keeps the
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
import sys
import time

from servetwin.experiments.validate import preset_fit
from servetwin.experiments.validate.preset_fit import (  # noqa: F401  (the fitting lives in the package)
    EXTRA, FIT, FIT_METRICS, FRONTEND_BOUND, evaluate, fit, hardware_mapping, loo_cases, loss, start_values)
from servetwin.experiments.validate.published import group_medians, load_published, render_table
from servetwin.sim.gpu_calibration import GPU_CALIBRATION


def parse_params(p, spec, flag="--params"):
    known = {entry[1]: entry for entry in FIT + EXTRA}
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"{flag}: unknown parameter {unknown[0]!r} (known: {', '.join(known)})")
    return [known[n] for n in names]


def parse_grid(p, specs):
    try:
        return preset_fit.parse_grid(specs)
    except ValueError as e:
        p.error(str(e))


def print_fit(title, values, best_loss, t0, results):
    print(f"fitted (in-sample{title}):")
    for (s, n), v in values.items():
        print(f"  {s}.{n}: {v:.4g}")
    print(f"loss {best_loss:.4f} ({time.perf_counter() - t0:.0f} s)\n")
    print(render_table(results))


def print_loo(held):
    print(render_table(held, "leave-one-case-out"))
    for g, v in group_medians(held).items():
        print(f"  LOO median |error| {g}: {'-' if v is None else f'{100 * v:.1f}%'}")


def main_grid(args, grid, selected, log) -> int:
    t0 = time.perf_counter()
    best, results, held = preset_fit.grid_loo(args.dir, grid, selected, args.preset, log)
    print_fit(", grid", best, loss(results), t0, results)
    if args.loo:
        print("\nleave-one-case-out (the grid's best point without the case, then the case at it):")
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
    start = start_values(params, args.preset)
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
