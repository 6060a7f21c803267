"""The gloo all-reduce term of a CPU calibration: time `torch.distributed.all_reduce` of a step's hidden
states ([tokens, hidden] in the model dtype) between `tp` processes on this machine, and fit the cost
model's link to it.

The cost model prices one all-reduce of T tokens as `interconnect_latency_s + 2 (tp-1)/tp x T x d x ba /
(interconnect_bandwidth x comm efficiency)` (sim/cost_model.py, `comm`); `fit_allreduce` finds the
latency and bandwidth that fit the measured times best (least squares on that line, both >= 0), so a
calibrated CPU hardware file predicts TP steps: each rank's share of the compute plus 2L all-reduces.

The ranks are fresh interpreters (`python -m servetwin.experiments.calibrate.allreduce`), one torch
thread each, joined through a file rendezvous; rank 0 prints the median time per size as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

DEFAULT_TOKENS = (1, 8, 32, 128, 512)
REPEATS = 10
TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class AllReduceFit:
    latency_s: float
    bandwidth: float  # bytes/s the line's slope stands for (before the comm efficiency)
    samples: list[tuple[int, float]]  # (bytes, median seconds)

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bandwidth": self.bandwidth,
                "samples": [{"bytes": b, "seconds": s} for b, s in self.samples]}


def fit_allreduce(samples: list[tuple[int, float]], tp: int) -> tuple[float, float]:
    """(latency_s, bandwidth) of `t = latency + 2 (tp-1)/tp x bytes / bandwidth` fitted to (bytes, t)."""
    if len(samples) < 2:
        raise ValueError(f"samples: need 2 or more sizes, got {len(samples)}")
    x = np.array([2.0 * (tp - 1) / tp * b for b, _ in samples])
    t = np.array([s for _, s in samples])
    slope, intercept = np.polyfit(x, t, 1)
    if slope <= 0:  # no size dependence measured: all latency, a link that costs nothing per byte
        return float(max(np.median(t), 0.0)), float("inf")
    if intercept < 0:  # through the origin instead
        return 0.0, float(x @ x / (x @ t))
    return float(intercept), float(1.0 / slope)


def measure_allreduce(hidden_size: int, dtype: str = "float32", tp: int = 2,
                      token_counts: tuple[int, ...] = DEFAULT_TOKENS, repeats: int = REPEATS) -> AllReduceFit:
    """Time gloo all-reduces of [T, hidden_size] between `tp` fresh processes; the fitted link."""
    with tempfile.TemporaryDirectory(prefix="servetwin-allreduce-") as tmp:
        init = f"file://{tmp}/store"
        cmd = [sys.executable, "-m", "servetwin.experiments.calibrate.allreduce", "--init", init,
               "--world", str(tp), "--hidden", str(hidden_size), "--dtype", dtype, "--repeats", str(repeats),
               "--tokens", ",".join(map(str, token_counts))]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, env=env, text=True)
                 for r in range(tp)]
        try:
            outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"all-reduce measurement failed (exit codes {[p.returncode for p in procs]})")
    samples = [(int(b), float(s)) for b, s in json.loads(outs[0])]
    latency, bandwidth = fit_allreduce(samples, tp)
    return AllReduceFit(latency, bandwidth, samples)


def _rank_main(argv: list[str]) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    p = argparse.ArgumentParser()
    for name in ("--init", "--dtype", "--tokens"):
        p.add_argument(name, required=True)
    for name in ("--rank", "--world", "--hidden", "--repeats"):
        p.add_argument(name, type=int, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world)
    dtype = getattr(torch, a.dtype)
    out = []
    for tokens in map(int, a.tokens.split(",")):
        t = torch.ones(tokens, a.hidden, dtype=dtype)
        dist.all_reduce(t)  # warm-up
        times = []
        for _ in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append((t.numel() * t.element_size(), float(np.median(times))))
    dist.destroy_process_group()
    if a.rank == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
