"""`EngineCore`: schedule -> executor.execute_model -> update_from_output, with vLLM's batch queue.

With `async_scheduling` the queue is two deep: step t+1 is scheduled (and launched) before the output
of step t is processed, exactly like vLLM's `step_with_batch_queue`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.executor import Executor
from servetwin.core.outputs import EngineCoreOutput, ModelRunnerOutput
from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sched.scheduler import Scheduler, SchedulerStats


@dataclass(slots=True)
class StepResult:
    """What one engine step did: the batch it scheduled and the (older, in async mode) batch it processed."""
    scheduled: Optional[SchedulerOutput] = None
    model_output: Optional[ModelRunnerOutput] = None  # output of `scheduled` (executed at once)
    stats: Optional[SchedulerStats] = None  # right after `scheduled` was built
    processed: Optional[SchedulerOutput] = None
    outputs: list[EngineCoreOutput] = field(default_factory=list)

    @property
    def finished(self) -> list[EngineCoreOutput]:
        return [o for o in self.outputs if o.finish_reason is not None]


class EngineCore:
    """The engine loop around one scheduler and one executor.

    The scheduler is vLLM's (`Scheduler`) unless the executor names a subclass it needs in a
    `scheduler_cls` attribute (vLLM's `SchedulerConfig.scheduler_cls` plays that part there): the
    simulator's executor runs the implicit decode rows only its `SimScheduler` produces. An executor
    with a KV connector's worker side names the scheduler side's config in `kv_transfer_config`.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, executor: Executor,
                 log_stats: bool = True) -> None:
        scheduler_cls = getattr(executor, "scheduler_cls", Scheduler)
        if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, Scheduler)):
            raise TypeError(f"scheduler_cls: {scheduler_cls!r} of {type(executor).__name__} "
                            "is not a Scheduler subclass")
        kv_transfer_config = getattr(executor, "kv_transfer_config", None)
        extra = {} if kv_transfer_config is None else {"kv_transfer_config": kv_transfer_config}
        self.scheduler = scheduler_cls(scheduler_config, cache_config, log_stats=log_stats, **extra)
        self.executor = executor
        self.batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.batch_queue_size = 2 if scheduler_config.async_scheduling else 1
        self.step_counter = 0
        self._aborts_during_step: list[str] = []

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self, step_index: Optional[int] = None) -> StepResult:
        """One engine iteration. Returns an empty result when there is nothing to do."""
        result = StepResult()
        scheduler = self.scheduler
        if scheduler.has_requests():
            so = scheduler.schedule()
            so.step = self.step_counter if step_index is None else step_index
            result.scheduled = so
            result.stats = scheduler.make_stats()
            mro = self.executor.execute_model(so)
            result.model_output = mro
            self.batch_queue.appendleft((so, mro))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.batch_queue) < self.batch_queue_size and (executed or scheduler.has_requests()):
                self.step_counter += 1
                return result  # async: don't block on this batch yet
        if self.batch_queue:
            pso, pmro = self.batch_queue.pop()
            result.processed = pso
            result.outputs = scheduler.update_from_output(pso, pmro)
        if result.scheduled is not None or result.processed is not None:
            self.step_counter += 1  # a call with nothing to do is not a step
        return result

    def drain(self) -> list[StepResult]:
        """Process every batch still queued (async mode) without scheduling new ones."""
        results = []
        while self.batch_queue:
            pso, pmro = self.batch_queue.pop()
            results.append(StepResult(processed=pso, outputs=self.scheduler.update_from_output(pso, pmro)))
        return results
