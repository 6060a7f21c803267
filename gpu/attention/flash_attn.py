"""flash-attn 2.x paged attention (CUDA, fp16/bf16, block_size % 256 == 0).

Mixed batches use `flash_attn_varlen_func(..., block_table=...)` (causal is bottom-right aligned in
flash-attn >= 2.1); decode-only batches (and CUDA graphs) use `flash_attn_with_kvcache`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from servetwin.gpu.attention.backend import write_kv
from servetwin.gpu.attention.metadata import CommonAttentionMetadata
from servetwin.gpu.models.config import FULL_WINDOW, AttentionWindow

FLASH_ATTN_BLOCK_MULTIPLE = 256


def import_flash_attn() -> Optional[Any]:
    """The `flash_attn` module, or None when it is not installed / not importable."""
    try:
        import flash_attn  # noqa: PLC0415
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401, PLC0415
    except Exception:  # ImportError, or a broken CUDA extension
        return None
    return flash_attn


def flash_attn_unsupported_reason(device: torch.device, dtype: torch.dtype, block_size: int,
                                  head_dim: int, attention_sinks: bool = False,
                                  chunked_layers: bool = False) -> Optional[str]:
    """Why flash-attn cannot run this configuration (None when it can)."""
    if attention_sinks:
        return "flash-attn 2.x has no attention sinks (gpt-oss)"
    if chunked_layers:
        return "flash-attn 2.x has no chunked local attention"
    if device.type != "cuda":
        return "flash-attn needs a CUDA device"
    if import_flash_attn() is None:
        return "flash_attn is not installed (pip install flash-attn)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn supports fp16/bf16 only, not {dtype}"
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return f"flash-attn 2.x paged KV needs block_size % 256 == 0, got {block_size}"
    if head_dim > 256 or head_dim % 8:
        return f"flash-attn needs head_dim <= 256 and a multiple of 8, got {head_dim}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return "flash-attn 2.x needs an Ampere (sm80) or newer GPU"
    return None


@dataclass(slots=True)
class FlashAttnMetadata:
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    decode_only: bool
    max_query_len: int
    max_seq_len: int
    cu_seqlens_q: torch.Tensor  # int32 [R + 1]
    cu_seqlens_k: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, max_blocks]
    window_size: tuple[int, int] = (-1, -1)  # (-1, -1): full attention


class FlashAttnBackend:
    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: PLC0415
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def build_metadata(self, common: CommonAttentionMetadata, for_cuda_graph: bool = False,
                       window: AttentionWindow = FULL_WINDOW) -> FlashAttnMetadata:
        if window.chunk_size is not None:
            raise NotImplementedError("flash-attn: chunked local attention is not supported (use torch-paged)")
        seq_lens = common.seq_lens
        cu_k = torch.zeros(common.num_reqs + 1, dtype=torch.int32, device=seq_lens.device)
        cu_k[1:] = torch.cumsum(seq_lens, 0, dtype=torch.int32)
        return FlashAttnMetadata(
            slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens,
            decode_only=for_cuda_graph or common.max_query_len == 1,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            cu_seqlens_q=common.query_start_loc.to(torch.int32),
            cu_seqlens_k=cu_k,
            seq_lens=seq_lens.to(torch.int32),
            block_table=common.block_table.to(torch.int32),
            # flash-attn's (left, right) window: a query sees itself and the W - 1 keys before it
            window_size=(-1, -1) if window.sliding_window is None else (window.sliding_window - 1, 0),
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: FlashAttnMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if metadata.decode_only:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=metadata.seq_lens,
                                     block_table=metadata.block_table, softmax_scale=scale, causal=True,
                                     window_size=metadata.window_size)
            return out.squeeze(1)
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=metadata.cu_seqlens_q,
                            cu_seqlens_k=metadata.cu_seqlens_k, max_seqlen_q=metadata.max_query_len,
                            max_seqlen_k=metadata.max_seq_len, softmax_scale=scale, causal=True,
                            block_table=metadata.block_table, window_size=metadata.window_size)
