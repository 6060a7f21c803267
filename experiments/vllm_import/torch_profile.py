"""Profile servetwin's torch backend as vLLM's profiler does: a torch.profiler Chrome trace whose step
ranges carry vLLM's names (`servetwin.gpu.step_profiling`), between a start and a stop as vLLM's
`/start_profile` and `/stop_profile` bracket a benchmark."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Optional

from servetwin.core.config_error import ConfigError


def profile_torch_run(exp: Any, profile_dir: str | Path, run_name: str = "profiled", warmup: bool = False,
                      threads: Optional[int] = None) -> tuple[dict, Path, float]:
    """Run `exp`'s workload offline on a torch engine with the profiler on: (the run's trace frames - the
    engine steps as `servetwin run` times them -, the Chrome trace path, wall seconds). `warmup`: run the
    workload once unprofiled first (first-call costs stay out of the trace); `threads`: torch CPU threads."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.core.testbed.realtime import run_realtime  # noqa: PLC0415
    from servetwin.core.testbed.trace import TraceRecorder  # noqa: PLC0415
    from servetwin.experiments.calibrate.torch_measure import set_torch_threads  # noqa: PLC0415
    from servetwin.experiments.config.workloads import build_requests  # noqa: PLC0415

    if "torch" not in exp.backends:
        raise ConfigError("backends", "profiling needs the torch backend in the experiment")
    if threads is not None:
        set_torch_threads(threads)
    args = exp.engine_args("torch")
    engine, info = create_engine_core(args)
    requests, _, _ = build_requests(exp, vocab_size=info.vocab_size)
    if warmup:
        run_realtime(engine, [dataclasses.replace(r) for r in requests], TraceRecorder("warmup", "torch"),
                     offline=True, seed=exp.seed, rejected={})
        info.executor.reset()
        engine, _ = create_engine_core(args, info=info)
    recorder = TraceRecorder(run_name, "torch")
    info.executor.profiler.start(profile_dir)
    t0 = time.perf_counter()
    run_realtime(engine, requests, recorder, offline=True, seed=exp.seed, rejected={})
    wall = time.perf_counter() - t0
    path = info.executor.profiler.stop()
    assert path is not None
    return recorder.frames(), path, wall
