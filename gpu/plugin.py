"""The torch executor's plugin (entry point `torch` of the group `servetwin.executors`)."""
from __future__ import annotations

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.executor import ExecutorBackend, ExecutorInfo
from servetwin.gpu.executor import TorchExecutor


def build_torch_executor(args: EngineArgs) -> ExecutorInfo:
    """Load the model and size the KV cache on the device (as vLLM's GPU worker does)."""
    ex = TorchExecutor(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                       num_gpu_blocks=args.num_gpu_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       max_num_batched_tokens=args.max_num_batched_tokens or max(8192, args.max_num_seqs),
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
                       seed=args.seed, profile_dir=args.profile_dir)
    path = ex.model_info.path
    return ExecutorInfo(ex, ex.num_gpu_blocks, ex.max_model_len, ex.vocab_size, list(ex.eos_token_ids or []),
                        str(path) if path else None)


BACKEND = ExecutorBackend("torch", TorchExecutor, build_torch_executor)
