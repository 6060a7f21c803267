"""Grid-search front-end (API-server) coefficients on training case directories.

    .venv/bin/python benchmarks/fit_frontend.py benchmarks/published_moe PATH/TO/gpu_reference \
        --grid c_token_out_s=5e-6,1e-5,2e-5 --grid c_chunk_s=2e-5,3e-5,5e-5

Every combination of the `--grid` values (front-end coefficient names of
`servetwin.sim.frontend.FrontendCoefficients`, on top of `--base`, default the `vllm` preset) is run once
on every case of every DIR that has an API server (`frontend: {type: api_server}`; offline cases do
not depend on it), with the GPU presets as they are. The score of a point is the mean over cases of
each case's mean |log(predicted / published)| over all its published figures; the points are printed
best first with the median |error| per group of each DIR. Held-out directories
(`benchmarks/published_cases`) are refused: nothing is fitted on them.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import yaml

from servetwin.experiments.validate.published import group_medians, load_published, validate_cases
from servetwin.sim.frontend import COEFFICIENT_FIELDS

HELD_OUT = ("published_cases",)


def parse_grid(items: list[str]) -> dict[str, list[float]]:
    grid: dict[str, list[float]] = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in COEFFICIENT_FIELDS or not values:
            raise SystemExit(f"--grid {item!r}: expected NAME=V1,V2 with NAME one of {', '.join(COEFFICIENT_FIELDS)}")
        grid[name] = [float(v) for v in values.split(",")]
    return grid


def api_server_cases(case_dir: str) -> list[str]:
    cases, _ = load_published(case_dir)
    out = []
    for name, path in cases.items():
        frontend = (yaml.safe_load(Path(path).read_text()) or {}).get("frontend") or {}
        if frontend.get("type") == "api_server":
            out.append(name)
    return out


def case_score(result) -> float:
    errs = [abs(math.log(pred / pub)) for _, pub, pred in result.rows if pred and pub and pred > 0 and pub > 0]
    return sum(errs) / len(errs) if errs else math.inf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="training case directories (cases/*.yaml + published.json)")
    ap.add_argument("--grid", action="append", default=[], help="NAME=V1,V2,... (repeatable)")
    ap.add_argument("--base", default="vllm", help="front-end preset the grid values override")
    args = ap.parse_args(argv)
    for d in args.dirs:
        if any(part in HELD_OUT for part in Path(d).resolve().parts):
            raise SystemExit(f"{d}: held-out cases; fit on training directories only")
    grid = parse_grid(args.grid)
    only = {d: api_server_cases(d) for d in args.dirs}
    rows = []
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values))
        coeffs = ", ".join(f"{k}: {v!r}" for k, v in point.items())
        overrides = [f"frontend.coefficients={{base: {args.base}, coefficients: {{{coeffs}}}}}"]
        t0 = time.perf_counter()
        per_dir = {d: validate_cases(d, only=only[d], overrides=overrides) for d in args.dirs}
        scores = [case_score(r) for results in per_dir.values() for r in results]
        score = sum(scores) / len(scores)
        rows.append((score, point, {d: group_medians(r) for d, r in per_dir.items()}))
        print(f"{point} score {score:.4f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: r[0])
    for score, point, medians in rows:
        print(f"score {score:.4f}  " + "  ".join(f"{k}={v:g}" for k, v in point.items()))
        for d, med in medians.items():
            groups = " / ".join(f"{g} {100 * v:.1f}%" for g, v in med.items() if v is not None)
            print(f"    {Path(d).name}: {groups}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
