"""The paged KV cache: per layer K and V `[num_blocks + 1, block_size, num_kv_heads, head_dim]`.

The pool holds `num_gpu_blocks` blocks for the scheduler plus one extra *pad block* (index
`num_gpu_blocks`) that padded tokens (CUDA-graph padding) write to and padded block-table entries
point at. Sizing (`servetwin.core.kv_cache.kv_sizing`): on CUDA by profiling (`profile_available_kv_bytes`), on CPU
from an explicit budget (`kv_cache_memory_bytes`, default `DEFAULT_CPU_KV_BYTES`) or
`num_gpu_blocks`.
"""
from __future__ import annotations

import gc
import logging
from typing import Callable, Optional

import torch

from servetwin.core.kv_cache.kv_sizing import KVCacheSpec, num_blocks_for_memory

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 512 * 1024 ** 2

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_caches(spec: KVCacheSpec, num_gpu_blocks: int, dtype: torch.dtype,
                       device: torch.device, layer_to_group: Optional[tuple[int, ...]] = None) -> KVCaches:
    """Zero-filled (masked garbage must never be NaN) K/V per layer, with the extra pad block.

    With several KV cache groups (`layer_to_group`), as in vLLM, the j-th layer of every group shares
    one tensor: a block id belongs to one group at a time, so the pool costs one page per layer of a
    group (`group_size` layers), not one per model layer."""
    shape = (num_gpu_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_size)
    if layer_to_group is None:
        layer_to_group = (0,) * spec.num_layers
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    seen = [0] * (max(layer_to_group) + 1)
    caches = []
    for g in layer_to_group:
        j, seen[g] = seen[g], seen[g] + 1  # this layer's index inside its group
        if j not in shared:
            shared[j] = (torch.zeros(shape, dtype=dtype, device=device),
                         torch.zeros(shape, dtype=dtype, device=device))
        caches.append(shared[j])
    return caches


def cpu_num_blocks(spec: KVCacheSpec, num_gpu_blocks: Optional[int],
                   kv_cache_memory_bytes: Optional[int]) -> int:
    if num_gpu_blocks is not None:
        return int(num_gpu_blocks)
    budget = DEFAULT_CPU_KV_BYTES if kv_cache_memory_bytes is None else int(kv_cache_memory_bytes)
    return num_blocks_for_memory(budget, spec)


def profile_available_kv_bytes(device: torch.device, gpu_memory_utilization: float,
                               dummy_forward: Callable[[], None]) -> int:
    """vLLM's profile run: `total * utilization - (torch peak incl. weights + non-torch memory)`.

    `dummy_forward` runs one forward of `max_num_batched_tokens` tokens (weights already loaded).
    """
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    dummy_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    requested = int(total * gpu_memory_utilization)
    available = requested - peak - non_torch
    logger.info("memory profile: total %.2f GiB x %.2f = %.2f GiB; torch peak %.2f GiB, non-torch "
                "%.2f GiB -> %.2f GiB for the KV cache", total / 2**30, gpu_memory_utilization,
                requested / 2**30, peak / 2**30, non_torch / 2**30, available / 2**30)
    gc.collect()
    torch.cuda.empty_cache()
    return max(0, available)


def cuda_num_blocks(spec: KVCacheSpec, num_gpu_blocks: Optional[int], kv_cache_memory_bytes: Optional[int],
                    device: torch.device, gpu_memory_utilization: float,
                    dummy_forward: Callable[[], None]) -> int:
    if num_gpu_blocks is not None:
        return int(num_gpu_blocks)
    if kv_cache_memory_bytes is not None:
        return num_blocks_for_memory(int(kv_cache_memory_bytes), spec)
    available = profile_available_kv_bytes(device, gpu_memory_utilization, dummy_forward)
    # one block of headroom for the pad block
    return max(0, num_blocks_for_memory(available, spec) - 1)
