"""Do two CPU calibrations in a row agree? (issue: "two calibrations in a row agree within 5% median on a
fixed probe set").

    python benchmarks/calibration_repeat.py [--model smollm2-135m] [--dtype bfloat16] [--design default]

Runs `servetwin calibrate` (the design `hardware: auto` uses) twice, back to back, into a temporary
folder, then measures one fixed probe set on the torch backend: the `quick` calibration design (single
and batched prefills after cached prefixes, decode batches, a mixed step; a different set of shapes
than the ones fitted) plus the drift probe's steps. Both calibrations predict every probe step; the
script prints, per calibration, its in-sample fit and its |error| on the probe set, and the agreement of
the two: median and p90 of |pred_1 - pred_2| / pred_2 over the probe steps, beside the 5% target. Time
it on a quiet machine: the calibrations measure the CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

TARGET_MEDIAN_PCT = 5.0


def measure_probe_set(model: str, dtype: str) -> dict:
    """The fixed probe set's trace frames, measured once on a fresh torch engine."""
    from servetwin.core.engine.engine_args import EngineArgs
    from servetwin.core.engine.engine_factory import create_engine_core
    from servetwin.core.testbed.trace import TraceRecorder
    from servetwin.experiments.calibrate.design import DESIGNS, run_design
    from servetwin.experiments.calibrate.torch_measure import set_torch_threads

    set_torch_threads(1)
    des = DESIGNS["quick"]
    args = EngineArgs.from_kwargs(model=model, backend="torch", device="cpu", dtype=dtype, seed=7,
                                  block_size=des.block_size, num_gpu_blocks=2048,
                                  max_num_batched_tokens=des.max_num_batched_tokens, max_num_seqs=des.max_num_seqs,
                                  enable_prefix_caching=True, enable_chunked_prefill=True, max_model_len=2048)
    engine, info = create_engine_core(args)
    recorder = TraceRecorder("probe-set", "torch")
    run_design(engine, recorder, des, info.vocab_size or 256, seed=7)
    return recorder.frames()


def predictions(path: str, model: str, dtype: str, frames: dict) -> np.ndarray:
    from servetwin.experiments.calibrate.design import predicted_durations
    from servetwin.sim.cost_model import CostModel
    from servetwin.sim.hardware import load_hardware
    from servetwin.sim.model_spec import load_model_spec

    return predicted_durations(frames, CostModel(load_model_spec(model, dtype=dtype), load_hardware(path),
                                                 cuda_graphs=False))


def main() -> int:
    from servetwin.experiments.calibrate.calibrate import calibrate
    from servetwin.experiments.calibrate.design import pct_stats

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--design", default="default")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="calibration-repeat-")
    paths, fits = [], []
    for k in (1, 2):
        path = os.path.join(folder, f"calibration-{k}.yaml")
        t0 = time.perf_counter()
        doc = calibrate(args.model, path, device="cpu", dtype=args.dtype, threads=1, design=args.design,
                        log=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
        used = doc["provenance"]["residuals"]["used_samples"]
        fits.append((time.perf_counter() - t0, used["median_abs_rel_err"] * 100, used["p90_abs_rel_err"] * 100,
                     os.getloadavg()[0]))
        paths.append(path)
        print(f"calibration {k}: {fits[-1][0]:.0f} s, in-sample median {fits[-1][1]:.2f}%, p90 {fits[-1][2]:.2f}%",
              flush=True)
    frames = measure_probe_set(args.model, args.dtype)
    measured = frames["steps"].duration_s.to_numpy(dtype=float)
    preds = [predictions(path, args.model, args.dtype, frames) for path in paths]
    print(f"\nprobe set: {len(measured)} steps measured once ({measured.sum():.1f} s), scored by both\n")
    print("| calibration | wall | in-sample median | in-sample p90 | probe set median |error| | probe set p90 | load |")
    print("|---|---|---|---|---|---|---|")
    for k, (fit, pred) in enumerate(zip(fits, preds), start=1):
        err = pct_stats(np.abs(pred - measured) / measured * 100)
        print(f"| {k} | {fit[0]:.0f} s | {fit[1]:.2f}% | {fit[2]:.2f}% | {err['p50']:.2f}% | {err['p90']:.2f}% | "
              f"{fit[3]:.2f} |")
    agree = pct_stats(np.abs(preds[0] - preds[1]) / preds[1] * 100)
    ok = agree["p50"] is not None and agree["p50"] <= TARGET_MEDIAN_PCT
    print(f"\nagreement of the two calibrations on the probe set: median {agree['p50']:.2f}%, p90 {agree['p90']:.2f}%, "
          f"max {agree['max']:.2f}% (target: median <= {TARGET_MEDIAN_PCT:g}%: {'met' if ok else 'NOT met'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
