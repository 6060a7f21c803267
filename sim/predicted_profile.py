"""The simulator's answer to vLLM's `/start_profile` ... `/stop_profile`: the predicted steps in between,
written as the Chrome trace vLLM's torch profiler writes (`servetwin.core.testbed.step_ranges`), each
step a range named `execute_context_X(a)_generation_Y(b)` with its predicted duration as both the CPU
and the GPU range. The executor sees steps, not the idle time between them, so the ranges are laid back
to back from 0 (simulated seconds); compositions and durations are what the simulator predicted."""
from __future__ import annotations

from pathlib import Path

from servetwin.core.testbed.step_ranges import write_step_ranges


class PredictedProfile:
    def __init__(self, profile_dir: str | Path, number: int = 0) -> None:
        self.dir = Path(profile_dir)
        self.number = number
        self.steps: list[tuple[str, float, float]] = []
        self.t = 0.0

    def record(self, annotation: str, duration_s: float) -> None:
        self.steps.append((annotation, self.t, duration_s))
        self.t += duration_s

    def write(self) -> Path:
        """`<dir>/servetwin-sim.<number>.pt.trace.json`."""
        return write_step_ranges(self.dir / f"servetwin-sim.{self.number}.pt.trace.json", self.steps,
                                 process="servetwin sim (predicted steps)")
