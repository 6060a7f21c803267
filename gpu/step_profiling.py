"""Per-step timing (CUDA events on GPU, perf_counter around synchronised phases on CPU), the step
annotation string, and an optional torch.profiler chrome trace."""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from servetwin.core.outputs import StepTiming
from servetwin.core.engine.runner_state import ScheduledRow

logger = logging.getLogger(__name__)

PHASES = ("prepare", "forward", "sample")


def step_annotation(rows: Sequence[ScheduledRow], new_req_ids: set[str]) -> str:
    """`execute_context_{n}({tok})_generation_{m}({tok})`: a context request is new this step or has
    no output token yet; every other request is a generation request."""
    ctx_n = ctx_tok = gen_n = gen_tok = 0
    for r in rows:
        if r.req_id in new_req_ids or len(r.state.token_ids) == r.state.num_prompt_tokens:
            ctx_n += 1
            ctx_tok += r.num_scheduled
        else:
            gen_n += 1
            gen_tok += r.num_scheduled
    return f"execute_context_{ctx_n}({ctx_tok})_generation_{gen_n}({gen_tok})"


class StepTimer:
    """Marks phase boundaries; `timing()` returns a `StepTiming` (one sync at the end on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[object] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def timing(self, padded_batch_size: int) -> StepTiming:
        """Call after the last mark (4 marks: start, after prepare, after forward, after sample)."""
        if self.cuda:
            self.marks[-1].synchronize()  # type: ignore[attr-defined]
            spans = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]  # type: ignore
        else:
            spans = [b - a for a, b in zip(self.marks, self.marks[1:])]  # type: ignore[operator]
        prepare, forward, sample = (spans + [0.0, 0.0, 0.0])[:3]
        return StepTiming(duration_s=sum(spans), prepare_s=prepare, forward_s=forward, sample_s=sample,
                          padded_batch_size=padded_batch_size)


class StepProfiler:
    """torch.profiler around the executor's steps; each step is one `record_function` range named as vLLM
    names it. On from construction when `profile_dir` is given (the executor's lifetime), or between
    `start(dir)` and `stop()` (vLLM's `/start_profile` and `/stop_profile`)."""

    def __init__(self, profile_dir: Optional[str | Path], device: torch.device) -> None:
        self.device = device
        self.dir: Optional[Path] = None
        self.prof: Optional[torch.profiler.profile] = None
        if profile_dir:
            self.start(profile_dir)

    @property
    def enabled(self) -> bool:
        return self.prof is not None

    def start(self, profile_dir: str | Path) -> None:
        """Begin recording (a running profile keeps running: vLLM ignores a second start too)."""
        if self.prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.dir = Path(profile_dir)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=False)
        self.prof.__enter__()

    @contextlib.contextmanager
    def step(self, annotation: str) -> Iterator[None]:
        if self.prof is None:
            yield
            return
        with torch.profiler.record_function(annotation):
            yield

    def stop(self, name: str = "trace.json") -> Optional[Path]:
        """Stop recording and write `<profile_dir>/<name>` (chrome trace); returns its path (None when off)."""
        if self.prof is None or self.dir is None:
            return None
        self.prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / name
        self.prof.export_chrome_trace(str(path))
        self.prof = None
        logger.info("wrote the step trace to %s", path)
        return path

    def close(self) -> Optional[Path]:
        """Stop profiling and write `<profile_dir>/trace.json` (chrome trace); returns its path."""
        return self.stop()
