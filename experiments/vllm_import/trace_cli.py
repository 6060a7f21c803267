"""`servetwin import vllm-trace` and `servetwin compare --measured TRACE... EXPERIMENT.yaml`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cmd_import_trace(args: argparse.Namespace) -> int:
    from servetwin.core.testbed.atomic import atomic_write_with  # noqa: PLC0415
    from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces  # noqa: PLC0415

    import pandas as pd  # noqa: PLC0415

    from servetwin.core.testbed.trace import REQUEST_COLUMNS, STEP_REQUEST_COLUMNS  # noqa: PLC0415

    steps = read_profiler_traces(args.traces, run=args.run)
    out = Path(args.output) / "measured"  # a run folder's layout: the trace-analysis notebook reads it
    out.mkdir(parents=True, exist_ok=True)
    tables = {"steps": steps, "step_requests": pd.DataFrame(columns=STEP_REQUEST_COLUMNS),
              "requests": pd.DataFrame(columns=REQUEST_COLUMNS)}  # a profiler trace has no per-request rows
    for name, table in tables.items():
        atomic_write_with(str(out / f"{name}.parquet"), lambda tmp, t=table: t.to_parquet(tmp, index=False))
    gpu = steps.gpu_duration_s.notna().all()
    print(f"{len(steps)} steps from {len(args.traces)} trace file(s) ({'GPU' if gpu else 'CPU'} durations); "
          f"wrote {out}/steps.parquet (trace-analysis notebook: RUN_DIR = {str(args.output)!r}, "
          f"BACKENDS = ['measured'])")
    return 0


def cmd_compare_measured(args: argparse.Namespace) -> int:
    """`servetwin compare --measured TRACE... EXPERIMENT.yaml`: predicted vs measured step time by phase."""
    from servetwin.experiments.vllm_import.measured_steps import (  # noqa: PLC0415
        by_phase, load_sim_experiment, match_steps, render_phases)
    from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces  # noqa: PLC0415

    if args.config is None and len(args.measured) > 1 and args.measured[-1].endswith((".yaml", ".yml")):
        args.config = args.measured.pop()  # `--measured T1 T2 EXPERIMENT.yaml`: the flag took the YAML too
    if args.config is None:
        raise ValueError("config: give the experiment YAML of the measured run (its workload and engine settings)")
    measured = read_profiler_traces(args.measured)
    exp = load_sim_experiment(args.config, args.overrides, hardware=args.calibration)
    matched = match_steps(measured, exp, log=lambda m: print(m, file=sys.stderr))
    table = by_phase(matched)
    print(render_phases(matched, table))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"measured": [str(p) for p in args.measured], "experiment": str(args.config),
               "matched_steps": len(matched.measured_index), "measured_steps": matched.measured_total,
               "simulated_steps": matched.simulated_total, "by_phase": table}
        (out / "measured_comparison.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out / 'measured_comparison.json'}", file=sys.stderr)
    return 0


def register(sub) -> None:
    t = sub.add_parser("vllm-trace", help="vLLM torch-profiler Chrome traces (one per rank, .json or .json.gz) "
                                          "-> a per-step table in servetwin's trace schema",
                       description="Reads every execute_context_X(a)_generation_Y(b) range: CPU duration, GPU "
                                   "duration (gpu_user_annotation), gap to the previous step, composition. "
                                   "Writes DIR/measured/steps.parquet (and empty per-request tables): a run "
                                   "folder the trace-analysis notebook reads with BACKENDS = ['measured'].")
    t.add_argument("traces", nargs="+", help="Chrome trace files, one per rank")
    t.add_argument("-o", "--output", required=True, help="folder for measured/steps.parquet")
    t.add_argument("--run", default="measured", help="run name in the table (default: measured)")
    t.set_defaults(func=_cmd_import_trace)
