"""Profile servetwin's torch backend as vLLM's profiler does: a torch.profiler Chrome trace whose step
ranges carry vLLM's names (`servetwin.gpu.step_profiling`), written by the executor's `profile_dir`."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from servetwin.core.config_error import ConfigError


def profile_torch_run(exp: Any, profile_dir: str | Path, run_name: str = "profiled") -> tuple[dict, Path, float]:
    """Run `exp`'s workload offline on a torch engine with the profiler on: (the run's trace frames, the
    Chrome trace path, wall seconds). The experiment must list the torch backend."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.core.testbed.realtime import run_realtime  # noqa: PLC0415
    from servetwin.core.testbed.trace import TraceRecorder  # noqa: PLC0415
    from servetwin.experiments.workloads import build_requests  # noqa: PLC0415

    if "torch" not in exp.backends:
        raise ConfigError("backends", "profiling needs the torch backend in the experiment")
    args = dataclasses.replace(exp.engine_args("torch"), profile_dir=str(profile_dir))
    engine, info = create_engine_core(args)
    requests, _, _ = build_requests(exp, vocab_size=info.vocab_size)
    recorder = TraceRecorder(run_name, "torch")
    t0 = time.perf_counter()
    run_realtime(engine, requests, recorder, offline=True, seed=exp.seed, rejected={})
    wall = time.perf_counter() - t0
    path = info.executor.profiler.close()
    if path is None:
        raise RuntimeError("the torch executor wrote no profiler trace")
    return recorder.frames(), path, wall
