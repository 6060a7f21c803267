"""servetwin core: the vLLM-v1-identical scheduler, KV block manager, engine core and front end.

Pure Python: never imports torch or simpy. Backends are found by name through the `servetwin.executors` entry points.
"""
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.request import FinishReason, Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.scheduler import Scheduler

__all__ = ["CacheConfig", "SchedulerConfig", "EngineCore", "FinishReason", "Request", "RequestStatus",
           "SamplingParams", "Scheduler", "LLM"]


def __getattr__(name: str):
    if name == "LLM":
        from servetwin.core.engine.llm import LLM  # noqa: PLC0415
        return LLM
    raise AttributeError(f"module 'servetwin.core' has no attribute {name!r}")
