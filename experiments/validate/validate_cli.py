"""`servetwin validate DIR`: run every published case under DIR, print published vs predicted."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servetwin.experiments.validate.published import group_medians, load_published, render_table, validate_cases
from servetwin.experiments.config.schema import load_yaml
from servetwin.experiments.validate.cluster_stages import ranking_checks


def _loo_preset(args: argparse.Namespace) -> str:
    """The GPU preset whose calibration the leave-one-out grid varies: --hardware, else the cases' one."""
    from servetwin.sim.gpu_calibration import GPU_CALIBRATION  # noqa: PLC0415
    cases, _ = load_published(args.dir)
    names = {args.hardware} if args.hardware else {str(load_yaml(p).get("hardware")) for p in cases.values()}
    if len(names) != 1 or next(iter(names)) not in GPU_CALIBRATION:
        raise ValueError(f"--loo: the cases must share one calibrated GPU preset ({', '.join(sorted(GPU_CALIBRATION))}), "
                         f"got {', '.join(sorted(names))}; give --hardware")
    return names.pop()


def _print_loo(args: argparse.Namespace, grid: dict, preset: str, log) -> None:
    """Leave-one-case-out over the --loo grid (experiments/validate/preset_fit.py): each case at the grid point
    best on the others."""
    from servetwin.experiments.validate import preset_fit  # noqa: PLC0415
    cases, published = load_published(args.dir)
    selected = [c for c in cases if (not args.case or c in args.case) and not published[c].get("pending")]
    best, _, held = preset_fit.grid_loo(args.dir, grid, selected, preset, log)
    print("\nleave-one-case-out (each case predicted at the --loo grid's best point without it):\n")
    print(render_table(held))
    print("in-sample best point of the grid: " + ", ".join(f"{n} {v:g}" for (_, n), v in best.items()))


def _cmd_validate(args: argparse.Namespace) -> int:
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.quiet else (lambda msg: None)
    if args.loo:  # bad grid or mixed hardware: refused before any case runs
        if args.set:
            raise ValueError("--loo: not with --set (the grid's runs take the cases as they are)")
        from servetwin.experiments.validate.preset_fit import parse_grid  # noqa: PLC0415
        grid, preset = parse_grid(args.loo, "--loo"), _loo_preset(args)
    if args.runs and (args.hardware or args.set or args.loo):
        raise ValueError("--runs: not with --hardware, --set or --loo (the runs were made from the cases as they are)")
    results = validate_cases(args.dir, hardware=args.hardware, only=args.case or None,
                             overrides=args.set or None, log=log, runs_dir=args.runs)
    table = render_table(results)
    _, published = load_published(args.dir)
    ranks = ranking_checks(results, published)
    if ranks:
        table += "\n\nRankings the sources show:\n" + "\n".join(ranks)
    if any(entry.get("token_basis") for entry in published.values()):
        from servetwin.experiments.validate import token_basis  # noqa: PLC0415
        basis = token_basis.engine_basis_results(args.dir, results, overrides=args.set or None)
        table += ("\n\n## Engine-token basis\n\nThe tables above compare every figure as published. Below, "
                  "the figures that count output tokens are also put on the engine's basis (tokens decoded) with "
                  "the report's own counts (experiments/validate/token_basis.py); figures that cannot be "
                  "converted stand as published.\n\n" + token_basis.render_engine_basis(basis))
    print(table)
    if args.loo:
        _print_loo(args, grid, preset, log)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        header = (f"# Published vLLM measurements vs servetwin predictions\n\n"
                  f"Command: `servetwin validate {args.dir}"
                  + (f" --hardware {args.hardware}" if args.hardware else "") + "`\n\n")
        out.write_text(header + table + "\n", encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    med = group_medians(results)
    return 0 if all(r.error is None for r in results) and any(v is not None for v in med.values()) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="predict published vLLM runs (DIR/cases/*.yaml + DIR/published.json) "
                                               "and print the signed error per metric")
    p.add_argument("dir", help="case directory: cases/NAME.yaml experiments and published.json")
    p.add_argument("--hardware", help="run every case on this hardware preset or YAML file instead of its own")
    p.add_argument("--case", action="append", help="only this case (repeatable)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field in every case")
    p.add_argument("--loo", action="append", metavar="NAME=V1,V2,...",
                   help="also leave each case out: run this grid of a fitted parameter (repeatable; names as "
                        "benchmarks/fit_gpu_presets.py) and predict each case at the point best on the others")
    p.add_argument("--runs", metavar="RUNS_DIR", help="read each case's prediction from RUNS_DIR/NAME, an earlier "
                                                       "`servetwin run cases/NAME.yaml -o RUNS_DIR/NAME`, instead of running it")
    p.add_argument("-o", "--output", help="also write the table as Markdown to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-case progress lines")
    p.set_defaults(func=_cmd_validate)
