"""Sweep driver throughput: 200 small points through the local process pool and through Ray, points per
second of each printed side by side in one run (docs/ray.md).

Each point is a full `servetwin sweep` point - validate the config, build the sim engine, simulate 8
requests of tiny-llama, write the run folder (Parquet tables, trace.json, summary, report; no plots) -
so the figure is what the driver sustains when the points are cheap: per-point overhead, not
simulation speed. Ray's figure includes shipping the config to the task and the run folder back as a
tar archive, not `ray.init` (timed separately).

Usage: python benchmarks/sweep_driver.py [--points 200] [--jobs N] [--ray-address ADDRESS] [--requests 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servetwin.experiments.config.schema import validate_config  # noqa: E402
from servetwin.experiments.sweep.sweep import run_sweep  # noqa: E402


def config(points: int, requests: int) -> dict:
    return {
        "name": "driver", "model": "tiny-llama", "hardware": "cpu", "backends": ["sim"],
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "num_gpu_blocks": 256, "max_model_len": 512},
        "workload": {"requests": requests, "arrival": {"type": "poisson", "rate": 50.0},
                     "prompt_tokens": {"type": "uniform", "low": 16, "high": 64}, "output_tokens": 8},
        "output": {"plots": False, "step_requests": False},
        "sweep": {"seed": list(range(points))},
    }


def timed_sweep(exp, ray, jobs: int) -> tuple[float, int, float]:
    """(seconds to start Ray, points ok, seconds for the points). The local pool's worker start-up is
    in its points' time (it starts them lazily); so is the Ray workers' (their first imports)."""
    t0 = time.perf_counter()
    warm = None
    if ray is not None:  # ray.init once up front so that the sweep's time is the points' alone
        from servetwin.experiments.sweep.ray_pool import RayPool  # noqa: PLC0415

        warm = RayPool(None if ray is True else ray)
    start = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out:
        t1 = time.perf_counter()
        df = run_sweep(exp, out, jobs=jobs, progress=False, log=lambda m: None, ray=ray)
        points = time.perf_counter() - t1
    if warm is not None:
        warm.close()  # the sweep used (and left) the instance this started
    return start, int((df.status == "ok").sum()), points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=200)
    ap.add_argument("--requests", type=int, default=8, help="requests per point (default 8)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="local pool workers (default: CPUs)")
    ap.add_argument("--ray-address", default=None, help="join this cluster instead of a local Ray instance")
    args = ap.parse_args()
    exp = validate_config(config(args.points, args.requests), ".", "driver")
    print(f"{args.points} points of {args.requests} requests each (tiny-llama, sim, run folders without plots); "
          f"{os.cpu_count()} CPUs on this machine")
    rows = []
    for name, ray, jobs in (("in process (-j 1)", None, 1), (f"local pool (-j {args.jobs})", None, args.jobs),
                            ("Ray (" + (args.ray_address or "local instance") + ")", args.ray_address or True, 1)):
        try:
            start, ok, secs = timed_sweep(exp, ray, jobs)
        except ValueError as e:  # Ray not installed
            print(f"{name}: skipped - {e}")
            continue
        rows.append((name, start, ok, secs))
        print(f"{name:32s} start {start:6.2f} s | {ok}/{args.points} points in {secs:7.2f} s = "
              f"{ok / secs:6.2f} points/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
