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
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from backend_throughput import main  # noqa: E402

MOE_DEFAULTS = ["--model", "tiny-qwen3-moe", "--requests", "64", "--skip", "cb", "--threads", "1"]

if __name__ == "__main__":
    raise SystemExit(main(MOE_DEFAULTS + sys.argv[1:]))
