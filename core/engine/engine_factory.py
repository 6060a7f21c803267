"""Builds an executor from `EngineArgs` (through the backend registry) and the `EngineCore` around it.

Every executor ends up with the final KV pool size and `max_model_len`, which the scheduler uses:
`num_gpu_blocks` (explicit, or sized from memory as vLLM does) and `max_model_len` (checked so one
request of that length fits, or auto-fitted with -1). How is the backend's business: its plugin's
`ExecutorBackend.from_engine_args` (`servetwin.core.engine.executor`).
"""
from __future__ import annotations

from typing import Optional

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.executor import ExecutorInfo, executor_backend

__all__ = ["ExecutorInfo", "create_executor", "create_engine_core"]


def create_executor(args: EngineArgs) -> ExecutorInfo:
    backend = executor_backend(args.backend)
    if backend.check_args is not None:  # cheap checks first: a bad argument fails before a model load
        backend.check_args(args)
    return backend.from_engine_args(args)


def create_engine_core(args: EngineArgs, info: Optional[ExecutorInfo] = None) -> tuple[EngineCore, ExecutorInfo]:
    info = info or create_executor(args)
    engine = EngineCore(args.scheduler_config(info.max_model_len), args.cache_config(info.num_gpu_blocks, info.kv_cache_groups),
                        info.executor, speculative_config=args.speculative_config,
                        kv_transfer_config=args.kv_transfer_config)
    return engine, info
