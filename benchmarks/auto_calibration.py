"""`make run`'s compare with the automatic CPU calibration (`hardware: auto`), on this machine.

    python benchmarks/auto_calibration.py [--rounds 2] [--threads N] [-o runs/bench-auto-calibration]

Each round: a fresh calibration cache (so the first use measures this machine, as on a new clone;
its wall time is reported), then `servetwin compare experiments/configs/default.yaml --repeats 3` (what `make run`
runs second), then the same compare with the shipped example calibration
(experiments/calibrations/cpu_smollm2-135m.yaml, fitted on another machine class) for reference.
Prints per-step |error| p50 / p90 and the signed makespan error of each, beside the targets of issue 37:
per-step p50 <= 10% and makespan within +-10%. (`make run` ran tiny-llama until issue 37; the figures below
up to 2026-12-05 are of that workload: 52 steps of 1-3 ms, too short to measure on this VM.) `--threads N` calibrates and measures
with N torch threads (another machine class: the fingerprint changes, so does the calibration).

Timing is noisy on a shared machine: the load average before and after each round is printed, and
the table gives each comparison's contended-step share (steps whose process lost its core to other
processes), the median CPU share of the measured steps and the per-step error over the uncontended
steps alone; with `--repeats` >= 2 (the default, as `make run`) the measured-vs-measured makespan noise
of the same compare, the floor no calibration can beat in that round.

Measured 2026-12-02 on the 2-vCPU AMD EPYC VM (AVX-512 + BF16), every other process paused during each
measurement (the load average still counts the paused ones):
- 02:57 UTC, the host quiet: 3 calibrations x 6 runs (`servetwin calibrate` then `compare --repeats 2`,
  alternating, one minute): 9 of 9 (calibration, run) pairs met both targets - per-step p50 4.3-7.4%,
  makespan -1.1% to -9.3%; measured-vs-measured 1.6-3.6% per step.
- 03:18-04:33 UTC, 20 rounds of this script (before and after the drift probe, the kernel decision kept
  per machine and the new native layer kernels): 4 met both targets (p50 7.1-11.0%, makespan -0.9% to
  -7.5%), 4 more missed by under 1.5 points; the others missed by 10-45 points. In the rounds with
  three measured runs the runs themselves were 1-24% apart in makespan (median ~10%) and identical
  decode steps switched between ~0.85 and ~1.6 ms within one run with nothing else of ours running
  (host steal 2%): the target is at or below this machine's own noise then.
- 06:23 UTC (after issue 23's CUDA-graph padding and the compiled build, measured pure), 2 rounds,
  everything else paused: the calibration's own fit had a 17% median error (quiet: a few %), the
  measured-vs-measured makespan noise was 23%; per-step p50 20.9% / 22.4%, makespan +3.8% / -26.7%
  (round 1 re-measured its calibration after drift probes of +16% and +40%): not met, with the machine's
  noise above the target.
- 07:47 and 09:32 UTC, 2 rounds each, everything else paused: per-step p50 56.2% / 36.1%, makespan +38.6% /
  +22.4%; then p50 10.4% / 21.3%, makespan -17.6% / +1.8% (drift probes -42% and +47%, re-measured).
- 10:16 and 10:31 UTC, 3 rounds each, everything else paused (load average 0.2-0.9): 0 of 6 rounds met both.
  Per-step p50 28.5 / 10.8 / 49.1% and 14.4 / 42.6 / 9.8%; makespan +13.0 / -11.7 / +42.3% and -20.5 / +24.6 /
  -13.4%; measured-vs-measured makespan noise within the same compares 32.7 / 9.4 / 29.2% and 11.5 / 4.3 / 7.9%;
  drift probes +44.9, -25.5, -5.1, +25.8, -14.6 and +63.4% a minute after calibrating. The one round whose
  compare was steady (4.3%) missed by 25%, with a drift of -14.6% (under the re-measure threshold) since its
  calibration: the machine changes speed between minutes as well as within a run.
- `--threads 2` (another machine class: its own fingerprint and calibration), 2 rounds: per-step p50
  5.2% / 9.3%, makespan -18.8% / -10.2%, run-to-run 5.5-6.6%.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from servetwin.experiments.calibrate.auto_calibration import THREADS, cache_path, fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "configs", "default.yaml")
EXAMPLE = os.path.join(ROOT, "experiments", "calibrations", "cpu_smollm2-135m.yaml")
MODEL, DTYPE = "smollm2-135m", "bfloat16"  # make run's model since issue 37 (tiny-llama before)
TARGET_STEP_P50, TARGET_MAKESPAN = 10.0, 10.0


def _compare(out: str, env: dict, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "servetwin.experiments.cli", "compare", CONFIG, "-o", out, "--overwrite",
           "--no-plots", *extra]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode not in (0, 1):  # 1: a target of compare's own (stricter) list missed
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "comparison.json")) as f:
        return json.load(f)


def _signed(x) -> str:
    return "-" if x is None else f"{x:+.1f}"


def _row(name: str, r: dict, cal_s: str) -> str:
    p50, p90 = r["step_abs_pct_error"]["p50"], r["step_abs_pct_error"]["p90"]
    span = r["makespan_signed_pct_error"]
    ok = p50 is not None and p50 <= TARGET_STEP_P50 and span is not None and abs(span) <= TARGET_MAKESPAN
    c = r["contention"]
    clean = c.get("step_abs_pct_error_uncontended") or {}
    clean_p50 = "-" if clean.get("p50") is None else f"{clean['p50']:.1f} ({clean['count']} steps)"
    probe = (r.get("calibration_probe") or {}).get("drift_pct")
    refresh = r.get("calibration_refresh")
    drift = "-" if probe is None else f"{probe:+.1f}"
    if refresh:  # `hardware: auto` re-measured the calibration: the drift before -> after
        drift = (f"{refresh['drift_before']:+.1f} -> {_signed(refresh.get('drift_after'))} "
                 f"(re-measured, {refresh['calibration_wall_s']:.0f} s)")
    noise = ((r.get("noise") or {}).get("makespan_pct_error") or {}).get("mean")
    return (f"| {name} | {cal_s} | {drift} | {p50:.1f} | {p90:.1f} | {span:+.1f} | {_signed(noise)[1:]} | {clean_p50} | "
            f"{100 * c['contended_step_share']:.0f}% | {c['median_cpu_share']:.2f} | {'yes' if ok else 'no'} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, help="torch threads for the calibration and the measured runs")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per compare (make run: 3); from 2 on, "
                   "the makespan noise column shows how far two measured runs are apart")
    p.add_argument("-o", "--output", default=os.path.join(ROOT, "runs", "bench-auto-calibration"))
    args = p.parse_args()
    rows = []
    for k in range(args.rounds):
        load = os.getloadavg()[0]
        env = dict(os.environ, SERVETWIN_CALIBRATIONS=tempfile.mkdtemp(prefix="bench-calibrations-"))
        env.pop("SERVETWIN_AUTO_CALIBRATION_DESIGN", None)
        threads = args.threads or THREADS
        t0 = time.perf_counter()  # the first use on a new machine: what `hardware: auto` measures
        subprocess.run([sys.executable, "-c", "from servetwin.experiments.calibrate.auto_calibration import ensure_calibration;"
                        f"ensure_calibration({MODEL!r}, {DTYPE!r}, {threads})"], env=env, check=True)
        cal_s = f"{time.perf_counter() - t0:.0f} s"
        extra = ["--repeats", str(args.repeats)]
        if args.threads:  # `hardware: auto` uses THREADS; another count: its own calibration, by path
            os.environ["SERVETWIN_CALIBRATIONS"] = env["SERVETWIN_CALIBRATIONS"]
            extra += ["--threads", str(threads), "--calibration",
                     str(cache_path(fingerprint(MODEL, DTYPE, threads)))]
        auto = _compare(os.path.join(args.output, f"auto-{k}"), env, extra)
        shipped = _compare(os.path.join(args.output, f"shipped-{k}"), env, extra[:4] + ["--calibration", EXAMPLE])
        rows += [_row(f"round {k + 1}: hardware auto", auto, cal_s),
                 _row(f"round {k + 1}: shipped example", shipped, "-")]
        print(f"round {k + 1}: load average {load:.2f} before, {os.getloadavg()[0]:.2f} after", flush=True)
    print(f"\ntargets: per-step p50 <= {TARGET_STEP_P50:g}%, makespan within +-{TARGET_MAKESPAN:g}%\n")
    print("| run | calibration wall | drift probe % | step p50 % | step p90 % | makespan % | "
          "makespan noise % (measured vs measured) | step p50 %, uncontended steps | contended steps | "
          "median CPU share | targets met |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
