"""Per-stage figures of a staged (inference-perf ladder) run, as inference-perf's report computes them.

A `stages` arrival (`servetwin.sim.arrivals.StageLadder`) hands stage k the next int(rate x duration_s)
requests of the workload, in order, so request `req-N`'s stage follows from N. Per stage, over its requests
that finished (inference-perf `reportgen/base.py`): output tok/s = their output tokens / (last client finish -
first arrival); TTFT / E2E mean and p90; TPOT mean; ITL mean = all their token gaps pooled (decode time
summed over tokens after the first). Times in ms, as `servetwin validate`'s other metrics.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Optional

import numpy as np

STAGE_METRICS = ("out_tok_s", "ttft_mean", "ttft_p90", "tpot_mean", "itl_mean", "e2e_mean", "e2e_p90")


def stage_of_requests(counts: list[int], request_ids: Any) -> np.ndarray:
    """Stage index of every `req-N` id (-1 for another id)."""
    bounds = np.cumsum(counts)
    out = np.full(len(request_ids), -1, dtype=np.int64)
    for i, rid in enumerate(request_ids):
        head, _, num = str(rid).rpartition("-")
        if head == "req" and num.isdigit():
            k = int(np.searchsorted(bounds, int(num), side="right"))
            out[i] = k if k < len(counts) else -1
    return out


def stage_figures(reqs: Any, counts: list[int]) -> list[dict[str, Optional[float]]]:
    """One {metric: value} per stage from a requests frame (every engine's requests concatenated)."""
    stage = stage_of_requests(counts, reqs.request_id.tolist())
    done = (reqs.finish_reason.notna() & (reqs.finish_reason != "abort")).to_numpy()
    out = []
    for k in range(len(counts)):
        r = reqs[(stage == k) & done]
        if not len(r):
            out.append({m: None for m in STAGE_METRICS})
            continue
        span = float(r.client_finish_s.max() - r.arrival_s.min())
        decode_tokens = float((r.output_tokens - 1).clip(lower=0).sum())
        decode_s = float((r.e2e_s - r.ttft_s)[r.output_tokens > 1].sum())
        out.append({
            "out_tok_s": float(r.output_tokens.sum()) / span if span > 0 else None,
            "ttft_mean": 1000.0 * float(r.ttft_s.mean()), "ttft_p90": 1000.0 * float(np.percentile(r.ttft_s, 90)),
            "tpot_mean": 1000.0 * float(r.tpot_s.mean()) if r.tpot_s.notna().any() else None,
            "itl_mean": 1000.0 * decode_s / decode_tokens if decode_tokens else None,
            "e2e_mean": 1000.0 * float(r.e2e_s.mean()), "e2e_p90": 1000.0 * float(np.percentile(r.e2e_s, 90)),
        })
    return out


def run_stage_figures(run_dir: str, counts: list[int]) -> list[dict[str, Optional[float]]]:
    """`stage_figures` of a `servetwin run` folder of a cluster (or a single engine's sim run)."""
    import pandas as pd  # noqa: PLC0415

    paths = sorted(glob.glob(os.path.join(run_dir, "sim", "instances", "*", "requests.parquet")))
    if not paths:
        paths = [os.path.join(run_dir, "sim", "requests.parquet")]
    reqs = pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True)
    return stage_figures(reqs, counts)


# Two arms' published per-stage figures "separate" where they differ by more than this (relative): below
# it the sources' own run-to-run noise can flip the order.
SEPARATION = 0.10
LOWER_IS_BETTER = ("ttft", "tpot", "itl", "e2e")


def ranking_checks(results: list[Any], published: dict[str, Any]) -> list[str]:
    """For every published.json entry with `ranking: {above: OTHER}`, per stage metric where the published
    figures of the two arms separate: does the prediction order them as the sources do? A metric where the
    two predictions are equal holds in neither direction. (Markdown lines.)"""
    by_name = {r.name: r for r in results if not r.error and not r.pending}
    lines = []
    for name, entry in published.items():
        other = (entry.get("ranking") or {}).get("above")
        if other is None:
            continue
        if name not in by_name or other not in by_name:
            lines.append(f"- {name} above {other}: not checked (both arms must run)")
            continue
        mine = {m: (pub, pred) for m, pub, pred in by_name[name].rows}
        theirs = {m: (pub, pred) for m, pub, pred in by_name[other].rows}
        held, checked, reversed_, tied = 0, 0, [], []
        for m in sorted(set(mine) & set(theirs), key=_stage_key):
            (pa, qa), (pb, qb) = mine[m], theirs[m]
            if qa is None or qb is None or abs(pa - pb) <= SEPARATION * max(abs(pa), abs(pb)):
                continue
            checked += 1
            if qa == qb:  # the prediction orders neither way (e.g. an arrival-bound stage): never a hold
                tied.append(m)
            elif (pa < pb) == (qa < qb):
                held += 1
            else:
                reversed_.append(m)
        better = ", ".join(sorted({m.split("@")[0] for m in mine}))
        lines.append(f"- {name} vs {other} ({better}; where the published arms differ by > {SEPARATION:.0%}): "
                     f"the predicted order holds at {held}/{checked}"
                     + (f"; reversed at {', '.join(reversed_)}" if reversed_ else "")
                     + (f"; predicted equal at {', '.join(tied)}" if tied else ""))
    return lines


def _stage_key(metric: str) -> tuple[str, float]:
    head, _, rate = metric.partition("@")
    return head, float(rate) if rate else 0.0
