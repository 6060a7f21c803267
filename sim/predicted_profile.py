"""The simulator's answer to vLLM's `/start_profile` ... `/stop_profile`: the predicted steps in between,
written as the Chrome trace vLLM's torch profiler writes (`servetwin.core.testbed.step_ranges`), each
step a range named `execute_context_X(a)_generation_Y(b)` with its predicted duration as both the CPU
and the GPU range. The executor sees steps, not the idle time between them, so the ranges are laid back
to back from 0 (simulated seconds); compositions and durations are what the simulator predicted."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from servetwin.core.testbed.step_ranges import write_step_ranges

logger = logging.getLogger(__name__)
# Steps one profile keeps (a running profile grew 57 MB in 92 s under load): about 100 MB of trace.
# Past it the steps are counted, not kept; /stop_profile's trace holds the first MAX_PROFILE_STEPS.
MAX_PROFILE_STEPS = 200_000


class PredictedProfile:
    def __init__(self, profile_dir: str | Path, number: int = 0) -> None:
        self.dir = Path(profile_dir)
        self.number = number
        self.steps: list[tuple[str, float, float]] = []
        self.dropped = 0
        self.t = 0.0

    def record(self, annotation: str, duration_s: float) -> None:
        if len(self.steps) < MAX_PROFILE_STEPS:
            self.steps.append((annotation, self.t, duration_s))
        else:
            self.dropped += 1
        self.t += duration_s

    @property
    def path(self) -> Path:
        return self.dir / f"servetwin-sim.{self.number}.pt.trace.json"

    def write(self) -> Path:
        """`<dir>/servetwin-sim.<number>.pt.trace.json` (renamed into place complete)."""
        if self.dropped:
            logger.warning("profile %s: kept the first %d steps, %d more not recorded (MAX_PROFILE_STEPS)",
                           self.path.name, MAX_PROFILE_STEPS, self.dropped)
        return write_step_ranges(self.path, self.steps, process="servetwin sim (predicted steps)")

    def write_in_background(self) -> tuple[Path, threading.Thread]:
        """`write` in a thread: the engine's step loop goes on while the trace is encoded and written
        (it appears complete, by an atomic rename, shortly after). The thread is not a daemon: a
        process that exits waits for the file."""
        thread = threading.Thread(target=self._write_logged, name=f"profile-{self.number}")
        thread.start()
        return self.path, thread

    def _write_logged(self) -> None:
        try:
            self.write()
        except OSError as e:  # the folder became unwritable after /start_profile checked it
            logger.error("profile %s not written: %s", self.path, e)
