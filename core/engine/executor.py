"""The `Executor` protocol that backends implement, and the deterministic fake executor."""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from servetwin.core.outputs import ModelRunnerOutput, StepTiming
from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.engine.runner_state import RunnerState


@runtime_checkable
class Executor(Protocol):
    """Executes one `SchedulerOutput` and returns the sampled tokens (and the step's timing)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class FakeExecutor:
    """Deterministic tokens, never EOS: row r of step s samples `(s*7 + r) % 1000 + 10`.

    This is the token rule of the recorded vLLM oracle (`../shared/oracle`). `step_time_s` is the
    (constant) duration reported per step.
    """

    def __init__(self, step_time_s: float = 0.0) -> None:
        self.state = RunnerState()
        self.step_time_s = step_time_s

    def reset(self) -> None:
        """Forget every request (a new engine over this executor starts from an empty runner state)."""
        self.state = RunnerState()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        rows = self.state.update(scheduler_output)
        step = scheduler_output.step
        sampled: list[list[int]] = []
        for r, row in enumerate(rows):
            if row.samples:
                tok = (step * 7 + r) % 1000 + 10
                sampled.append([tok])
                self.state.append_sampled(row.req_id, [tok])
            else:
                sampled.append([])
        ids = [row.req_id for row in rows]
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
            timing=StepTiming(duration_s=self.step_time_s),
        )


def make_executor(name: str, **kwargs) -> Executor:
    """Find an executor by name with a lazy import, so core never imports a backend at load time."""
    if name == "fake":
        return FakeExecutor(**kwargs)
    if name == "sim":
        from servetwin.sim.executor import SimExecutor  # noqa: PLC0415
        return SimExecutor(**kwargs)
    if name == "torch":
        from servetwin.gpu.executor import TorchExecutor  # noqa: PLC0415
        return TorchExecutor(**kwargs)
    raise ValueError(f"backend: unknown executor {name!r} (allowed: 'fake', 'sim', 'torch')")


__all__ = ["Executor", "FakeExecutor", "make_executor", "Optional"]
