"""Measuring on the torch backend, shared by `servetwin run`, `servetwin compare` and (threads,
contention threshold) `servetwin calibrate`.

- Threads: the torch thread count of a measured run is `--threads`, else the calibration's
  `torch_threads` (the simulator's step costs were fitted with that many), else torch's default.
- Warm-up: a short run of a few prompts on a throwaway engine over the same executor before the
  measured run (first-call costs: allocator growth, kernel selection, lazy imports), not recorded.
- Contention: the executor reports each step's process CPU time (`timing.cpu_s`) to its
  `step_observers`. With `t` torch threads a step that kept its cores for its whole wall time used
  about `t x wall` CPU seconds; `cpu_share = cpu_s / (wall x t)` below `CONTENDED_BELOW` means other
  processes took the core for part of the step, so its duration is not the machine's. A run in which
  more than `max_contended_share` of the steps are contended can be run again (`retry_contended`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

CONTENDED_BELOW = 0.9


def set_torch_threads(threads: Optional[int]) -> int:
    """Set torch's CPU thread count (None: leave it); returns the count now."""
    import torch  # noqa: PLC0415

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads: must be >= 1, got {threads}")
        torch.set_num_threads(int(threads))
    return int(torch.get_num_threads())


def load_average() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass(slots=True)
class MeasureOptions:
    """How a torch run is measured (`servetwin run --threads/--retry-contended/--no-warmup`)."""
    threads: Optional[int] = None  # None: the calibration's torch_threads, else torch's default
    warmup: bool = True
    retry_contended: int = 0  # run a contended run again, at most this many times in all
    max_contended_share: float = 0.05  # more contended steps than this make a run contended

    def __post_init__(self) -> None:
        # the flags' names: these come from the command line
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads: must be >= 1, got {self.threads}")
        if self.retry_contended < 0:
            raise ValueError(f"--retry-contended: must be >= 0, got {self.retry_contended}")
        if not 0.0 <= self.max_contended_share <= 1.0:
            raise ValueError(f"--max-contended-share: must be in [0, 1], got {self.max_contended_share}")


@dataclass(slots=True)
class MeasuredRun:
    """One measured run: what the caller's run returned, its wall time and per-step CPU shares."""
    result: Any
    wall_s: float
    cpu_share: np.ndarray  # per recorded step, in the order of `steps`
    contended_share: float


@dataclass(slots=True)
class Measurement:
    kept: list[MeasuredRun] = field(default_factory=list)
    discarded: list[dict[str, Any]] = field(default_factory=list)


def calibration_info(exp: Any) -> tuple[str, dict[str, Any]]:
    """(the hardware used: file path or preset name, its provenance)."""
    from servetwin.sim.hardware import hardware_from_dict, load_hardware  # noqa: PLC0415

    hw = exp.hardware
    spec = hardware_from_dict(hw, "hardware") if isinstance(hw, dict) else load_hardware(hw)
    label = hw if isinstance(hw, str) else f"inline mapping ({spec.name})"
    return label, dict(spec.provenance or {})


def apply_threads(exp: Any, threads: Optional[int]) -> tuple[int, str]:
    """Set torch's thread count for a measured run: (threads now, where the number came from)."""
    source = "--threads"
    if threads is None:
        cal = calibration_info(exp)[1].get("torch_threads")
        if isinstance(cal, int):
            threads, source = cal, "the calibration's torch_threads"
        else:
            source = "torch's default"
    return set_torch_threads(threads), source


