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


class EngineDeadError(RuntimeError):
    """The engine-core process died; pending and later calls fail with this instead of hanging."""


class EngineCoreClient:
    """What `LLMEngine` / `AsyncLLM` need from an engine core, wherever it runs."""

    config: Any

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

    @property
    def config(self) -> ExecutorInfo:
        return self.info

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, parent_id: Optional[str] = None) -> None:
        self.engine_core.add_request(Request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                             priority=priority, cache_salt=cache_salt, parent_id=parent_id))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        """Run engine steps until some output appears or no work is left."""
        while self.engine_core.has_work():
            self.last_step = self.engine_core.step()
            if self.last_step.outputs:
                return self.last_step.outputs
        return []

    def has_work(self) -> bool:
        return self.engine_core.has_work()

    def utility(self, name: str, *args: Any) -> Any:
        return call_utility(self.engine_core, name, *args)

    def shutdown(self) -> None:
        close = getattr(self.engine_core.executor, "close", None)
        if close is not None:
            close()


def call_utility(engine_core: EngineCore, name: str, *args: Any) -> Any:
    """Utility calls the clients forward to the engine core."""
    sched = engine_core.scheduler
    if name == "reset_prefix_cache":
        return sched.reset_prefix_cache(*args)
    if name == "get_stats":
        kv = sched.kv_cache_manager
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_cache_usage": kv.usage, "num_free_blocks": kv.num_free_blocks,
                "num_gpu_blocks": kv.block_pool.num_gpu_blocks, "num_preemptions": sched.num_preemptions_total}
    raise ValueError(f"utility: unknown call {name!r} (allowed: 'reset_prefix_cache', 'get_stats')")
