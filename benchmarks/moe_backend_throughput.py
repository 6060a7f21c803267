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

Measured 2026-12-02 (AMD EPYC VM, 2 cores shared with other jobs, load average 5-12, one thread, the
default command): servetwin 1.38x, 1.42x, 1.54x HF generate by wall time (1.34x, 1.41x, 1.77x by CPU
seconds), 64/64 greedy outputs equal - the 2x target is MISSED. Pure-decode (16 x 200 tokens) and
pure-prefill (32 x ~500 tokens) runs put the two at par per step (1.4 s vs 1.5 s; 1.3 vs 1.2 CPU s):
the whole gain is HF's static batching (19.5% wasted tokens, padded prefill); the expert GEMMs and
attention are the same work in both, so at this model size there is no kernel edge to add.

Where servetwin's time goes (cProfile of the servetwin half of the default command, same machine and
load, 2026-12-02; cProfile inflates Python-heavy parts): of 18.2 s in `generate`, the model forward is
14.0 s (paged attention's native kernel 3.2-3.8 s, MoE layers 4.5 s of which the padded expert `bmm`s
~3 s, linears 1.8 s, RMSNorm ~1 s, RoPE 0.7 s); per-step Python around it is ~3 s: output processing
1.5 s (incremental detokenisation 1.1 s, random tokens keep multi-byte characters open so the windows
grow), input prep 0.6 s, attention metadata 0.5 s, scheduling + update 0.5 s. Without the profiler,
two runs each: 6.70 / 5.93 CPU s detokenised vs 7.08 / 6.07 with `--disable-detokenize` (12.0-14.3 s
wall, load average ~6): the difference is below the noise. Removing ALL per-step Python overhead would
lift 1.4x to at most ~1.8x; the 2x target needs less work per step than HF, not less overhead.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from backend_throughput import main  # noqa: E402

MOE_DEFAULTS = ["--model", "tiny-qwen3-moe", "--requests", "64", "--skip", "cb", "--threads", "1"]

if __name__ == "__main__":
    raise SystemExit(main(MOE_DEFAULTS + sys.argv[1:]))
