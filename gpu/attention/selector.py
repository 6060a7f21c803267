"""Pick the attention backend: `auto` prefers flash-attn where it can run, else torch-paged."""
from __future__ import annotations

import logging

import torch

from servetwin.gpu.attention.backend import AttentionBackend
from servetwin.gpu.attention.flash_attn import FlashAttnBackend, flash_attn_unsupported_reason
from servetwin.gpu.attention.torch_paged import TorchPagedAttention

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch-paged", "flash-attn")


def default_torch_paged_mode(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Measured (benchmarks/torch_paged_attention.py): on CUDA the batched groups avoid per-request
    kernel launches; on the CPU in float32 "split" (all decodes in one call of the native decode
    kernel, one SDPA per prefill chunk) is 1.5-3x faster than one SDPA per request ("loop"); in other
    dtypes on the CPU (no native kernel) "loop" is as fast as "split" or slightly faster."""
    if device.type == "cuda":
        return "batched"
    return "split" if dtype == torch.float32 else "loop"


def select_attention_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int,
                             head_dim: int, num_heads: int, num_kv_heads: int,
                             torch_paged_mode: str = "auto", attention_sinks: bool = False,
                             chunked_layers: bool = False) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r} (allowed: {ATTENTION_BACKENDS})")
    if torch_paged_mode == "auto":
        torch_paged_mode = default_torch_paged_mode(device, dtype)
    reason = flash_attn_unsupported_reason(device, dtype, block_size, head_dim, attention_sinks, chunked_layers)
    if name == "flash-attn":
        if reason is not None:
            raise ValueError(f"attention_backend: 'flash-attn' cannot run here: {reason}")
        backend: AttentionBackend = FlashAttnBackend()
    elif name == "torch-paged" or reason is not None:
        # the native decode kernel: CPU float32 only (None = when it builds)
        cpu_kernel = None if device.type == "cpu" and dtype == torch.float32 else False
        backend = TorchPagedAttention(torch_paged_mode, num_heads // num_kv_heads, cpu_kernel=cpu_kernel,
                                      mask_dtype=dtype)
        if name == "auto":
            logger.info("attention backend: torch-paged (%s; flash-attn not used: %s)",
                        torch_paged_mode, reason)
            return backend
    else:
        backend = FlashAttnBackend()
    logger.info("attention backend: %s", backend.name)
    return backend
