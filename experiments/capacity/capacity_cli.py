"""`servetwin capacity` (registered by `servetwin.experiments.cli`)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from servetwin.core.config_error import ConfigError

DEPLOYMENT_FLAGS = (("tp", "--tp"), ("router", "--router"), ("pd", "--pd"), ("pd_only", "--pd-only"),
                    ("prefill_tp", "--prefill-tp"), ("decode_tp", "--decode-tp"), ("max_prefill", "--max-prefill"),
                    ("max_decode", "--max-decode"))


def _given(args: argparse.Namespace, flags: tuple[tuple[str, str], ...]) -> list[str]:
    """The flags of `flags` ((argparse attribute, flag) pairs) the command line gave."""
    return [flag for attr, flag in flags if getattr(args, attr, None)]


def _check_deployment_flags(args: argparse.Namespace) -> None:
    """The deployment flags vary a cluster's deployment: on a config without a `cluster:` section they would
    do nothing, so they are refused, from the YAML as written (with its --set overrides)."""
    from servetwin.experiments.config.schema import load_raw_config  # noqa: PLC0415

    given = _given(args, DEPLOYMENT_FLAGS)
    if given and not load_raw_config(args.config, args.overrides).get("cluster"):
        raise ConfigError(given[0], "searches cluster deployments: only with a config that has a cluster: section")


# the load search's own flags (argparse attribute, flag), each None or [] unless given
LOAD_FLAGS = (("grid", "--grid"), ("seeds", "--seeds"), ("lo", "--lo"), ("hi", "--hi"), ("ray", "--ray"))


def _cluster_search(args: argparse.Namespace) -> str:
    """On a cluster config: "deployments" (the cheapest deployment at its load, the default) or "load" (`--over`:
    the highest load this deployment serves, as for one engine); a flag of the other search is refused."""
    given = _given(args, DEPLOYMENT_FLAGS)
    if args.over is not None:
        if given:
            raise ConfigError(given[0], "varies the deployment, which --over keeps: give one search (--over: the "
                                        "highest load of the config's deployment; without it: the cheapest "
                                        "deployment at the config's load)")
        return "load"
    loads = _given(args, LOAD_FLAGS)
    if loads:
        raise ConfigError(loads[0], "belongs to the search of the highest load: on a cluster config add --over "
                                    "workload.arrival.rate (without it, capacity searches the cheapest deployment "
                                    "at the config's load, one run per deployment)")
    return "deployments"


def _cmd_capacity(args: argparse.Namespace) -> int:
    from servetwin.experiments.capacity.capacity_report import (answer_line, length_line,  # noqa: PLC0415
                                                                limited_line, per_seed_line, winner_lines)
    from servetwin.experiments.capacity.capacity_run import parse_grid, run_capacity  # noqa: PLC0415
    from servetwin.experiments.run.run_cli import _load  # noqa: PLC0415
    from servetwin.experiments.run.run_folder import RunFolder, folder_summary_state  # noqa: PLC0415
    from servetwin.experiments.config.schema import seeds_for  # noqa: PLC0415
    from servetwin.experiments.config.slo import parse_slo_args  # noqa: PLC0415

    _check_deployment_flags(args)  # before _load: `hardware: auto` may calibrate for minutes first
    exp = _load(args)
    if exp.cluster is not None and _cluster_search(args) == "deployments":
        # the cheapest deployment at the config's load (experiments/capacity/deployments.py)
        from servetwin.experiments.capacity.deployments_cli import run_deployment_capacity  # noqa: PLC0415

        return run_deployment_capacity(args, exp, log=lambda msg: print(msg, file=sys.stderr))
    slo = parse_slo_args(args.slo) if args.slo else None  # SloError: a ConfigError naming the flag
    grid = parse_grid(args.grid)
    seeds = seeds_for(exp, args.seeds, args.max_runs) or None
    out = args.output or os.path.join("runs", f"{exp.name}.capacity")
    t0 = time.perf_counter()
    with RunFolder(out, overwrite=args.overwrite) as folder:
        try:
            answer = run_capacity(exp, out, knob=args.over, slo=slo, seeds=seeds, confidence=args.confidence,
                                  rel_tol=args.tol, grid=grid, jobs=args.jobs, ray=args.ray,
                                  retries=args.retries, lo=args.lo, hi=args.hi, max_probes=args.max_probes,
                                  max_extend=args.max_extend,
                                  progress=not args.no_progress, plots=not args.no_plots, folder=folder,
                                  max_runs=args.max_runs)
        except KeyboardInterrupt:
            state = folder_summary_state(out, "capacity.json")  # written last: the truth about the folder
            if state is None:
                print(f"interrupted: {out}/ has no capacity.json: interrupted before or while writing, its "
                      f"files are incomplete (written: {folder.describe()})", flush=True)
            else:
                print(f"interrupted: what the searches found so far is in {out}/capacity.md "
                      f"(capacity.json has \"interrupted\": {str(bool(state.get('interrupted'))).lower()})",
                      flush=True)
            raise
    unit = answer["unit"]
    for r in answer["searches"]:
        ci = r["per_seed_capacity_ci95"]
        seed_part = f"; per seed {per_seed_line(ci)} (95% CI)" if ci.get("ci_lo") is not None else ""
        name = f"{r['point']} [{r['backend']}]" if r["point"] != "base" else r["backend"]
        print(f"{name}: capacity {answer_line(r, unit)}, binding SLO {r['binding']}{seed_part}, {r['probes']} probes "
              f"(requests per probe run at the capacity: {length_line(r)})")
        print(f"{name}: {limited_line(r, unit)}")
    for line in winner_lines(answer)[:1]:
        print(line.replace("**", ""))
    print(f"wrote {out}/: {folder.describe()} in {time.perf_counter() - t0:.1f}s")
    return 1 if answer["interrupted"] or any(r["capacity"] is None for r in answer["searches"]) else 0


def register(subparsers) -> None:
    from servetwin.experiments.run.run_cli import _common, add_pool_args, add_seed_args  # noqa: PLC0415

    c = subparsers.add_parser(
        "capacity", help="the highest load meeting SLOs (noise-robust search over seeds)",
        description="Search the highest arrival rate (or closed-loop client count) at which the experiment "
                    "meets the SLOs with the given confidence over several seeds: bracket by doubling, then "
                    "k-section (docs/capacity.md). Writes capacity.md, capacity.json, probes.csv, capacity.png.")
    _common(c, default_output="runs/<name>.capacity")  # the folder _cmd_capacity writes
    c.add_argument("--slo", action="append", default=[], metavar="NAME=SECONDS",
                   help="an SLO, e.g. ttft_p99_s=0.5, tpot_p50_s=0.05 (or tpot_p50_ms=50), e2e_s=30 (per-request "
                        "deadline), min_attainment=0.9 (repeatable or comma-separated; replaces the config's `slo:`)")
    c.add_argument("--over", choices=["workload.arrival.rate", "workload.arrival.clients"],
                   help="the load to raise (default: the arrival's rate, or clients for closed_loop); on a cluster "
                        "config it asks for the highest load of its deployment instead of the cheapest deployment")
    add_seed_args(c)
    c.add_argument("--confidence", type=float, default=0.9,
                   help="a probe passes when every SLO holds at this one-sided confidence across seeds (0.9)")
    c.add_argument("--tol", type=float, default=0.02,
                   help="stop when the bracket is narrower than this share of the load (default 0.02)")
    c.add_argument("--grid", action="append", default=[], metavar="KEY=[V1,V2,...]",
                   help="search every combination, e.g. --grid engine.max_num_batched_tokens=[2048,8192] "
                        "(repeatable): which configuration serves the most")
    c.add_argument("--lo", type=float, help="a load to probe first (expected to pass)")
    c.add_argument("--hi", type=float, help="a load to probe first (expected to fail)")
    c.add_argument("--max-probes", type=int, default=40, help="probes per search at most (default 40)")
    c.add_argument("--max-extend", type=int, default=3, metavar="N",
                   help="times a probe meeting the SLO but not yet steady runs again at twice the requests "
                        "(default 3: up to 8x the probe's requests; 0: never)")
    add_pool_args(c, "probe run")
    d = c.add_argument_group("a cluster config: the cheapest deployment at its load (docs/cluster.md)")
    d.add_argument("--tp", help="tensor-parallel sizes per replica to try, e.g. 1,2,4 (default: the config's)")
    d.add_argument("--router", action="append", default=[], metavar="TYPE",
                   help="routers to try (repeatable; default: the config's); the config's settings where its type matches")
    d.add_argument("--max-replicas", type=int, default=16,
                   help="instances per deployment at most (default 16; also each role's limit with P/D)")
    d.add_argument("--pd", action="store_true",
                   help="search prefill/decode deployments too (P:D ratio, TP per role) from the config's instance "
                        "(the default when the config has prefill and decode instances)")
    d.add_argument("--pd-only", action="store_true", help="search prefill/decode deployments only")
    d.add_argument("--prefill-tp", help="P/D: TP sizes of a prefill instance to try, e.g. 1,2 (default: the config's)")
    d.add_argument("--decode-tp", help="P/D: TP sizes of a decode instance to try, e.g. 2,4 (default: the config's)")
    d.add_argument("--max-prefill", type=int, help="P/D: prefill instances at most (default --max-replicas)")
    d.add_argument("--max-decode", type=int, help="P/D: decode instances at most (default --max-replicas)")
    c.set_defaults(func=_cmd_capacity)
