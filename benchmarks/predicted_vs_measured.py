"""Run every `experiments/configs/compare_*.yaml` (predicted vs measured) and print one summary table.

    python benchmarks/predicted_vs_measured.py [-o runs/pvm] [--repeats 2] [--calibration FILE]
                                               [--only NAME ...] [--calibrate] [--from-run-calibration] [--retry-contended K]

Prints the load average before and after each comparison (other processes on a shared machine make
the measured side slower; `comparison.json` also reports the per-step CPU share). With
`--from-run-calibration` it also fits a calibration on the torch trace of the offline comparison
(`servetwin calibrate --from-run`) and re-scores the other configs with it (calibrate on one workload,
evaluate on the others).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _row(name: str, r: dict) -> str:
    s, n = r["step_abs_pct_error"], (r.get("noise") or {})
    ns = n.get("step_abs_pct_error") or {}
    e2e = r["e2e_signed_pct_error"]["p50"]
    e2e_noise = ((n.get("e2e_pct_error") or {}).get("p50") or {}).get("mean")
    span_noise = (n.get("makespan_pct_error") or {}).get("mean")
    probe = (r.get("calibration_probe") or {}).get("signed_pct_error_median")

    def f(v, signed=False):
        return "-" if v is None else (f"{v:+.2f}" if signed else f"{v:.2f}")

    return (f"| {name} | {r['mode']} | {r['steps']} | {f(s['p50'])} | {f(s['p90'])} | {f(ns.get('p50'))} | "
            f"{f(ns.get('p90'))} | {f(r['makespan_signed_pct_error'], True)} | {f(span_noise)} | {f(e2e, True)} | "
            f"{f(e2e_noise)} | {f(r['throughput_signed_pct_error'], True)} | "
            f"{r['identical_step_share'] * 100:.0f}% | {f(r['contention']['median_cpu_share'])} | "
            f"{r['load_average']['before'][0]:.2f}/{r['load_average']['after'][0]:.2f} | "
            f"{len(r.get('discarded_repeats') or [])} | {f(probe, True)} |")


HEADER = ("| config | mode | steps | step p50 % | step p90 % | noise p50 % | noise p90 % | makespan % | "
          "makespan noise % | E2E p50 % | E2E p50 noise % | throughput % | identical steps | CPU share | "
          "load 1m before/after | discarded repeats | probe drift % |\n|" + "---|" * 17)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", default=os.path.join(ROOT, "runs", "pvm"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--calibration", default=None,
                   help="a calibration file for every config (default: theirs, `hardware: auto` - this "
                        "machine's, measured on first use; the example fitted elsewhere: "
                        "experiments/calibrations/cpu_smollm2-135m.yaml)")
    p.add_argument("--only", nargs="*", help="config stems to run (default: every compare_*.yaml)")
    p.add_argument("--from-run-calibration", action="store_true")
    p.add_argument("--calibrate", action="store_true",
                   help="first re-measure the designed calibration into --calibration (servetwin calibrate)")
    p.add_argument("--retry-contended", type=int, default=2,
                   help="passed to `servetwin compare`: re-run repeats that lost their CPU (default 2)")
    args = p.parse_args()
    configs = sorted(glob.glob(os.path.join(ROOT, "experiments", "configs", "compare_*.yaml")))
    if args.only:
        configs = [c for c in configs if os.path.splitext(os.path.basename(c))[0] in args.only]
    cli = [sys.executable, "-m", "servetwin.experiments.cli"]

    def run_all(calibration: "str | None", tag: str) -> list[str]:
        rows = []
        for cfg in configs:
            name = os.path.splitext(os.path.basename(cfg))[0]
            out = os.path.join(args.output, tag, name)
            print(f"[{tag}] {name}: load {_load()}", file=sys.stderr, flush=True)
            given = ["--calibration", calibration] if calibration else []
            rc = subprocess.call(cli + ["compare", cfg, "-o", out, *given,
                                        "--repeats", str(args.repeats), "--retry-contended",
                                        str(args.retry_contended)], cwd=ROOT)
            if rc != 0:
                rows.append(f"| {name} | FAILED (exit {rc}) |")
                continue
            with open(os.path.join(out, "comparison.json")) as f:
                rows.append(_row(name, json.load(f)))
        return rows

    if args.calibrate:
        args.calibration = args.calibration or os.path.join(args.output, "calibration.yaml")
        print(f"[calibrate] load {_load()}", file=sys.stderr, flush=True)
        subprocess.check_call(cli + ["calibrate", "--model", "smollm2-135m", "--dtype", "bfloat16", "--threads", "1",
                                     "--trace-dir", os.path.join(args.output, "calibration_trace"),
                                     "-o", args.calibration], cwd=ROOT)
    tables = {"designed calibration": run_all(args.calibration, "designed")}
    if args.from_run_calibration:
        off = os.path.join(args.output, "designed", "compare_smollm2_offline")
        cal = os.path.join(args.output, "cal_from_offline_run.yaml")
        subprocess.check_call(cli + ["calibrate", "--model", "smollm2-135m", "--dtype", "bfloat16",
                                     "--from-run", off, "-o", cal], cwd=ROOT)
        tables["calibrated on the offline workload's trace"] = run_all(cal, "from_offline_run")
    for title, rows in tables.items():
        print(f"\n### {title}\n\n{HEADER}")
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
