"""MoE data parallelism in lockstep: the ranks of one DP group step together (vLLM 0.33 `DPEngineCoreProc`,
`v1/engine/core.py:2281-2572`).

Rules reproduced (one iteration of every rank's busy loop per group step):
- a global step barrier: every rank runs one forward per step (the MoE layers' collectives synchronise them),
  so a step lasts the longest rank's time, and all ranks start the next step together;
- token padding across ranks: every rank's batch is padded to the largest token count of the step
  (`coordinate_batch_across_dp`, `v1/worker/dp_utils.py:190-224`); `padded_tokens` counts the padding;
- dummy batches: while the wave runs (`engines_running`), a rank that executed nothing runs a dummy batch of
  the padded size (`core.py:2497-2512`), priced as that many one-token rows with no KV;
- the all-ranks-finished check (`_has_global_unfinished_reqs`, `core.py:2554-2572`): the step counter of the
  wave counts every step; the all-reduce of "has unfinished requests" runs on step 1 and every
  `dp_sync_interval` (16, `config/parallel.py:163`) steps; the wave ends at the first such check where no
  rank has an unfinished request, so ranks run dummy batches up to the next multiple of 16 after the last
  request finished;
- wave start: a request reaching an idle group starts a wave; the other ranks join after the coordinator's
  START_DP_WAVE broadcast (`coordinator.py:426-456`, `core.py:2372-2434`), `wave_start_latency_s` later
  (assumed 1 ms: a ZMQ round trip through the coordinator, not measured here).
Not modelled: the all-reduce's own time, `prefill_schedule_interval` (default off), the coordinator's
step-synchronised stats snapshots (the dense publishing rule is used).
"""
from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from servetwin.sim.cost_model import StepSummary

DP_SYNC_INTERVAL = 16  # vLLM config/parallel.py:163 (dp_sync_interval)
WAVE_START_LATENCY_S = 1e-3  # assumed (see the module docstring)
MAX_STALLED_STEPS = 100_000  # group steps without a token while a rank holds requests: a stall


@dataclass(slots=True)
class GroupStep:
    """One lockstep step, as recorded for tests and outputs."""
    t_start: float
    duration: float
    tokens: list[int]  # per rank, scheduled (before padding)
    dummy_ranks: list[int]
    wave: int
    step_in_wave: int  # the step counter after this step (1, 2, ...)
    unfinished: bool = True  # some rank still had an unfinished request after the step
    wave_ended: bool = False  # the all-reduce after this step ended the wave

    @property
    def padded_tokens(self) -> int:
        top = max(self.tokens)
        return sum(top - t for t in self.tokens)


@dataclass(slots=True)
class LockstepStats:
    steps: list[GroupStep] = field(default_factory=list)
    waves: int = 0

    @property
    def dummy_batches(self) -> int:
        return sum(len(s.dummy_ranks) for s in self.steps)

    @property
    def padded_tokens(self) -> int:
        return sum(s.padded_tokens for s in self.steps)


def dummy_batch_s(executor: Any, num_tokens: int) -> float:
    """A dummy forward of `num_tokens` one-token rows with no KV on the executor's cost model."""
    n = max(1, num_tokens)
    return executor.cost_model.predict(StepSummary.from_lists([1] * n, [0] * n, 0)).duration_s


class LockstepGroup:
    """Drives the ranks' `Simulation`s (their own engine processes not started) in lockstep."""

    def __init__(self, env: simpy.Environment, sims: Sequence[Any], settle: Callable[[], Any],
                 sync_interval: int = DP_SYNC_INTERVAL, wave_start_latency_s: float = WAVE_START_LATENCY_S) -> None:
        self.env = env
        self.sims = list(sims)
        self.settle = settle
        self.sync_interval = sync_interval
        self.wave_start_latency_s = wave_start_latency_s
        self.stats = LockstepStats()
        self._dummy_cache: dict[int, float] = {}

    def _dummy_s(self, num_tokens: int) -> float:
        d = self._dummy_cache.get(num_tokens)
        if d is None:
            d = self._dummy_cache[num_tokens] = dummy_batch_s(self.sims[0].engine.executor, num_tokens)
        return d

    def _boundary(self) -> None:
        for sim in self.sims:
            if sim.on_step_boundary is not None:
                sim.on_step_boundary(sim)

    def _take_inputs(self) -> Generator[simpy.Event, Any, None]:
        yield self.settle()
        for sim in self.sims:
            sim.take_inputs()
        self._boundary()

    def process(self) -> Generator[simpy.Event, Any, None]:
        env, sims = self.env, self.sims
        running = False
        step_in_wave = stalled = 0
        while True:
            if not running:
                if not any(s.has_inputs() or s.engine.has_work() for s in sims):
                    if all(s.all_submitted() for s in sims):
                        return
                    wake = env.event()
                    for s in sims:
                        s.set_wake(wake)
                    yield wake
                    for s in sims:
                        s.set_wake(None)
                yield from self._take_inputs()
                if not any(s.engine.has_work() for s in sims):
                    continue
                running, step_in_wave = True, 0  # a wave starts: the other ranks join after the broadcast
                self.stats.waves += 1
                if self.wave_start_latency_s > 0 and len(sims) > 1:
                    yield env.timeout(self.wave_start_latency_s)
            yield from self._take_inputs()
            t0 = env.now
            stepped = []
            for s in sims:
                if s.engine.has_work():
                    result, d = s.step_engine()
                    so = result.scheduled
                    stepped.append((result, d, so.total_num_scheduled_tokens if so is not None else 0))
                else:
                    stepped.append((None, 0.0, 0))
            tokens = [t for _, _, t in stepped]
            dummies = [i for i, t in enumerate(tokens) if t == 0]
            top = max(tokens)
            own = [d for _, d, t in stepped if t > 0]
            duration = max(own + ([self._dummy_s(top)] if dummies else []))
            stalled = stalled + 1 if top == 0 and any(s.engine.has_work() for s in sims) else 0
            if stalled > MAX_STALLED_STEPS:
                raise RuntimeError(f"lockstep DP group stalled at t={t0:.6f}s: ranks hold requests but schedule nothing")
            done_at = []
            for s, (result, _, t) in zip(sims, stepped):
                if result is not None:
                    done_at.append((s, result, s.record_step(result, t0, duration if t > 0 else 0.0)[1]))
            yield env.timeout(duration)
            for s, result, t_done in done_at:
                if t_done > t0:
                    s.complete_step(result, t_done)
            self._boundary()
            step_in_wave += 1
            unfinished = any(s.engine.scheduler.has_unfinished_requests() for s in sims)
            if step_in_wave == 1 or step_in_wave % self.sync_interval == 0:  # the all-reduce
                running = unfinished  # no rank has one: the wave ends
            self.stats.steps.append(GroupStep(t0, duration, tokens, dummies, self.stats.waves, step_in_wave,
                                              unfinished, not running))


__all__ = ["LockstepGroup", "LockstepStats", "GroupStep", "dummy_batch_s", "DP_SYNC_INTERVAL",
           "WAVE_START_LATENCY_S"]
