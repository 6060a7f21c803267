"""Size the simulated KV pool exactly as the engine would (spec section 5), and build the executor.

On a CUDA device vLLM profiles one dummy forward of `max_num_batched_tokens` and keeps
`gpu_memory_utilization x memory - (weights + activation peak + non-torch memory)` for the KV cache,
then `num_blocks = available // bytes_per_block` (`servetwin.core.kv_cache.kv_sizing`). The simulator estimates the same
terms from the model spec; an explicit `num_gpu_blocks` (e.g. the engine's logged count) or
`kv_cache_memory_bytes` bypasses the estimate. Matching the engine's block count matters more for
accuracy than anything else in the pool (simulator_notes.md), so the summary reports it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.executor import ExecutorInfo
from servetwin.core.kv_cache.kv_sizing import KVCacheSpec, check_or_fit_max_model_len, num_blocks_for_memory
from servetwin.sim.executor import SimExecutor
from servetwin.sim.hardware import HardwareSpec, load_hardware
from servetwin.sim.model_spec import ModelSpec, load_model_spec

NON_TORCH_BYTES_CUDA = 512 * 2**20  # CUDA context, cuBLAS workspace, NCCL buffers (typical)


@dataclass(slots=True, frozen=True)
class KVPoolSize:
    num_gpu_blocks: int
    kv_spec: KVCacheSpec
    requested_bytes: int
    weight_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    available_kv_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"num_gpu_blocks": self.num_gpu_blocks, "bytes_per_block": self.kv_spec.bytes_per_block,
                "requested_bytes": self.requested_bytes, "weight_bytes": self.weight_bytes,
                "activation_peak_bytes": self.activation_peak_bytes, "non_torch_bytes": self.non_torch_bytes,
                "available_kv_bytes": self.available_kv_bytes}


def activation_peak_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1) -> int:
    """Peak transient memory of the profiling forward: the widest per-token buffers of one layer
    (residual + normed input + q/k/v + gate/up of the MLP) plus fp32 logits of the sampled rows."""
    b = model.dtype_bytes
    per_token = (2 * model.hidden_size + (model.q_dim + 2 * model.kv_dim) // tp
                 + 2 * model.intermediate_size // tp) * b
    logits = min(max_num_seqs, max_num_batched_tokens) * model.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


def size_kv_pool(model: ModelSpec, hw: HardwareSpec, block_size: int = 16, gpu_memory_utilization: float = 0.92,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 128, tp: int = 1,
                 num_gpu_blocks: Optional[int] = None, kv_cache_memory_bytes: Optional[int] = None,
                 kv_dtype: Optional[str] = None) -> KVPoolSize:
    kv_heads = max(1, model.num_kv_heads // tp)
    spec = KVCacheSpec(num_layers=model.num_layers, num_kv_heads=kv_heads, head_size=model.head_dim,
                       dtype=kv_dtype or model.dtype, block_size=block_size)
    requested = math.ceil(hw.memory_bytes * gpu_memory_utilization)
    weights = model.weight_bytes // tp
    act = activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, tp)
    non_torch = NON_TORCH_BYTES_CUDA if hw.device_type == "cuda" else 0
    if kv_cache_memory_bytes is not None:
        available = kv_cache_memory_bytes
    else:
        available = requested - weights - act - non_torch
    blocks = num_gpu_blocks if num_gpu_blocks is not None else num_blocks_for_memory(max(available, 0), spec)
    if blocks < 2:
        raise ConfigError(
            "gpu_memory_utilization", f"{hw.name} ({hw.memory_bytes / 2**30:.1f} GiB x {gpu_memory_utilization}) "
            f"leaves {available / 2**30:.2f} GiB for the KV cache after {weights / 2**30:.2f} GiB of weights "
            f"and {act / 2**30:.2f} GiB of activations: not even 2 blocks fit. Use a bigger device, "
            "tensor_parallel_size, or an explicit num_gpu_blocks.")
    return KVPoolSize(blocks, spec, requested, weights, act, non_torch, int(available))


def build_sim_executor(args: Any):
    """The `sim` backend's `ExecutorBackend.from_engine_args` (args: `EngineArgs`): size the pool, build the
    `SimExecutor`."""

    model = load_model_spec(args.model, dtype=None if args.dtype in (None, "auto") else args.dtype)
    hw = load_hardware(args.hardware or "h100-sxm")
    mnbt = args.max_num_batched_tokens or max(8192, args.max_num_seqs)
    pool = size_kv_pool(model, hw, args.block_size, args.gpu_memory_utilization, mnbt, args.max_num_seqs,
                        args.tensor_parallel_size, args.num_gpu_blocks, args.kv_cache_memory_bytes)
    requested_len = args.max_model_len if args.max_model_len is not None else model.max_position_embeddings
    max_len = check_or_fit_max_model_len(pool.num_gpu_blocks, pool.kv_spec, requested_len,
                                         model.max_position_embeddings)
    executor = SimExecutor(model=model, hardware=hw, tp=args.tensor_parallel_size,
                           cuda_graphs=(not args.enforce_eager) and hw.device_type == "cuda",
                           ipc=bool(getattr(args, "multiprocess", False)))
    executor.kv_pool = pool
    return ExecutorInfo(executor, pool.num_gpu_blocks, max_len, model.vocab_size, [], None)
