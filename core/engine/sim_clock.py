"""`SimClock`: the simulated time of an engine whose executor predicts its step durations (backend `sim`).

The sim executor reports each step's predicted duration (`ModelRunnerOutput.timing.duration_s`).
Wherever that engine runs - in the caller's process, in the EngineCore process, paced or not - this
clock turns the durations into simulated times, so the front end can report *predicted* times next to
the host's wall clock:

- while the engine has work, its steps follow each other back to back in simulated time (host time
  between steps is not part of the prediction);
- unpaced, an idle engine's clock stands still: a request added to it arrives at the current simulated
  time (the end of the last step), so `LLM.generate` calls see the time they would take on the
  modelled hardware, one after the other;
- paced (`sim_now` given: the wall clock mapped onto simulated time), a request arrives at `sim_now`
  and the first step after an idle period starts at `max(end of the previous step, sim_now)`.

A step's outputs carry the simulated end of the step that computed them (`on_step` returns it; in
async mode that is the previous step). Nothing here reads the host clock.
"""
from __future__ import annotations

from typing import Any, Optional


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0  # end of the latest scheduled step
        self.busy_s = 0.0  # total predicted duration of the steps run
        self._step_end: dict[int, float] = {}
        self._arrivals: dict[str, float] = {}  # request id -> simulated arrival, until taken

    def on_add(self, request_id: str, sim_now: Optional[float] = None) -> float:
        """Stamp a request's simulated arrival (paced: `sim_now`, at the latest the engine's clock)."""
        t = self.now if sim_now is None else float(sim_now)
        self._arrivals[request_id] = t
        return t

    def take_arrivals(self) -> dict[str, float]:
        """The arrivals stamped since the last call (sent with the next outputs message)."""
        out, self._arrivals = self._arrivals, {}
        return out

    def on_step(self, result: Any, sim_now: Optional[float] = None) -> Optional[float]:
        """Advance by the scheduled step's predicted duration; returns the simulated end of the step
        whose outputs `result` processed (None when it processed none). `sim_now` only after an idle
        period of a paced engine."""
        so = result.scheduled
        timing = result.model_output.timing if so is not None and result.model_output is not None else None
        duration = max(0.0, float(timing.duration_s)) if timing is not None else 0.0
        # a step with no tokens takes time only when it waited (for a KV connector's transfers)
        if so is not None and (so.total_num_scheduled_tokens > 0 or duration > 0):
            start = self.now if sim_now is None else max(self.now, sim_now)
            self.now = start + duration
            self.busy_s += duration if so.total_num_scheduled_tokens > 0 else 0.0
            self._step_end[so.step] = self.now
        if result.processed is None:
            return None
        return self._step_end.pop(result.processed.step, None)
