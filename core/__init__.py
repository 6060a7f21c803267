"""servetwin core: the vLLM-v1-identical scheduler, KV block manager, engine core and front end.

Pure Python: never imports torch or simpy. Backends are found by name with a lazy import.
"""
from core.config import CacheConfig, SchedulerConfig
from core.engine_core import EngineCore
from core.request import FinishReason, Request, RequestStatus
from core.sampling_params import SamplingParams
from core.scheduler import Scheduler

__all__ = ["CacheConfig", "SchedulerConfig", "EngineCore", "FinishReason", "Request", "RequestStatus",
           "SamplingParams", "Scheduler", "LLM"]


def __getattr__(name: str):
    if name == "LLM":
        from core.llm import LLM  # noqa: PLC0415
        return LLM
    raise AttributeError(f"module 'core' has no attribute {name!r}")
