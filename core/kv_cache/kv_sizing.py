"""KV-cache sizing as vLLM 0.33.0 does it (docs/scheduler_behaviour.md §5): page sizes, num_blocks, max_model_len fit."""
from __future__ import annotations

from dataclasses import dataclass

from servetwin.core.config_error import ConfigError

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2,
               "bfloat16": 2, "bf16": 2, "fp8": 1, "float8": 1, "int8": 1}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ConfigError("dtype", f"unknown dtype {dtype!r} (allowed: {sorted(DTYPE_BYTES)})") from None


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """One uniform group of full-attention layers."""
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    block_size: int = 16
    head_size_v: int | None = None

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer: K and V for `block_size` tokens."""
        hv = self.head_size if self.head_size_v is None else self.head_size_v
        return self.num_kv_heads * self.block_size * (self.head_size + hv) * dtype_bytes(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.page_size_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one tensor-parallel rank caches: the model's split over the ranks, at least one (fewer KV
    heads than ranks: each is replicated), vLLM 0.33 `vllm/config/model.py` `get_num_kv_heads`. The torch
    backend's worker sizes its KV pool from this; so does the simulator's (`sim/kv_pool.py`)."""
    return max(1, num_kv_heads // tensor_parallel_size)


def num_blocks_for_memory(available_kv_bytes: int, spec: KVCacheSpec) -> int:
    return max(0, int(available_kv_bytes) // spec.bytes_per_block)


def max_len_that_fits(num_blocks: int, spec: KVCacheSpec) -> int:
    """Largest max_model_len whose single request fits in the pool (null block reserved)."""
    return max(0, (num_blocks - 1) * spec.block_size)


def check_or_fit_max_model_len(num_blocks: int, spec: KVCacheSpec, max_model_len: int,
                               derived_max_len: int) -> int:
    """vLLM's `_check_enough_kv_cache_memory` / auto-fit (`max_model_len == -1`).

    Returns the max_model_len to use. Raises `ValueError` when one request of `max_model_len`
    cannot fit (quoting the largest length that does) or not even one token fits.
    """
    if num_blocks <= 0:
        raise ConfigError("num_gpu_blocks", "no available memory for the KV cache (0 blocks); "
                         "increase gpu_memory_utilization or the KV budget.")
    fits = max_len_that_fits(num_blocks, spec)
    if max_model_len == -1:
        if fits <= 0:
            raise ConfigError("max_model_len", "the KV cache cannot serve even a single token.")
        return min(fits, derived_max_len)
    if cdiv(max_model_len, spec.block_size) > num_blocks - 1:
        raise ConfigError(
            "max_model_len", f"{max_model_len} tokens need {cdiv(max_model_len, spec.block_size)} blocks "
            f"but the KV cache has {num_blocks - 1} usable blocks; the largest max_model_len that fits "
            f"is {fits}. Lower max_model_len or give the KV cache more memory.")
    return max_model_len


def max_concurrency(num_blocks: int, spec: KVCacheSpec, max_model_len: int) -> float:
    return num_blocks / cdiv(max_model_len, spec.block_size)
