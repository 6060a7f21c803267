"""vLLM's step ranges as a Chrome trace: what `torch.profiler.export_chrome_trace` writes for the
worker's `record_function("execute_context_X(a)_generation_Y(b)")` around each step - a complete event
(`"ph": "X"`, microseconds) of category `user_annotation` on the CPU thread and, for a GPU, the same
range as `gpu_user_annotation` on a stream. servetwin writes its predicted steps in this shape (the
simulator's `/stop_profile`, `servetwin.experiments.vllm_import.profiler_trace`) so that a predicted and
a measured trace open side by side in Perfetto and read back the same way."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterable

from servetwin.core.testbed.atomic import atomic_open

CPU_CATEGORY, GPU_CATEGORY = "user_annotation", "gpu_user_annotation"


def step_range_events(steps: Iterable[tuple[str, float, float]], gpu: bool = True,
                      process: str = "servetwin") -> list[dict]:
    """Trace events of (range name, start s, duration s) steps."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": process}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "engine steps (CPU)"}}]
    if gpu:
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "stream 7 (GPU)"}})
    for name, t, d in steps:
        base = {"ph": "X", "name": name, "pid": 0, "ts": round(t * 1e6, 3), "dur": round(d * 1e6, 3)}
        events.append({**base, "cat": CPU_CATEGORY, "tid": 0})
        if gpu:
            events.append({**base, "cat": GPU_CATEGORY, "tid": 1})
    return events


def write_step_ranges(path: str | Path, steps: Iterable[tuple[str, float, float]], gpu: bool = True,
                      process: str = "servetwin") -> Path:
    """Write the steps as a Chrome trace; a `.gz` path is gzip-compressed (vLLM's `*.pt.trace.json.gz`)."""
    text = json.dumps({"traceEvents": step_range_events(steps, gpu, process), "displayTimeUnit": "ms"})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.name.endswith(".gz"):
        with atomic_open(str(p), "wb", encoding=None) as f:
            f.write(gzip.compress(text.encode()))
    else:
        with atomic_open(str(p)) as f:
            f.write(text)
    return p
