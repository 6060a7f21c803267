"""Builds an executor from `EngineArgs` (lazy backend imports) and the `EngineCore` around it.

Every executor ends up with the final KV pool size and `max_model_len`, which the scheduler uses:
`num_gpu_blocks` (explicit, or sized from memory as vLLM does) and `max_model_len` (checked so one
request of that length fits, or auto-fitted with -1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.executor import FakeExecutor


@dataclass(slots=True)
class ExecutorInfo:
    executor: Any
    num_gpu_blocks: int
    max_model_len: int
    vocab_size: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_path: Optional[str] = None


def _torch_executor(args: EngineArgs) -> ExecutorInfo:
    from servetwin.gpu.executor import TorchExecutor  # noqa: PLC0415

    ex = _new_torch_executor(TorchExecutor, args)
    path = getattr(ex, "model_path", None) or getattr(getattr(ex, "model_info", None), "path", None)
    return ExecutorInfo(ex, ex.num_gpu_blocks, ex.max_model_len, ex.vocab_size, list(ex.eos_token_ids or []),
                        str(path) if path else None)


def _new_torch_executor(TorchExecutor, args: EngineArgs):
    return TorchExecutor(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                       num_gpu_blocks=args.num_gpu_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       max_num_batched_tokens=args.max_num_batched_tokens or max(8192, args.max_num_seqs),
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
                       seed=args.seed, profile_dir=args.profile_dir)


def _sim_executor(args: EngineArgs) -> ExecutorInfo:
    from servetwin.sim.kv_pool import build_sim_executor  # noqa: PLC0415

    return build_sim_executor(args)


def _fake_executor(args: EngineArgs) -> ExecutorInfo:
    max_len = args.max_model_len if args.max_model_len not in (None, -1) else 4096
    return ExecutorInfo(FakeExecutor(), args.num_gpu_blocks or 8192, max_len)


def create_executor(args: EngineArgs) -> ExecutorInfo:
    builders = {"torch": _torch_executor, "sim": _sim_executor, "fake": _fake_executor}
    return builders[args.backend](args)


def create_engine_core(args: EngineArgs, info: Optional[ExecutorInfo] = None) -> tuple[EngineCore, ExecutorInfo]:
    info = info or create_executor(args)
    engine = EngineCore(args.scheduler_config(info.max_model_len), args.cache_config(info.num_gpu_blocks),
                        info.executor)
    return engine, info