def warm_up(args: Any, info: Any, requests: list, n: int = 4, max_tokens: int = 4) -> float:
    """A short unrecorded run of the first `n` prompts on a throwaway engine over `info`'s executor
    (`args`: the torch engine's arguments); the executor forgets them after. Returns its wall time."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.core.request import Request  # noqa: PLC0415
    from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415

    t0 = time.perf_counter()
    engine, _ = create_engine_core(args, info=info)
    for i, r in enumerate(requests[:n]):
        prompt = list(r.prompt_token_ids)[:max(1, info.max_model_len - max_tokens)]
        engine.add_request(Request(f"__warmup{i}", prompt,
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                                   arrival_time=0.0))
    while engine.has_work():
        engine.step()
    info.executor.reset()
    return time.perf_counter() - t0


@contextlib.contextmanager
def cpu_timed(executor: Any, cpu_s: dict[int, float]) -> Iterator[None]:
    """Record the process CPU time of every executed step (`cpu_s[step]`) through the executor's
    `step_observers` hook."""
    def observe(scheduler_output: Any, model_output: Any) -> None:
        timing = model_output.timing
        if timing is not None and timing.cpu_s is not None:
            cpu_s[scheduler_output.step] = timing.cpu_s

    executor.step_observers.append(observe)
    try:
        yield
    finally:
        executor.step_observers.remove(observe)


def cpu_shares(steps: Any, cpu_s: dict[int, float], nthreads: int) -> np.ndarray:
    """`cpu_share` of every row of a steps table (NaN where the executor reported no CPU time)."""
    cpu = np.array([cpu_s.get(int(k), np.nan) for k in steps.step.to_numpy()], dtype=float)
    return cpu / (steps.duration_s.to_numpy(dtype=float) * nthreads)


def contended_share(share: np.ndarray) -> float:
    return float(np.mean(np.asarray(share, dtype=float) < CONTENDED_BELOW)) if len(share) else 0.0


def contention_summary(share: np.ndarray) -> dict[str, Any]:
    share = np.asarray(share, dtype=float)
    return {
        "definition": (f"cpu_share = process CPU time of the step / (wall time x torch threads); a step with "
                       f"cpu_share < {CONTENDED_BELOW} lost its core to other processes for part of the step"),
        "median_cpu_share": float(np.nanmedian(share)) if share.size and np.isfinite(share).any() else None,
        "contended_step_share": contended_share(share) if share.size else None,
    }


def measure(run_once: Callable[[dict[int, float]], tuple[Any, Any, float]], executor: Any, nthreads: int, *,
            repeats: int = 1, retry_contended: int = 0, max_contended_share: float = 0.05,
            log: Callable[[str], None] = lambda m: print(m, file=sys.stderr), label: str = "torch run",
            stop: Callable[[Any], bool] = lambda result: False) -> Measurement:
    """`repeats` measured runs, each `run_once(cpu_s) -> (result, steps table, wall seconds)` under
    `cpu_timed(executor, cpu_s)`; a run with more than `max_contended_share` contended steps is
    discarded and run again, at most `retry_contended` times in all. `stop(result)` true (e.g. an
    interrupted run) keeps that run and ends the measurement."""
    out = Measurement()
    while len(out.kept) < repeats:
        cpu_s: dict[int, float] = {}
        with cpu_timed(executor, cpu_s):
            result, steps, wall = run_once(cpu_s)
        share = cpu_shares(steps, cpu_s, nthreads)
        contended = contended_share(share)
        r = len(out.kept)
        of = f" {r + 1}/{repeats}" if repeats > 1 else ""
        span = float(steps.t_end_s.max()) if len(steps) else 0.0
        if stop(result):
            out.kept.append(MeasuredRun(result, wall, share, contended))
            break
        if contended > max_contended_share and len(out.discarded) < retry_contended:
            out.discarded.append({"attempt": r + len(out.discarded) + 1, "contended_step_share": contended,
                                  "makespan_s": span, "wall_s": wall, "load_average": load_average()})
            log(f"{label}{of}: {contended * 100:.0f}% of the steps lost their CPU to other processes; "
                f"discarded, running it again ({len(out.discarded)}/{retry_contended})")
            continue
        out.kept.append(MeasuredRun(result, wall, share, contended))
        log(f"{label}{of}: {len(steps)} steps, {span:.3f}s measured, {contended * 100:.0f}% contended steps")
    return out


CONTENDED_ADVICE = ("the measured times are inflated by other load on this machine; run it again on a quiet "
                    "machine or with --retry-contended K")


def is_contended(contention: dict[str, Any], max_contended_share: float) -> bool:
    share = contention.get("contended_step_share")
    return share is not None and share > max_contended_share


def contention_warning(contention: dict[str, Any], max_contended_share: float) -> Optional[str]:
    """The console warning for a run with too many contended steps, else None."""
    if not is_contended(contention, max_contended_share):
        return None
    median = contention.get("median_cpu_share") or 0.0
    return (f"{contention['contended_step_share'] * 100:.0f}% of the measured steps lost their CPU to other "
            f"processes (cpu_share < {CONTENDED_BELOW}; median cpu_share {median:.2f}): {CONTENDED_ADVICE}")
