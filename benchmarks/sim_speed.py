"""Simulator speed on `experiments/configs/bench_h100_llama8b.yaml`: simulated seconds per wall second,
steps per second and requests per second.

Target: >= 1000x real time; below 200x is reported as a failure. For scale, Vidur 0.0.26 manages
about 15x on a similar workload on this machine class. Options run the same workload in sync
scheduling (where the exact decode fast-forward applies) and with the fast-forward off.
Usage: python benchmarks/sim_speed.py [--requests N] [--variants]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.engine_args import EngineArgs  # noqa: E402
from core.engine_factory import create_engine_core  # noqa: E402
from sim.engine import Simulation  # noqa: E402
from sim.workload import build_workload, rng_streams  # noqa: E402


def run_once(cfg: dict, requests: int, async_scheduling: bool, fast_forward: bool) -> dict:
    engine_kw = dict(cfg["engine"], async_scheduling=async_scheduling)
    args = EngineArgs.from_kwargs(model=cfg["model"], backend="sim", hardware=cfg["hardware"],
                                  skip_tokenizer_init=True, **engine_kw)
    engine, info = create_engine_core(args)
    spec, reqs = build_workload(dict(cfg["workload"], requests=requests), vocab_size=info.vocab_size)
    sim = Simulation(engine, reqs, spec.arrival, rng=rng_streams(spec.seed)["runtime"],
                     record_step_requests=False, fast_forward=fast_forward)
    t0 = time.perf_counter()
    res = sim.run()
    wall = time.perf_counter() - t0
    return {"simulated_s": res.end_time_s, "wall_s": wall, "steps": res.num_steps,
            "completed": len(res.completion_s), "x": res.end_time_s / wall,
            "steps_per_s": res.num_steps / wall, "req_per_s": len(res.completion_s) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "experiments/configs/bench_h100_llama8b.yaml"))
    ap.add_argument("--requests", type=int, default=None, help="override workload.requests")
    ap.add_argument("--variants", action="store_true", help="also sync scheduling, with and without fast-forward")
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))
    n = args.requests or cfg["workload"]["requests"]
    cases = [("as configured", bool(cfg["engine"].get("async_scheduling", False)), True)]
    if args.variants:
        cases += [("sync + fast-forward", False, True), ("sync, step by step", False, False)]
    print(f"{cfg['name']}: {n} requests, {cfg['model']} on {cfg['hardware']}")
    print(f"{'case':<22}{'simulated s':>12}{'wall s':>9}{'x real time':>13}{'steps/s':>10}{'req/s':>9}")
    for label, async_sched, ff in cases:
        r = run_once(cfg, n, async_sched, ff)
        verdict = "" if r["x"] >= 1000 else ("  (below the 1000x target)" if r["x"] >= 200
                                             else "  (FAILURE: below 200x)")
        print(f"{label:<22}{r['simulated_s']:>12.1f}{r['wall_s']:>9.2f}{r['x']:>13.1f}"
              f"{r['steps_per_s']:>10.0f}{r['req_per_s']:>9.0f}{verdict}")


if __name__ == "__main__":
    main()
