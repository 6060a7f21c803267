"""Offline CPU throughput of the torch backend on an MoE model against HF `generate` (issue 22).

    python benchmarks/moe_backend_throughput.py               # tiny-qwen3-moe, 64 requests, one thread
    python benchmarks/moe_backend_throughput.py --threads 2 --requests 16    # any backend_throughput flag

`benchmarks/backend_throughput.py` with MoE defaults: `--model tiny-qwen3-moe` (4 layers, hidden 128,
16 experts of width 64, top-4, a dense first layer: random weights), 64 requests, HF continuous batching
skipped (`--skip cb`) and one torch thread (`--threads 1`: on a machine shared with other jobs, torch's
and the native kernels' OpenMP threads spin at barriers and the figures measure the contention, not the
systems). servetwin's `LLM.generate` and HF `generate` (padded static batches of `--batch-size`, grouped
by output length) run the same seeded workload one after the other in one process; the table prints
both side by side, their greedy-token equality and the target (servetwin >= 2x HF generate).
Any flag given here overrides these defaults.

Timed region: `LLM.generate` only, detokenisation included; outside it, as vLLM's `LLM()` constructor
does its compilation and CUDA-graph capture, are the model load, one 4-token warm-up request and the
native CPU kernels' one-time build (`cc` into `~/.cache/servetwin/kernels`, then loaded from there) and
the small-M linear's timing against `F.linear`. HF gets its own untimed warm-up (request 0).

Measured 2026-12-02, the default command (AMD EPYC VM with AVX-512, 2 cores shared with 2 other helpers
and the lead, one thread), after the fused layer kernels of `gpu/cpu_layer_kernels.py` (MoE layer
whole, q/k norm + RoPE, RMSNorm with the residual add) and the three-pass decode attention, five runs
of the same code, 64/64 greedy outputs equal in each - the 2x target is MET, narrowly on a quiet machine:

    load average   servetwin wall / CPU s   HF generate wall / CPU s   x by wall   x by CPU s
    2.6 -> 4.0          8.8 / 5.2                21.4 / 12.4              2.42x       2.37x
    4.1 -> 4.7          6.5 / 4.6                23.7 / 12.9              3.66x       2.77x
    4.7 -> 4.6          5.8 / 4.2                17.4 / 12.5              3.00x       3.00x
    3.2 -> 2.9          4.9 / 4.8                 9.7 /  9.6              2.00x       2.02x
    1.7 -> 1.8          4.6 / 4.6                10.7 / 10.6              2.32x       2.32x

Contention inflates HF's CPU seconds more than servetwin's (12.4-12.9 CPU s under load 4-5 against
9.6-10.6 near load 2), so the quiet rows are the fair ones. Before these kernels, same machine and day:
1.74x wall / 1.72x CPU (15.3 s / 7.8 CPU s vs 26.6 s / 13.3 CPU s), and 1.38-1.54x in earlier runs.
`--no-cpu-kernels` (the pure-torch fallback, load average 6-7.5): 1.03x wall / 0.99x CPU - the torch
ops alone only match HF.

Where servetwin's time goes now (per-function thread CPU time of the servetwin half of the default
command, load average ~2.7): of 4.8 CPU s, the executor's steps 4.3 s, of which the model forward 3.7 s:
attention layers 2.4 s (the native decode-attention kernel 1.19 s, ~410 us per call for 16 requests of
a few hundred tokens, partly bound by reading the float32 KV cache: 202 us with the blocks in cache,
285 us spread over a large one, in a microbenchmark; prefill SDPA 0.31 s), MoE layers 0.66 s (~16
GFLOP of exact expert rows, no padding: 60 GFLOP/s on a 2048-token chunk, MKL's sgemm 96 on one
128x128 product), the dense first layer 0.23 s; around the forward: output processing with
detokenisation 0.34 s, attention metadata 0.14 s, scheduling + update 0.11 s. The decode attention's
cost is the 16-lane horizontal sums of head-dim-32 dot products (a K layout with keys along the lanes
would remove them, a change of the KV cache layout shared with the other backends: not done).
Before the layer kernels the forward was 14.0 of 18.2 s under cProfile (MoE 4.5 s of which the padded
expert `bmm`s ~3 s, RMSNorm ~1 s as ~6 ATen ops per call, RoPE 0.7 s): on a model this small a step is
bound by the number of ops and the padding, not by FLOPs, and the fused calls remove both.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from backend_throughput import main  # noqa: E402

MOE_DEFAULTS = ["--model", "tiny-qwen3-moe", "--requests", "64", "--skip", "cb", "--threads", "1"]

if __name__ == "__main__":
    raise SystemExit(main(MOE_DEFAULTS + sys.argv[1:]))
