"""Time one step's cost prediction (`CostModel.predict` on a `StepSummary`), MoE against dense.

Target (issue 23): an MoE step's prediction under 10 us. Prints microseconds per call (best of
`--repeats` runs of `--calls` calls) for a decode step and a mixed step (a chunk + decodes) of
gpt-oss-120b (MoE, sliding-window layers, TP 2, async scheduling) and Llama-3.1-8B (dense, TP 1).

Usage: python benchmarks/moe_step_cost.py [--calls 20000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import sys
import time


from servetwin.sim.cost_model import CostModel, StepSummary


def per_call_us(cm: CostModel, step: StepSummary, calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            cm.predict(step)
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    steps = {"decode x64": StepSummary.from_lists([1] * 64, [1500] * 64, 64),
             "chunk 1024 + decode x63": StepSummary.from_lists([1024] + [1] * 63, [0] + [1500] * 63, 64)}
    models = {"gpt-oss-120b h100-sxm tp2": CostModel("gpt-oss-120b", "h100-sxm", tp=2, async_scheduling=True),
              "llama-3.1-8b h100-sxm tp1": CostModel("llama-3.1-8b", "h100-sxm")}
    print(f"{'model':28s} {'step':26s} {'us per predict':>15s}")
    for name, cm in models.items():
        for label, step in steps.items():
            print(f"{name:28s} {label:26s} {per_call_us(cm, step, args.calls, args.repeats):15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
