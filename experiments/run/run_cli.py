"""`servetwin run` and `servetwin sweep` (registered by `servetwin.experiments.cli`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _common(p: argparse.ArgumentParser, default_output: str = "runs/<name>") -> None:
    p.add_argument("config", help="experiment YAML (see experiments/configs/*.yaml)")
    p.add_argument("-o", "--output", help=f"output folder (default: {default_output})")
    p.add_argument("--backend", choices=["sim", "torch"], action="append",
                   help="run only this backend (repeatable); overrides the config's `backends`")
    p.add_argument("--requests", type=int, metavar="N",
                   help="override the number of requests (shared-prefix workloads: N // per_group groups; "
                        "file/scenario workloads: the first N)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field by its dotted path, e.g. --set engine.max_num_seqs=64 "
                        "(value parsed as YAML; repeatable)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the contents of a non-empty output folder (default: refuse it)")
    p.add_argument("--api-server-count", type=int, metavar="N",
                   help="sim: N API-server processes, each with its own CPU, requests spread over them "
                        "(vLLM's `vllm serve --api-server-count N`; docs/frontend_model.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def _load(args: argparse.Namespace):
    from servetwin.experiments.config.schema import load_config  # noqa: PLC0415

    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"backends=[{', '.join(args.backend)}]")
    if args.no_plots:
        overrides.append("output.plots=false")
    if args.api_server_count is not None:
        overrides.append(f"frontend.api_server_count={args.api_server_count}")
    notes: list[str] = []
    exp = load_config(args.config, overrides=overrides, requests=args.requests, notes=notes)
    from servetwin.experiments.presets.validation import preset_caveats  # noqa: PLC0415

    for note in notes + preset_caveats(exp):
        print(f"note: {note}", file=sys.stderr)
    return exp


def _cmd_run(args: argparse.Namespace) -> int:
    from servetwin.experiments.run.run_folder import RunFolder  # noqa: PLC0415
    from servetwin.experiments.run.experiment import run_experiment  # noqa: PLC0415

    exp = _load(args)
    out = args.output or os.path.join("runs", exp.name)
    if exp.sweep:
        print(f"note: {args.config} has a sweep grid; `servetwin run` runs its base values only "
              "(use `servetwin sweep` for the grid)", file=sys.stderr)
    t0 = time.perf_counter()
    seeds = _seeds(args, exp)
    measure = _measure_options(args)  # bad flags fail before the output folder is touched
    if seeds and measure != type(measure)():
        raise ValueError("--threads, --no-warmup, --retry-contended, --max-contended-share: not supported with "
                         "seeds (each seed's run uses the defaults: the calibration's threads, a warm-up, no retry)")
    if args.save_vllm_bench:
        if seeds:
            raise ValueError("--save-vllm-bench: not supported with seeds (one file describes one run)")
        from servetwin.experiments.config.schema import ensure_output_file  # noqa: PLC0415

        ensure_output_file(args.save_vllm_bench, "--save-vllm-bench")
    with RunFolder(out, overwrite=args.overwrite) as folder:
        if seeds:
            return _run_seeds(args, exp, out, seeds, t0, folder)
        try:
            combined = run_experiment(exp, out, progress=not args.no_progress, folder=folder, measure=measure)
        except KeyboardInterrupt:
            print(f"interrupted: {interrupted_state(folder)}", file=sys.stderr)
            raise
    from servetwin.experiments.common.units import format_seconds  # noqa: PLC0415

    for backend, s in combined["backends"].items():
        print(f"{backend}: {s['completed']}/{s['requests']} requests in {format_seconds(s['duration_s'])} "
              f"({'simulated' if backend == 'sim' else 'measured'}), output {s.get('output_tok_s') or 0:,.0f} tok/s "
              f"(total tokens {s['throughput_tok_s'] or 0:,.0f} tok/s), "
              f"TTFT p50 {format_seconds(s['ttft_s']['p50'])} p99 {format_seconds(s['ttft_s']['p99'])}, "
              f"TPOT p50 {format_seconds(s['tpot_s']['p50'])}, {s['preemptions']} preemptions"
              + (f", {s['aborted_sequences']} sequences aborted by the client timeout" if s.get("aborted_sequences") else ""))
        if s.get("slo"):
            print(f"{backend}: {slo_line(s['slo'])}")
        if s.get("binding"):
            print(f"{backend}: {s['binding']['line']}")
        if s.get("measurement"):
            c = s["measurement"]["contention"]
            print(f"{backend}: {100 * (c['contended_step_share'] or 0):.0f}% of the measured steps contended "
                  f"(median cpu_share {c['median_cpu_share'] or 0:.2f}, {s['measurement']['torch_threads']} "
                  "torch thread(s))")
    print(f"wrote {out}/: {folder.describe()} in {format_seconds(time.perf_counter() - t0)}")
    if args.save_vllm_bench:
        from servetwin.experiments.vllm_import.bench_writer import write_vllm_bench  # noqa: PLC0415

        print(f"wrote {', '.join(map(str, write_vllm_bench(exp, out, args.save_vllm_bench)))} (vllm bench serve JSON)")
    rejected = {b: s for b, s in combined["backends"].items() if s.get("rejected")}
    for backend, s in rejected.items():  # never servable (e.g. longer than max_model_len): say so, not "0/N"
        rid, why = next(iter((s.get("rejected_examples") or {"?": "?"}).items()))
        print(f"{'error' if s['rejected'] == s['requests'] else 'warning'}: {backend}: {s['rejected']} of "
              f"{s['requests']} requests were rejected as never servable, e.g. {rid}: {why}", file=sys.stderr)
    if any(s["rejected"] == s["requests"] for s in rejected.values()):
        return 2  # nothing was served: a config problem, and the run's figures mean nothing
    return 0


def _measure_options(args: argparse.Namespace):
    from servetwin.experiments.calibrate.torch_measure import MeasureOptions  # noqa: PLC0415

    return MeasureOptions(threads=args.threads, warmup=not args.no_warmup, retry_contended=args.retry_contended,
                          max_contended_share=args.max_contended_share)


def add_measure_args(p: argparse.ArgumentParser) -> None:
    """How the torch backend is measured (`servetwin.experiments.calibrate.torch_measure`)."""
    g = p.add_argument_group("torch backend measurement")
    g.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: the calibration's `torch_threads` when `hardware:` is a "
                        "calibration, else torch's default)")
    g.add_argument("--no-warmup", action="store_true",
                   help="no warm-up before the measured run (default: 4 short requests first, not recorded)")
    g.add_argument("--retry-contended", type=int, default=0, metavar="K",
                   help="run the torch backend again (at most K times in all) when more than "
                        "--max-contended-share of its steps lost their CPU to other processes (default 0)")
    g.add_argument("--max-contended-share", type=float, default=0.05, metavar="F",
                   help="share of contended steps above which a run is contended: warned about, and rerun "
                        "with --retry-contended (default 0.05)")


def interrupted_state(folder) -> str:
    """What an interrupted run really left (the summary, written last, is the truth)."""
    from servetwin.experiments.run.run_folder import folder_summary_state  # noqa: PLC0415

    state = folder_summary_state(folder.path)
    if state is None:
        return (f"{folder.path}/ has no summary.json: interrupted while writing, its files are incomplete "
                f"(written: {folder.describe()})")
    return f"partial results in {folder.path}/ (summary.json has \"interrupted\": {json.dumps(state.get('interrupted'))})"


def _run_seeds(args: argparse.Namespace, exp, out: str, seeds: list[int], t0: float, folder) -> int:
    from servetwin.experiments.sweep.sweep import run_seeded  # noqa: PLC0415

    try:
        df, stats = run_seeded(exp, out, seeds, jobs=args.jobs, progress=not args.no_progress, ray=args.ray,
                               retries=args.retries, folder=folder)
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted_state(folder)}", file=sys.stderr)
        raise
    from servetwin.experiments.common.md_tables import fmt_pm  # noqa: PLC0415

    for backend, s in stats.items():
        def show(col: str, scale: float = 1.0, unit: str = "") -> str:
            m = s[col]
            if m["mean"] is None:
                return "-"
            if m["ci_lo"] is None:
                return f"{m['mean'] * scale:.4g}{unit}"
            return fmt_pm(m["mean"], m["ci_lo"], m["ci_hi"], scale) + unit  # digits the interval justifies
        print(f"{backend}: {s['seeds_ok']}/{len(seeds)} seeds ok; throughput {show('throughput_tok_s')} tok/s, "
              f"TTFT p50 {show('ttft_p50_s', 1e3, ' ms')}, p99 {show('ttft_p99_s', 1e3, ' ms')} (mean ± 95% CI)")
    bad = df[df.status != "ok"]
    print(f"wrote {out}/: {folder.describe()} and {len(seeds)} seed=*/ run folders in {time.perf_counter() - t0:.1f}s")
    return 1 if len(bad) else 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from servetwin.experiments.run.run_folder import RunFolder  # noqa: PLC0415
    from servetwin.experiments.sweep.sweep import run_sweep  # noqa: PLC0415

    exp = _load(args)
    out = args.output or os.path.join("runs", exp.name)
    t0 = time.perf_counter()
    with RunFolder(out, overwrite=args.overwrite) as folder:
        try:
            df = run_sweep(exp, out, jobs=args.jobs, progress=not args.no_progress, seeds=_seeds(args, exp),
                           ray=args.ray, retries=args.retries, folder=folder, max_runs=args.max_runs)
        except KeyboardInterrupt:
            if os.path.exists(os.path.join(out, "sweep.csv")):
                print(f"interrupted: the table of finished points is in {out}/sweep.csv", file=sys.stderr)
            else:
                print(f"interrupted: {out}/ has no sweep.csv (interrupted while writing)", file=sys.stderr)
            raise
    from servetwin.experiments.sweep.sweep import bound_by_line  # noqa: PLC0415

    print(bound_by_line(df))
    bad = df[df.status != "ok"]
    print(f"wrote {out}/: {folder.describe()}, {df.point.nunique()} point folders ({len(df)} rows, "
          f"{len(bad)} not ok) in {time.perf_counter() - t0:.1f}s")
    return 1 if len(bad) else 0


def slo_line(ev: dict) -> str:
    """`SLO met (ttft_p99_s 310 ms <= 500 ms; ...), goodput 41.6 req/s` for the console."""
    from servetwin.experiments.common.units import format_seconds  # noqa: PLC0415

    parts = []
    for c in ev["checks"]:
        if c["kind"] == "target":
            v = format_seconds(c["value"])
            parts.append(f"{c['name']} {v} {'<=' if c['met'] else '>'} {format_seconds(c['limit'])}")
        elif c["kind"] == "attainment":
            v = "-" if c["value"] is None else f"{100 * c['value']:.1f}%"
            parts.append(f"deadlines met by {v} of requests ({'>=' if c['met'] else '<'} {100 * c['limit']:g}%)")
    good = ev.get("goodput_req_s")
    return (f"SLO {'met' if ev['met'] else 'MISSED'} ({'; '.join(parts)})"
            + (f", goodput {good:.4g} req/s" if good is not None else ""))


def _seeds(args: argparse.Namespace, exp) -> list[int]:
    from servetwin.experiments.config.schema import seeds_for  # noqa: PLC0415

    return seeds_for(exp, args.seeds, args.max_runs)


def add_pool_args(p: argparse.ArgumentParser, what: str = "point") -> None:
    """-j, --ray [ADDRESS], --retries: how the points run (`servetwin.experiments.sweep.pool`)."""
    p.add_argument("-j", "--jobs", type=int, default=1, help="parallel worker processes on this machine (default 1)")
    p.add_argument("--ray", nargs="?", const=True, default=None, metavar="ADDRESS",
                   help=f"run each {what} as a Ray task: without ADDRESS on a local Ray instance using this "
                        "machine's CPUs; with one (`auto`, host:6379, ray://host:10001) on that cluster "
                        "(needs `pip install 'servetwin[ray]'`; docs/ray.md)")
    p.add_argument("--retries", type=int, default=2,
                   help=f"rerun a {what} whose run raised or whose worker died up to this many times (default 2)")


def add_seed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, metavar="N",
                   help="repeat with N workload draws (seeds `seed`..`seed`+N-1; overrides the config's `seeds`)")
    p.add_argument("--max-runs", type=int, metavar="N",
                   help="allow up to N runs (sweep points x seeds, capacity grid points, --seeds); default 10,000, "
                        "checked before anything is expanded (docs/limits.md)")


def register(subparsers) -> None:
    r = subparsers.add_parser("run", help="run an experiment YAML on its backends (sim, torch)",
                              description="Run an experiment config: writes trace tables (Parquet), "
                                          "trace.json (Perfetto), summary.json, report.md and plots.")
    _common(r)
    r.add_argument("--save-vllm-bench", metavar="FILE",
                   help="also write the results as `vllm bench serve --save-result --save-detailed` JSON "
                        "(one file per backend: FILE, or FILE's stem + .<backend>.json)")
    add_seed_args(r)
    add_pool_args(r, "seed")
    add_measure_args(r)
    r.set_defaults(func=_cmd_run)
    s = subparsers.add_parser("sweep", help="run the grid in an experiment's `sweep:` (parallel workers)",
                              description="Run every combination of the config's `sweep:` lists, each in its "
                                          "own subfolder, then write sweep.csv, sweep.md and comparison plots.")
    _common(s)
    add_seed_args(s)
    add_pool_args(s)
    s.set_defaults(func=_cmd_sweep)
