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
and the lead, load average 2.6-4.7, one thread), after the fused layer kernels of
`gpu/cpu_layer_kernels.py` (MoE layer whole, q/k norm + RoPE, RMSNorm with the residual add) and the
three-pass decode attention, three runs: servetwin 2.42x, 3.66x and 3.00x HF generate by wall time
(8.8 s vs 21.4 s, 6.5 s vs 23.7 s, 5.8 s vs 17.4 s), 2.37x, 2.77x and 3.00x by CPU seconds (5.2 vs
12.4, 4.6 vs 12.9, 4.2 vs 12.5); 64/64 greedy outputs equal in each; an earlier run of the same code
minus the attention change: 2.88x wall, 2.36x CPU - the 2x target is MET. Before them, same machine and day: 1.74x wall / 1.72x CPU (15.3 s / 7.8 CPU s vs
26.6 s / 13.3 CPU s), and 1.38-1.54x in earlier runs. `--no-cpu-kernels` (the pure-torch fallback,
load average 6-7.5): 1.03x wall / 0.99x CPU - the torch ops alone only match HF.

Where servetwin's time goes now (per-function thread CPU time of the servetwin half of the default
command, same machine): of 5.5 CPU s, the executor's steps 4.95 s, of which the model forward 4.25 s:
attention layers 2.7 s (the native decode-attention kernel 1.25 s, ~435 us per call for 16 requests of
a few hundred tokens, partly bound by reading the float32 KV cache: 202 us with the blocks in
cache, 285 us spread over a large one, in a microbenchmark; prefill SDPA 0.32 s), MoE layers 0.68 s
(~16 GFLOP of exact expert rows, no padding), the dense first layer 0.25 s; around the forward:
output processing with detokenisation 0.37 s, attention metadata 0.17 s, scheduling + update 0.12 s.
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
