"""`freeze_gc_heap`: keep the start-up heap out of every later garbage collection (vLLM's
`vllm.utils.gc_utils.freeze_gc_heap`, called by its server and engine processes once they are ready).

A full (generation 2) collection walks every tracked object. The API server's heap after start-up
(FastAPI, pydantic, the tokenizer, numpy, ...) made each such pass take 40-95 ms on the 2-CPU test
machine, and the event loop stands still meanwhile: under 128 streams they were the longest /health
answers (benchmarks/server_stall.py). After `gc.freeze()` the start-up objects sit in the permanent
generation, which collections skip; what is allocated later is still collected as usual.
"""
from __future__ import annotations

import gc


def freeze_gc_heap() -> int:
    """Collect (so no garbage becomes permanent), then freeze what is alive; returns how many objects."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
