"""The simulated path of a staged cluster run, per stage: what a request's TTFT is made of and why.

    python benchmarks/published_cluster/stage_breakdown.py RUNS/NAME

RUNS/NAME is a `servetwin run cases/NAME.yaml -o RUNS/NAME` folder of a case with a `stages` arrival. Per
stage (the requests `experiments/validate/cluster_stages.py` assigns to it): the share of prompt tokens that
were cached (GPU pool and CPU tier together: the requests' `cached_tokens`), the GPU pool's share (the
engines' local prefix hits in the steps that started inside the stage's window), the requests served whole
from a cache (every full block of the shared prefix), the mean time waiting in the engine's queue, from first
scheduled to first token (a CPU-tier load and the prefill of what was not cached), the front-end's share of
TTFT, TTFT, the busy steps' mean KV use and preemptions. Then how many replicas each prompt group's requests
were routed to. Measured parts of the simulation that explain the errors in RESULTS.md; nothing is fitted.
"""
from __future__ import annotations

import glob
import os
import sys

import numpy as np
import pandas as pd

from servetwin.experiments.config.schema import load_config
from servetwin.experiments.config.workloads import build_requests
from servetwin.experiments.validate.cluster_stages import stage_of_requests


def _frame(run: str, table: str) -> pd.DataFrame:
    paths = sorted(glob.glob(os.path.join(run, "sim", "instances", "*", f"{table}.parquet")))
    return pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True)


def stage_rows(run: str) -> list[str]:
    exp = load_config(os.path.join(run, "config.yaml"))
    ladder = exp.workload.spec.arrival
    counts = ladder.stage_counts()
    rates = [s.rate for s in ladder.stages]
    reqs, steps = _frame(run, "requests"), _frame(run, "steps")
    reqs["stage"] = stage_of_requests(counts, reqs.request_id.tolist())
    starts = [reqs[reqs.stage == k].arrival_s.min() for k in range(len(counts))] + [np.inf]
    block = exp.engine.args.block_size  # a cache holds whole blocks: the prefix's full blocks are all it can give
    prefix = exp.workload.spec.shared_prefix.prefix_tokens // block * block
    rows = ["| rate | cached % of prompt | GPU-pool hits % of prompt | served from cache % | queue ms | "
            "scheduled -> 1st token ms | front-end ms | TTFT ms | KV use | preemptions |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, rate in enumerate(rates):
        r = reqs[reqs.stage == k]
        s = steps[(steps.t_start_s >= starts[k]) & (steps.t_start_s < starts[k + 1])]
        prompt = r.prompt_tokens.sum()
        rows.append(f"| {rate:g} | {100 * r.cached_tokens.sum() / prompt:.1f} | {100 * s.prefix_hits.sum() / prompt:.1f} | "
                    f"{100 * (r.cached_tokens >= prefix).mean():.1f} | {1000 * r.queue_s.mean():.0f} | "
                    f"{1000 * (r.first_token_s - r.first_scheduled_s).mean():.0f} | "
                    f"{1000 * (r.ttft_s - r.engine_ttft_s).mean():.0f} | {1000 * r.ttft_s.mean():.0f} | "
                    f"{s[s.num_reqs > 0].kv_usage.mean():.2f} | {int(r.num_preemptions.sum())} |")
    workload, _, _ = build_requests(exp)  # the groups do not depend on the vocabulary (their own generator)
    group = {w.request_id: w.group for w in workload}
    decisions = pd.read_parquet(os.path.join(run, "sim", "router_decisions.parquet"))
    spread = decisions.groupby(decisions.request_id.map(group)).pick.nunique()
    rows.append(f"\nReplicas each prompt group's requests were routed to: mean {spread.mean():.2f}, "
                f"median {spread.median():g}, max {spread.max()} ({len(spread)} groups)")
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(stage_rows(sys.argv[1])))
