"""llm-d's `calibrate.sh` (guides/recipes/router/calibration) replayed on a simulated deployment: the
`peakPrefillThroughput` it would measure, and the MoE kernel compute fraction that reproduces the published ones.

    python benchmarks/published_cluster/calibrate_prefill.py [--compute 0.405,0.5,0.6] [--fit]

llm-d measures `peakPrefillThroughput = CHUNK_SIZE / median(TTFT)`: warm-up then measurement requests of exactly
CHUNK_SIZE random token IDs (8,192, vLLM's --max-num-batched-tokens), one at a time through the router, so every
prefill misses the cache (its README, "What it measures"). Two such figures are published for gpt-oss-120b on the
deployments of benchmarks/published_cluster (both training cases):

- 39,065 tok/s: H100 80 GB, TP1, aggregated (llm-d `guides/recipes/router/calibration/configuration-matrix.md`,
  row `gpu/vllm/gpt-oss`, vLLM v0.22.0): the routing arms' model servers;
- 33,821 tok/s: H200, 8 prefill pods TP1 + decode TP4, "through the full P/D path ... Includes the NIXL KV
  transfer + sidecar hop" (the P/D guide's router values): the P/D arm.

Each is replayed on its case's deployment (`cases/routing_gptoss120b_h100_16xtp1_rr.yaml`,
`cases/pd_gptoss120b_h200_8p_tp1_2d_tp4.yaml`): the same instances, router and engine settings, the workload
replaced by 5 warm-up and 20 measured 8,192-token random prompts half a second apart (the engine idle for each),
max_model_len 16,384. TTFT is the client's: API server, prefill, and for P/D the KV read and the decode side's
first token. `--compute` runs the Hopper `moe_kernels.mxfp4_triton` compute fraction at the values given;
`--fit` bisects the one value that makes the two figures' log errors sum to zero and prints both at it.
"""
from __future__ import annotations

import argparse
import copy
import glob
import math
import os
import statistics
import tempfile
from pathlib import Path

import pandas as pd

from servetwin.experiments.config.schema import load_raw_config, validate_config
from servetwin.experiments.run.experiment import run_experiment
from servetwin.experiments.validate.preset_fit import hardware_mapping

HERE = Path(__file__).resolve().parent
CHUNK_SIZE = 8192
WARMUP, MEASURED = 5, 20
ANCHORS = {  # case: published peakPrefillThroughput (tok/s)
    "routing_gptoss120b_h100_16xtp1_rr": 39_065.0,
    "pd_gptoss120b_h200_8p_tp1_2d_tp4": 33_821.0,
}
PARAM = ("moe_kernels.mxfp4_triton", "mxfp4_triton_compute")


def calibration_config(case: str, compute: float | None) -> dict:
    """The case's deployment with calibrate.sh's workload (and, if given, the MoE compute fraction)."""
    raw = copy.deepcopy(load_raw_config(str(HERE / "cases" / f"{case}.yaml")))
    raw["name"] = f"calibrate_{case}"
    raw["engine"] = {**raw.get("engine", {}), "max_model_len": 2 * CHUNK_SIZE}
    raw["workload"] = {"requests": WARMUP + MEASURED, "prompt_tokens": CHUNK_SIZE, "output_tokens": 2,
                       "finish": "max_tokens", "arrival": {"type": "gamma", "rate": 2.0, "cv": 0.01}}
    raw["output"] = {"step_requests": False, "plots": False}
    if compute is not None:
        raw["hardware"] = hardware_mapping({PARAM: compute}, raw["hardware"])
    return raw


def measured_peak_prefill_throughput(case: str, compute: float | None) -> float:
    """CHUNK_SIZE / median TTFT of the measured requests, as calibrate.sh computes it."""
    with tempfile.TemporaryDirectory() as out:
        run_experiment(validate_config(calibration_config(case, compute)), out, progress=False, log=lambda m: None,
                       overwrite=True)
        frames = [pd.read_parquet(p) for p in glob.glob(os.path.join(out, "sim", "instances", "*", "requests.parquet"))]
    reqs = pd.concat(frames, ignore_index=True)
    reqs = reqs[~reqs.request_id.str.endswith(".prefill")]  # P/D: the client's request, not its prefill copy
    reqs = reqs.assign(n=reqs.request_id.str.removeprefix("req-").astype(int)).sort_values("n")
    ttft = reqs.ttft_s.iloc[WARMUP:]
    return CHUNK_SIZE / statistics.median(ttft)


def log_errors(compute: float | None) -> dict[str, float]:
    return {case: math.log(measured_peak_prefill_throughput(case, compute) / published)
            for case, published in ANCHORS.items()}


def show(compute: float | None) -> dict[str, float]:
    errors = log_errors(compute)
    label = "preset" if compute is None else f"{compute:.4f}"
    cells = ", ".join(f"{case}: {ANCHORS[case] * math.exp(e):,.0f} tok/s ({math.expm1(e):+.1%})"
                      for case, e in errors.items())
    print(f"compute {label}: {cells}")
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compute", default="", help="comma-separated compute fractions to run (default: the preset's)")
    p.add_argument("--fit", action="store_true", help="bisect the fraction whose two log errors sum to zero")
    args = p.parse_args()
    values = [float(v) for v in args.compute.split(",") if v.strip()] or [None]
    for v in values:
        show(v)
    if args.fit:
        lo, hi = 0.3, 0.9
        for _ in range(12):
            mid = (lo + hi) / 2
            total = sum(log_errors(mid).values())
            lo, hi = (mid, hi) if total < 0 else (lo, mid)
        print("fitted:")
        show(round((lo + hi) / 2, 3))


if __name__ == "__main__":
    main()
