"""How stable `servetwin run`'s torch measurement is, back to back: the torch/sim makespan ratio of
`experiments/configs/default.yaml` (16 offline requests, tiny-llama on the CPU) over repeated runs,
measured the old way (torch's default thread count, no warm-up) and the way `run` measures now (the
calibration's thread count, an unrecorded warm-up), interleaved (old, new, new, old, ...) so the
machine's drift hits both alike; every run is a fresh `servetwin run` process (cold, as a user's are). Each row also gives the contention check's share of contended
steps: a run whose ratio is far off should say so there.

The issue this answers: back-to-back default runs gave ratios from 0.85 to 19.8. Target: the new
way's ratios within a factor of 1.5 of each other on a quiet machine; on a loaded one every far-off
run must be flagged (contended share above 5%).

Usage: python benchmarks/torch_run_stability.py [--repeats 3] [--config experiments/configs/default.yaml]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(config: str, way: str, out: str) -> dict:
    """One `servetwin run` in a fresh process (cold, as a user's back-to-back runs are)."""
    # the old way: no warm-up, torch's own default thread count (all cores)
    flags = ["--no-warmup", "--threads", str(os.cpu_count())] if way == "old" else []
    cmd = [sys.executable, "-m", "servetwin.experiments.cli", "run", config, "-o", out, "--overwrite",
           "--no-progress", "--no-plots", "--set", "backends=[sim, torch]", *flags]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    with open(os.path.join(out, "summary.json")) as f:
        backends = json.load(f)["backends"]
    sim, torch = backends["sim"], backends["torch"]
    m = torch["measurement"]
    return {"way": way, "ratio": torch["duration_s"] / sim["duration_s"], "torch_s": torch["duration_s"],
            "sim_s": sim["duration_s"], "threads": m["torch_threads"],
            "contended": m["contention"]["contended_step_share"], "cpu_share": m["contention"]["median_cpu_share"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--config", default=os.path.join(ROOT, "experiments", "configs", "default.yaml"))
    a = p.parse_args()
    order = [w for i in range(a.repeats) for w in (("old", "new") if i % 2 == 0 else ("new", "old"))]
    rows = []
    print(f"{'way':<4} {'ratio':>7} {'torch':>9} {'sim':>9} {'threads':>7} {'contended':>9} {'cpu_share':>9}  load")
    tmp = tempfile.mkdtemp(prefix="torch_run_stability-")
    for way in order:
        r = one_run(a.config, way, os.path.join(tmp, way))
        rows.append(r)
        print(f"{way:<4} {r['ratio']:7.2f} {r['torch_s']:8.3f}s {r['sim_s']:8.3f}s {r['threads']:7d} "
              f"{100 * r['contended']:8.0f}% {r['cpu_share']:9.2f}  {os.getloadavg()[0]:.2f}", flush=True)
    flagged = 0.05
    for way in ("old", "new"):
        ratios = [r["ratio"] for r in rows if r["way"] == way]
        clean = [r["ratio"] for r in rows if r["way"] == way and r["contended"] <= flagged]
        spread = max(ratios) / min(ratios)
        print(f"{way}: ratio median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f} "
              f"(max/min {spread:.2f}); {len(ratios) - len(clean)}/{len(ratios)} runs flagged contended"
              + (f"; unflagged runs {min(clean):.2f}-{max(clean):.2f}" if clean else ""))
    new_clean = [r["ratio"] for r in rows if r["way"] == "new" and r["contended"] <= flagged]
    ok = len(new_clean) < 2 or max(new_clean) / min(new_clean) <= 1.5
    print(f"target (unflagged new-way runs within 1.5x of each other): {'met' if ok else 'NOT met'}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
