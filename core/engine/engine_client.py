"""Engine-core clients. `InprocClient` runs the `EngineCore` in the caller's process;
`servetwin.core.engine.mp_client.SyncMPClient` / `AsyncMPClient` run it in a separate process (ZMQ + msgspec).
`servetwin.core.engine.core_client.make_client` picks one, like vLLM's `EngineCoreClient.make_client`
(a module of its own, so neither client module imports the other's)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore, StepResult
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.engine.executor import ExecutorInfo
from servetwin.core.outputs import EngineCoreOutput
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.engine.sim_clock import SimClock


class EngineDeadError(RuntimeError):
    """The engine-core process died; pending and later calls fail with this instead of hanging."""


class EngineCoreClient:
    """What `LLMEngine` / `AsyncLLM` need from an engine core, wherever it runs.

    On the `sim` backend `last_sim_time_s` is the simulated end of the step whose outputs
    `get_output` returned last, and `sim_arrivals` collects the simulated arrival of each engine
    request (taken by the output processor); elsewhere they stay None / empty."""

    config: Any
    last_sim_time_s: Optional[float] = None
    sim_arrivals: dict[str, float]

    def validate_params(self, params: SamplingParams) -> None:
        """Raise a ValueError naming the field if `params` cannot be used with this client."""

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Adds / aborts inside the block reach the engine together (in-process: they already do)."""
        yield

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    def __init__(self, args: EngineArgs) -> None:
        self.engine_core, self.info = create_engine_core(args)
        self.last_step: Optional[StepResult] = None
        self.clock = SimClock() if args.backend == "sim" else None
        self.sim_arrivals = {}

    @property
    def config(self) -> ExecutorInfo:
        return self.info

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, parent_id: Optional[str] = None) -> None:
        self.engine_core.add_request(Request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                             priority=priority, cache_salt=cache_salt, parent_id=parent_id))
        if self.clock is not None:
            self.sim_arrivals[request_id] = self.clock.on_add(request_id)
            self.clock.take_arrivals()  # handed over directly, not by message

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        """Run engine steps until some output appears or no work is left."""
        while self.engine_core.has_work():
            self.last_step = self.engine_core.step()
            end = self.clock.on_step(self.last_step) if self.clock is not None else None
            if self.last_step.outputs:
                self.last_sim_time_s = end
                return self.last_step.outputs
        return []

    def has_work(self) -> bool:
        return self.engine_core.has_work()

    def utility(self, name: str, *args: Any) -> Any:
        result = call_utility(self.engine_core, name, *args)
        if name == "get_stats":  # the same keys as the engine process gives
            clock = self.clock
            result = dict(result, sim_time_s=clock.now if clock else 0.0, sim_busy_s=clock.busy_s if clock else 0.0)
        return result

    def shutdown(self) -> None:
        close = getattr(self.engine_core.executor, "close", None)
        if close is not None:
            close()


def spec_decode_totals(engine_core: EngineCore) -> dict[str, Any]:
    """vLLM's spec-decode counters since start, under its metric names without `vllm:` ({} when off)."""
    totals = engine_core.spec_decoding_totals
    if totals is None:
        return {}
    return {"spec_decode_num_drafts": totals.num_drafts, "spec_decode_num_draft_tokens": totals.num_draft_tokens,
            "spec_decode_num_accepted_tokens": totals.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(totals.num_accepted_tokens_per_pos)}


def kv_connector_totals(engine_core: EngineCore) -> dict[str, Any]:
    """vLLM's KV-connector counters since start, under its metric names without `vllm:` ({} without a
    connector): the external prefix cache (v1/metrics/loggers.py:685-706) and, where the executor
    models a CPU tier's transfers, the offloading connector's bytes
    (distributed/kv_transfer/kv_connector/v1/offloading/metrics.py:42-47)."""
    if engine_core.scheduler.connector is None:
        return {}
    out: dict[str, Any] = {"external_prefix_cache_queries": engine_core.external_prefix_cache_queries,
                           "external_prefix_cache_hits": engine_core.external_prefix_cache_hits}
    transfer_totals = getattr(engine_core.executor, "kv_transfer_totals", None)
    if transfer_totals is not None:
        out.update(transfer_totals())
    return out


def call_utility(engine_core: EngineCore, name: str, *args: Any) -> Any:
    """Utility calls the clients forward to the engine core."""
    sched = engine_core.scheduler
    if name == "reset_prefix_cache":
        return sched.reset_prefix_cache(*args)
    if name == "get_stats":
        kv = sched.kv_cache_manager
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_cache_usage": kv.usage, "num_free_blocks": kv.num_free_blocks,
                "num_gpu_blocks": kv.block_pool.num_gpu_blocks, "num_preemptions": sched.num_preemptions_total,
                **spec_decode_totals(engine_core), **kv_connector_totals(engine_core)}
    if name in ("start_profile", "stop_profile"):  # vLLM's profiler endpoints: the executor's, where it has one
        method = getattr(engine_core.executor, name, None)
        if method is None:
            raise ValueError(f"{name}: the {type(engine_core.executor).__name__} backend has no profiler")
        return method(*args)
    raise ValueError(f"utility: unknown call {name!r} (allowed: 'reset_prefix_cache', 'get_stats', "
                     "'start_profile', 'stop_profile')")
