"""Pure-torch paged attention (CPU and CUDA): gather each request's blocks, one SDPA per group.

Causality is **bottom-right** aligned: the i-th of q new tokens after `ctx` cached ones sees keys
`0..ctx+i` (SDPA's `is_causal=True` is top-left aligned and wrong for chunks and prefix hits, so an
explicit boolean mask is used).

Requests are split into groups; a group pads its queries to its longest query and its keys to its
longest sequence and runs one `scaled_dot_product_attention`:
  - `mode="batched"`: decodes and prefill chunks are grouped separately, each sorted by length and
    cut into buckets whose padded work stays within `PAD_SLACK` x the real work;
  - `mode="loop"`: one group per request (no padding, one SDPA call per request).
The selector's default (`torch_paged_mode="auto"`) is "batched" on CUDA and "loop" on the CPU, where
it measured as fast or faster (benchmarks/torch_paged_attention.py).
GQA is folded: the G query heads sharing a KV head become G x Qmax query rows of that KV head, so
K/V are never repeated. Planning (indices, masks) happens once per step in `build_metadata`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from gpu.attention.backend import write_kv
from gpu.attention.metadata import CommonAttentionMetadata

TORCH_PAGED_MODES = ("batched", "loop")
PAD_SLACK = 1.5


@dataclass(slots=True)
class TorchPagedGroup:
    block_table: torch.Tensor  # int64 [Rg, num_blocks_g]
    q_index: torch.Tensor  # int64 [Rg, Qmax]: flat token index of each (request, query) slot
    attn_mask: torch.Tensor  # bool [Rg, 1, G * Qmax, Lmax], rows ordered (head in group, query)
    valid_index: Optional[torch.Tensor]  # int64 [Ng]: real slots in the [Rg*Qmax] layout (None: all)
    out_index: Optional[torch.Tensor]  # int64 [Ng]: their flat token index (None: all tokens in order)
    max_query_len: int
    max_seq_len: int


@dataclass(slots=True)
class TorchPagedMetadata:
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    groups: list[TorchPagedGroup] = field(default_factory=list)


def bucket_by_padding(order: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray,
                      slack: float = PAD_SLACK) -> list[np.ndarray]:
    """Cut requests (already sorted by length) into consecutive buckets whose padded attention work
    `n * max_q * max_kv` stays within `slack` x the real work `sum(q * kv)`."""
    groups, start = [], 0
    real = 0
    max_q = max_kv = 0
    for j, r in enumerate(order.tolist()):
        q, s = int(q_lens[r]), int(seq_lens[r])
        nq, ns, nreal = max(max_q, q), max(max_kv, s), real + q * s
        if j > start and (j - start + 1) * nq * ns > slack * nreal:
            groups.append(order[start:j])
            start, nq, ns, nreal = j, q, s, q * s
        max_q, max_kv, real = nq, ns, nreal
    if len(order):
        groups.append(order[start:])
    return groups


class TorchPagedAttention:
    name = "torch-paged"

    def __init__(self, mode: str = "batched", num_queries_per_kv: int = 1) -> None:
        if mode not in TORCH_PAGED_MODES:
            raise ValueError(f"torch_paged_mode: unknown mode {mode!r} (allowed: {TORCH_PAGED_MODES})")
        self.mode = mode
        self.num_queries_per_kv = num_queries_per_kv

    def _build_group(self, req_idx: np.ndarray, qsl: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray,
                     common: CommonAttentionMetadata, covers_all: bool,
                     max_seq_len: Optional[int] = None) -> TorchPagedGroup:
        device = common.slot_mapping.device
        gq, gs = q_lens[req_idx], seq_lens[req_idx]
        qmax = int(gq.max())
        lmax = int(gs.max()) if max_seq_len is None else max_seq_len
        nb = -(-lmax // common.block_size)
        ar_q = np.arange(qmax)
        valid = ar_q[None, :] < gq[:, None]  # [Rg, Qmax]
        q_index = np.where(valid, qsl[req_idx][:, None] + ar_q[None, :], 0)
        ctx = gs - gq
        mask = np.arange(lmax)[None, None, :] <= (ctx[:, None, None] + ar_q[None, :, None])  # [Rg, Qmax, L]
        mask = np.tile(mask, (1, self.num_queries_per_kv, 1))[:, None]  # rows (g, i): [Rg, 1, G*Qmax, L]
        idx_t = torch.from_numpy(req_idx).to(device)

        def to(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
        return TorchPagedGroup(
            block_table=common.block_table.index_select(0, idx_t)[:, :nb].long(),
            q_index=to(q_index.astype(np.int64)),
            attn_mask=to(mask),
            valid_index=None if bool(valid.all()) else to(np.flatnonzero(valid.reshape(-1))),
            out_index=None if covers_all else to(q_index[valid].astype(np.int64)),
            max_query_len=qmax,
            max_seq_len=lmax,
        )

    def build_metadata(self, common: CommonAttentionMetadata,
                       for_cuda_graph: bool = False) -> TorchPagedMetadata:
        qsl = common.query_start_loc_cpu.astype(np.int64)
        q_lens = np.diff(qsl)
        seq_lens = common.seq_lens_cpu.astype(np.int64)
        R = common.num_reqs
        meta = TorchPagedMetadata(slot_mapping=common.slot_mapping, num_actual_tokens=common.num_actual_tokens)
        if for_cuda_graph:  # decode-only, fixed shapes: keys padded to the whole block-table width
            width = common.block_table.shape[1] * common.block_size
            meta.groups.append(self._build_group(np.arange(R), qsl, q_lens, seq_lens, common, True, width))
            return meta
        if self.mode == "loop":
            groups = [np.array([i]) for i in range(R)]
        else:
            groups = []
            for sel in (q_lens == 1, q_lens > 1):
                idx = np.flatnonzero(sel)
                order = idx[np.lexsort((seq_lens[idx], q_lens[idx]))]
                groups += bucket_by_padding(order, q_lens, seq_lens)
            if len(groups) == 1:
                groups = [np.arange(R)]  # keep request order: the output needs no scatter
        single = len(groups) == 1
        for g in groups:
            meta.groups.append(self._build_group(g, qsl, q_lens, seq_lens, common, single))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: TorchPagedMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        T, H, D = q.shape
        out: Optional[torch.Tensor] = None
        for g in metadata.groups:
            o = self._group_attention(q, k_cache, v_cache, g, scale)
            if g.out_index is None:
                return o
            if out is None:
                out = q.new_empty(T, H, D)
            out.index_copy_(0, g.out_index, o)
        assert out is not None, "torch-paged: empty attention metadata"
        return out

    def _group_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         g: TorchPagedGroup, scale: float) -> torch.Tensor:
        rg, qmax = g.q_index.shape
        H, D = q.shape[1], q.shape[2]
        hkv = k_cache.shape[2]
        G = H // hkv
        if G != self.num_queries_per_kv:
            raise ValueError(f"torch-paged: built for {self.num_queries_per_kv} query heads per KV head, got {G}")
        L = g.max_seq_len
        # [Rg, Qmax, Hkv, G, D] -> [Rg, Hkv, G * Qmax, D]
        qg = q[g.q_index].view(rg, qmax, hkv, G, D).permute(0, 2, 3, 1, 4).reshape(rg, hkv, G * qmax, D)
        kg = k_cache[g.block_table].flatten(1, 2)[:, :L].transpose(1, 2)  # [Rg, Hkv, L, D]
        vg = v_cache[g.block_table].flatten(1, 2)[:, :L].transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kg.to(q.dtype), vg.to(q.dtype), attn_mask=g.attn_mask, scale=scale)
        o = o.view(rg, hkv, G, qmax, D).permute(0, 3, 1, 2, 4).reshape(rg * qmax, H, D)
        return o if g.valid_index is None else o.index_select(0, g.valid_index)
