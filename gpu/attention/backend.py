"""The attention-backend interface and the paged KV write shared by all backends."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from servetwin.gpu.attention.metadata import CommonAttentionMetadata
from servetwin.gpu.models.config import FULL_WINDOW, AttentionWindow


class AttentionBackend(Protocol):
    """Paged attention over caches shaped `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    name: str

    def build_metadata(self, common: CommonAttentionMetadata, for_cuda_graph: bool = False,
                       window: AttentionWindow = FULL_WINDOW) -> Any:
        """Plan one step for the layers attending through `window` with `common`'s block table (CPU work,
        once per step, shared by those layers: `servetwin.gpu.attention.layer_plans`)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: Any, scale: float) -> torch.Tensor:
        """Write this step's k/v (`[T, Hkv, D]`) into the cache, then attend: returns `[T, H, D]`.
        A backend that supports attention sinks takes them as the keyword `sinks` ([H])."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`cache.view(-1, Hkv, D)[slot_mapping] = k` without a Python loop (index_copy_)."""
    n = slot_mapping.shape[0]
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k[:n].to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v[:n].to(v_cache.dtype))
