"""`EngineCore`: schedule -> executor.execute_model -> update_from_output, with vLLM's batch queue.

The queue holds `SchedulerConfig.max_concurrent_batches` batches: two with `async_scheduling`, PP with
pipeline parallelism. Step t+1 is scheduled (and launched) before the output of step t is processed,
exactly like vLLM's `step_with_batch_queue` (vLLM 0.33 v1/engine/core.py:708). An executor with
`supports_non_block` (the pipeline-parallel `MultiprocExecutor`) returns a future from
`execute_model(so, non_block=True)`; it is waited for when its batch leaves the queue, so the stages
run earlier batches while the scheduler builds the next.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.executor import Executor
from servetwin.core.outputs import EngineCoreOutput, ModelRunnerOutput
from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sched.scheduler import Scheduler, SchedulerStats
from servetwin.core.sched.spec_decode import SpecDecodingStats, SpeculativeConfig


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
                 log_stats: bool = True, speculative_config: Optional[SpeculativeConfig] = None,
                 kv_transfer_config: Optional[KVTransferConfig] = None) -> None:
        scheduler_cls = getattr(executor, "scheduler_cls", Scheduler)
        if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, Scheduler)):
            raise TypeError(f"scheduler_cls: {scheduler_cls!r} of {type(executor).__name__} "
                            "is not a Scheduler subclass")
        # the torch executor's copy has its pool's kv_bytes_per_block filled in: the scheduler's connector
        # is built from it when there is one
        kv_transfer_config = getattr(executor, "kv_transfer_config", None) or kv_transfer_config
        self.scheduler = scheduler_cls(scheduler_config, cache_config, log_stats=log_stats,
                                       speculative_config=speculative_config,
                                       kv_transfer_config=kv_transfer_config)
        # vLLM's check_for_draft_tokens: sync scheduling takes the drafts after each step (post_step)
        self.check_for_draft_tokens = speculative_config is not None and not scheduler_config.async_scheduling
        # vLLM's spec-decode counters since start (v1/spec_decode/metrics.py), for get_stats / /metrics
        self.spec_decoding_totals = (SpecDecodingStats.new(speculative_config.num_speculative_tokens)
                                     if speculative_config is not None else None)
        # vLLM's external (KV connector) prefix-cache counters since start (v1/metrics/loggers.py:685-706)
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.executor = executor
        # (a ModelRunnerOutput, or a Future of one from a `non_block` call; typed Any so that `step` passes
        # the others on without the isinstance test: speed)
        self.batch_queue: deque[tuple[SchedulerOutput, Any]] = deque()
        self.batch_queue_size = scheduler_config.max_concurrent_batches
        self._non_block = self.batch_queue_size > 1 and getattr(executor, "supports_non_block", False)
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
            connector_hits = result.stats.connector_prefix_cache_stats
            if connector_hits is not None:
                self.external_prefix_cache_queries += connector_hits.queries
                self.external_prefix_cache_hits += connector_hits.hits
            # (`non_block` only for an executor that says `supports_non_block`, e.g. the PP MultiprocExecutor;
            # only such a call can return a Future, so the others skip the isinstance test: speed)
            execute: Any = self.executor.execute_model
            if self._non_block:
                mro = execute(so, non_block=True)
                result.model_output = None if isinstance(mro, Future) else mro
            else:
                mro = result.model_output = execute(so)
            self.batch_queue.appendleft((so, mro))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.batch_queue) < self.batch_queue_size and (executed or scheduler.has_requests()):
                self.step_counter += 1
                return result  # async: don't block on this batch yet
        if self.batch_queue:
            pso, pmro = self.batch_queue.pop()
            result.processed = pso
            result.outputs = self._update_from_output(pso, _resolved(pmro) if self._non_block else pmro)
            if self.check_for_draft_tokens:  # (speed: the call only when drafts can be taken)
                self.post_step(pso.total_num_scheduled_tokens > 0)
        if result.scheduled is not None or result.processed is not None:
            self.step_counter += 1  # a call with nothing to do is not a step
        return result

    def _update_from_output(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(so, mro)
        if self.spec_decoding_totals is not None:  # (speed: the scheduler's stats read only when drafting)
            step_stats = self.scheduler.last_spec_decoding_stats
            if step_stats is not None:
                self.spec_decoding_totals.merge(step_stats)
        return outputs

    def post_step(self, model_executed: bool) -> None:
        """vLLM's `EngineCore.post_step` (v1/engine/core.py:699-706): under sync scheduling the
        executor's drafts for the batch just processed go to the scheduler for the next step; under
        async scheduling the scheduler already holds placeholders and the worker keeps the drafts."""
        if self.check_for_draft_tokens and model_executed:
            take = getattr(self.executor, "take_draft_token_ids", None)
            draft_token_ids = take() if take is not None else None
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    def drain(self) -> list[StepResult]:
        """Process every batch still queued (async mode) without scheduling new ones."""
        results = []
        while self.batch_queue:
            pso, pmro = self.batch_queue.pop()
            results.append(StepResult(processed=pso, outputs=self._update_from_output(pso, _resolved(pmro))))
        return results


def _resolved(output: ModelRunnerOutput | Future) -> ModelRunnerOutput:
    """A batch's output, waiting for it when it is still in flight."""
    return output.result() if isinstance(output, Future) else output
