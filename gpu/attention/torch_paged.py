"""Paged attention in torch (CPU and CUDA): gather each request's blocks, one SDPA per group; on the
CPU in float32 the decode rows go to a native kernel instead (`servetwin.gpu.cpu_kernels`).

Causality is **bottom-right** aligned: the i-th of q new tokens after `ctx` cached ones sees keys
`0..ctx+i` (SDPA's `is_causal=True` is top-left aligned and wrong for chunks and prefix hits, so an
explicit mask is used; only a prompt prefilled from position 0 in one chunk, where both alignments
agree, uses `is_causal=True`, over this step's own k/v: no gather, no mask).

Requests are split into groups; a group pads its queries to its longest query and its keys to its
longest sequence and runs one `scaled_dot_product_attention`:
  - `mode="batched"`: decodes and prefill chunks are grouped separately, each sorted by length and
    cut into buckets whose padded work stays within `PAD_SLACK` x the real work;
  - `mode="split"`: every prefill chunk on its own (no padding); the decodes in one call of the native
    CPU decode kernel (float32 CPU, when it builds: it reads each block once from the paged cache,
    no gather) or else in padded buckets of at most `SPLIT_MAX_DECODE_KEYS` gathered keys;
  - `mode="loop"`: one group per request (no padding, one SDPA call per request).
The selector's default (`torch_paged_mode="auto"`) is "batched" on CUDA, "split" on the CPU in float32
and "loop" on the CPU otherwise (benchmarks/torch_paged_attention.py, 2 threads, SmolLM2 heads: the
kernel is 3.5-4x faster than "loop" on all-decode batches, 1.5-1.8x on mixed ones; without it bfloat16
"loop" and "split" are even).
GQA is folded: the G query heads sharing a KV head become G x Qmax query rows of that KV head, so
K/V are never repeated. Planning (indices, masks) happens once per step in `build_metadata`; the
per-layer work of a group is one `index_select` gather of its blocks (advanced indexing with a 2-D
index is several times slower on the CPU) into a reused buffer, one SDPA and the scatter of its
output. With `mask_dtype` given, CPU masks are additive (0 / -inf), built once per step instead of
being converted by SDPA in every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from servetwin.gpu.attention.backend import write_kv
from servetwin.gpu.attention.metadata import CommonAttentionMetadata
from servetwin.gpu.cpu_kernels import DecodeKernel, decode_kernel
from servetwin.gpu.models.config import FULL_WINDOW, AttentionWindow

TORCH_PAGED_MODES = ("batched", "split", "loop")
PAD_SLACK = 1.5
# "split" without the kernel: decode buckets gather at most this many keys (~6 MiB of K+V for SmolLM2): a
# gather that stays in cache beats one pass over all decodes (measured: benchmarks/torch_paged_attention.py)
SPLIT_MAX_DECODE_KEYS = 4096


@dataclass(slots=True)
class TorchPagedGroup:
    block_ids: Optional[torch.Tensor]  # int64 [Rg * num_blocks_g] (row-major); None: keys are this step's k/v
    q_index: Optional[torch.Tensor]  # int64 [Rg * Qmax]: flat token index of each (request, query) slot
    attn_mask: Optional[torch.Tensor]  # [Rg, 1, G * Qmax, Lmax], rows (head in group, query); None: no mask
    valid_index: Optional[torch.Tensor]  # int64 [Ng]: real slots in the [Rg*Qmax] layout (None: all)
    out_index: Optional[torch.Tensor]  # int64 [Ng]: their flat token index (None: all tokens in order)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    token_range: Optional[tuple[int, int]] = None  # one request's tokens [start, end): slices, no index
    is_causal: bool = False  # keys = the query tokens themselves (no cached context): SDPA's causal mask


@dataclass(slots=True)
class DecodeKernelBatch:
    """The decode rows handed to the native CPU kernel (`servetwin.gpu.cpu_kernels`), all int64."""
    block_table: torch.Tensor  # [Rd, W]
    seq_lens: torch.Tensor  # [Rd]
    q_tok: torch.Tensor  # [Rd]: flat token index of each decode row
    # the same rows as torch groups, built on first need (q in a dtype the kernel does not take)
    torch_groups: Callable[[], list[TorchPagedGroup]]
    built_groups: Optional[list[TorchPagedGroup]] = None


@dataclass(slots=True)
class TorchPagedMetadata:
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    groups: list[TorchPagedGroup] = field(default_factory=list)
    decode_batch: Optional[DecodeKernelBatch] = None


def bucket_by_padding(order: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray,
                      slack: float = PAD_SLACK, max_keys: Optional[int] = None) -> list[np.ndarray]:
    """Cut requests (already sorted by length) into consecutive buckets whose padded attention work
    `n * max_q * max_kv` stays within `slack` x the real work `sum(q * kv)` and, when `max_keys` is
    given, whose gathered keys `n * max_kv` stay within `max_keys` (at least one request each)."""
    groups, start = [], 0
    real = 0
    max_q = max_kv = 0
    for j, r in enumerate(order.tolist()):
        q, s = int(q_lens[r]), int(seq_lens[r])
        nq, ns, nreal = max(max_q, q), max(max_kv, s), real + q * s
        n = j - start + 1
        if j > start and (n * nq * ns > slack * nreal or (max_keys is not None and n * ns > max_keys)):
            groups.append(order[start:j])
            start, nq, ns, nreal = j, q, s, q * s
        max_q, max_kv, real = nq, ns, nreal
    if len(order):
        groups.append(order[start:])
    return groups


def _sorted_buckets(idx: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray,
                    max_keys: Optional[int] = None) -> list[np.ndarray]:
    order = idx[np.lexsort((seq_lens[idx], q_lens[idx]))]
    return bucket_by_padding(order, q_lens, seq_lens, max_keys=max_keys)


class TorchPagedAttention:
    name = "torch-paged"

    def __init__(self, mode: str = "batched", num_queries_per_kv: int = 1,
                 cpu_kernel: Optional[bool] = None, mask_dtype: Optional[torch.dtype] = None) -> None:
        """`cpu_kernel` ("split" mode on the CPU, float32): None = use the native decode kernel when it
        builds, True = require it, False = never (the torch path). `mask_dtype` (the model's dtype):
        on the CPU masks are then built additive (0 / -inf) in that dtype once per step, instead of
        boolean ones that SDPA converts in every layer."""
        if mode not in TORCH_PAGED_MODES:
            raise ValueError(f"torch_paged_mode: unknown mode {mode!r} (allowed: {TORCH_PAGED_MODES})")
        self.mode = mode
        self.num_queries_per_kv = num_queries_per_kv
        self.cpu_kernel = cpu_kernel
        self.mask_dtype = mask_dtype
        self._kernel: Optional[DecodeKernel] = None
        if mode == "split" and cpu_kernel is not False:
            self._kernel = decode_kernel()
            if self._kernel is None and cpu_kernel:
                raise RuntimeError("torch-paged: cpu_kernel=True but the CPU decode kernel is unavailable "
                                   "(see the log)")
        # CPU: gathered K/V land in two persistent buffers (grown on demand), not in fresh tensors:
        # fresh multi-MiB tensors are mmap'ed and page-faulted in every layer of every step.
        self._gather_bufs: dict[str, torch.Tensor] = {}

    def _build_group(self, req_idx: np.ndarray, qsl: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray,
                     common: CommonAttentionMetadata, covers_all: bool,
                     max_seq_len: Optional[int] = None, key_start: Optional[np.ndarray] = None,
                     window: AttentionWindow = FULL_WINDOW) -> TorchPagedGroup:
        """`max_seq_len` given (CUDA-graph capture/replay): a fixed layout, every tensor present.
        `key_start[r]` (a multiple of the block size; None: 0) is where request r's gathered keys begin:
        the blocks before it are outside `window` for every query of the step and are never read."""
        device = common.slot_mapping.device
        fixed = max_seq_len is not None
        koff = np.zeros(len(q_lens), np.int64)[req_idx] if key_start is None else key_start[req_idx]
        gq = q_lens[req_idx]
        ctx = seq_lens[req_idx] - gq
        gs = seq_lens[req_idx] - koff  # keys gathered per request
        rg = len(req_idx)
        qmax = int(gq.max())
        lmax = int(gs.max()) if max_seq_len is None else max_seq_len
        windowed = not window.is_full

        def to(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
        if rg == 1 and not fixed:  # one request: its tokens are a contiguous slice, nothing is padded
            start = int(qsl[req_idx[0]])
            fresh = int(ctx[0]) == 0 and qmax > 1
            plain = (fresh or qmax == 1) and not windowed  # causality alone, or no mask at all
            return TorchPagedGroup(
                block_ids=None if fresh else self._block_ids(common, req_idx, koff, lmax),
                q_index=None, attn_mask=None if plain else self._mask(ctx, koff, qmax, lmax, device, True, window),
                valid_index=None, out_index=None, num_reqs=1, max_query_len=qmax, max_seq_len=lmax,
                token_range=(start, start + qmax), is_causal=fresh)
        ar_q = np.arange(qmax)
        valid = ar_q[None, :] < gq[:, None]  # [Rg, Qmax]
        q_index = np.where(valid, qsl[req_idx][:, None] + ar_q[None, :], 0)
        need_mask = fixed or bool((gs != lmax).any()) or qmax > 1 or windowed
        return TorchPagedGroup(
            block_ids=self._block_ids(common, req_idx, koff, lmax),
            q_index=to(q_index.reshape(-1).astype(np.int64)),
            attn_mask=self._mask(ctx, koff, qmax, lmax, device, not fixed, window) if need_mask else None,
            valid_index=None if bool(valid.all()) else to(np.flatnonzero(valid.reshape(-1))),
            out_index=None if covers_all else to(q_index[valid].astype(np.int64)),
            num_reqs=rg,
            max_query_len=qmax,
            max_seq_len=lmax,
        )

    @staticmethod
    def _block_ids(common: CommonAttentionMetadata, req_idx: np.ndarray, koff: np.ndarray,
                   lmax: int) -> torch.Tensor:
        """Each request's `ceil(lmax / block_size)` blocks from its key start on (row-major); columns past
        the table's width (a padded row of a shorter request) repeat its last entry: masked, never null."""
        bs = common.block_size
        nb = -(-lmax // bs)
        bt = common.block_table
        if not koff.any():
            if len(req_idx) == 1:
                rows = bt[int(req_idx[0])][:nb]
            else:
                rows = bt.index_select(0, torch.from_numpy(req_idx).to(bt.device))[:, :nb]
            return rows.reshape(-1).long()
        cols = np.minimum(koff[:, None] // bs + np.arange(nb)[None, :], bt.shape[1] - 1)
        rows = bt.index_select(0, torch.from_numpy(req_idx).to(bt.device))
        return rows.gather(1, torch.from_numpy(cols).to(bt.device)).reshape(-1).long()

    def _mask(self, ctx: np.ndarray, koff: np.ndarray, qmax: int, lmax: int, device: torch.device,
              additive_ok: bool, window: AttentionWindow = FULL_WINDOW) -> torch.Tensor:
        """Bottom-right causal mask with key padding, rows (g, i): [Rg, 1, G*Qmax, L]; gathered key j of
        request r is position `koff[r] + j`, visible to query position p when `window.first_key(p) <= it
        <= p`. Boolean, or on the CPU with `mask_dtype` set (and `additive_ok`: not a CUDA-graph static
        layout) additive."""
        qpos = ctx[:, None, None] + np.arange(qmax)[None, :, None]  # [Rg, Qmax, 1]
        kpos = koff[:, None, None] + np.arange(lmax)[None, None, :]  # [Rg, 1, L]
        mask = kpos <= qpos
        if not window.is_full:
            mask &= kpos >= window.first_key(qpos)
        t = torch.from_numpy(mask).to(device, non_blocking=True)
        t = t.repeat(1, self.num_queries_per_kv, 1)[:, None]
        if not additive_ok or device.type != "cpu" or self.mask_dtype is None:
            return t
        return torch.zeros(t.shape, dtype=self.mask_dtype).masked_fill_(~t, float("-inf"))

    def build_metadata(self, common: CommonAttentionMetadata, for_cuda_graph: bool = False,
                       window: AttentionWindow = FULL_WINDOW) -> TorchPagedMetadata:
        """Plan one step for the layers that attend through `window` with `common`'s block table (one
        metadata per KV-cache group or attention window, shared by its layers). A windowed plan gathers
        each request from the block holding the first key its first query sees: the blocks before it,
        which a sliding-window / chunked KV group frees and replaces by the null block, are never read."""
        qsl = common.query_start_loc_cpu.astype(np.int64)
        q_lens = np.diff(qsl)
        seq_lens = common.seq_lens_cpu.astype(np.int64)
        R = common.num_reqs
        meta = TorchPagedMetadata(slot_mapping=common.slot_mapping, num_actual_tokens=common.num_actual_tokens)
        if for_cuda_graph:  # decode-only, fixed shapes: keys padded to the whole block-table width
            if not window.is_full:
                raise NotImplementedError("torch-paged: CUDA graphs of sliding-window / chunked layers")
            width = common.block_table.shape[1] * common.block_size
            meta.groups.append(self._build_group(np.arange(R), qsl, q_lens, seq_lens, common, True, width))
            return meta
        key_start = None  # full attention: every request's keys from position 0
        if not window.is_full:
            key_start = window.first_key(seq_lens - q_lens) // common.block_size * common.block_size
        key_lens = seq_lens if key_start is None else seq_lens - key_start

        def build(g: np.ndarray, covers_all: bool) -> TorchPagedGroup:
            return self._build_group(g, qsl, q_lens, seq_lens, common, covers_all, key_start=key_start,
                                     window=window)
        if self.mode == "loop":
            groups = [np.array([i]) for i in range(R)]
        elif self.mode == "split":
            decodes = np.flatnonzero(q_lens == 1)
            if (self._kernel is not None and common.slot_mapping.device.type == "cpu" and len(decodes)
                    and key_start is None):  # the kernel attends every key of its rows: full attention only
                def torch_groups(d: np.ndarray = decodes) -> list[TorchPagedGroup]:
                    return [build(g, False) for g in _sorted_buckets(d, q_lens, key_lens, SPLIT_MAX_DECODE_KEYS)]
                meta.decode_batch = self._decode_batch(common, decodes, qsl, seq_lens, torch_groups)
                groups = []
            else:
                groups = _sorted_buckets(decodes, q_lens, key_lens, SPLIT_MAX_DECODE_KEYS)
            groups += [np.array([i]) for i in np.flatnonzero(q_lens > 1)]
        else:
            groups = []
            for sel in (q_lens == 1, q_lens > 1):
                groups += _sorted_buckets(np.flatnonzero(sel), q_lens, key_lens)
        if len(groups) == 1 and len(groups[0]) > 1:
            groups = [np.arange(R)]  # keep request order: the output needs no scatter
        single = len(groups) == 1 and meta.decode_batch is None
        meta.groups.extend(build(g, single) for g in groups)
        return meta

    @staticmethod
    def _decode_batch(common: CommonAttentionMetadata, decodes: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray,
                      torch_groups: Callable[[], list[TorchPagedGroup]]) -> DecodeKernelBatch:
        sl = seq_lens[decodes]
        nb = int(-(-sl.max() // common.block_size))
        bt = common.block_table
        rows = bt[:, :nb] if len(decodes) == bt.shape[0] else bt.index_select(0, torch.from_numpy(decodes))[:, :nb]
        return DecodeKernelBatch(block_table=rows.to(torch.int64).contiguous(), seq_lens=torch.from_numpy(sl),
                                 q_tok=torch.from_numpy(np.ascontiguousarray(qsl[decodes])),
                                 torch_groups=torch_groups)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: TorchPagedMetadata, scale: float,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`sinks` ([H], gpt-oss): a learned logit per head that joins every softmax's denominator."""
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        T, H, D = q.shape
        if H // k_cache.shape[2] != self.num_queries_per_kv:
            raise ValueError(f"torch-paged: built for {self.num_queries_per_kv} query heads per KV head, "
                             f"got {H // k_cache.shape[2]}")
        groups = metadata.groups
        db = metadata.decode_batch
        if db is None and len(groups) == 1 and groups[0].out_index is None and groups[0].token_range is None:
            return self._group_attention(q, k, v, k_cache, v_cache, groups[0], scale, sinks)
        out = q.new_empty(T, H, D)
        if db is not None:
            if self._kernel is not None and self._kernel.supports(q, k_cache) and sinks is None:
                self._kernel(q.contiguous(), k_cache, v_cache, db.block_table, db.seq_lens, db.q_tok, out, scale)
            else:  # e.g. bfloat16 or sinks: the decode rows as torch buckets (planned once per step)
                if db.built_groups is None:
                    db.built_groups = db.torch_groups()
                groups = db.built_groups + groups
        for g in groups:
            o = self._group_attention(q, k, v, k_cache, v_cache, g, scale, sinks)
            if g.token_range is not None:
                out[g.token_range[0]:g.token_range[1]] = o
            elif g.out_index is None:
                return o
            else:
                out.index_copy_(0, g.out_index, o)
        assert groups or db is not None, "torch-paged: empty attention metadata"
        return out

    def _group_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, g: TorchPagedGroup, scale: float,
                         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        rg, qmax, L = g.num_reqs, g.max_query_len, g.max_seq_len
        H, D = q.shape[1], q.shape[2]
        hkv = k_cache.shape[2]
        G = H // hkv
        if g.token_range is not None:
            s, e = g.token_range
            qs = q[s:e]
        else:
            qs = q.index_select(0, g.q_index)
        if g.is_causal and g.attn_mask is None and sinks is None:
            # a whole prompt from position 0: keys are its own k/v, top-left == bottom-right
            qh = qs.transpose(0, 1)[None]  # [1, H, Q, D]
            if q.device.type == "cpu":  # SDPA's own GQA (CPU: same result, ~10% faster than repeating K/V)
                kh, vh = k[s:e].transpose(0, 1)[None].to(q.dtype), v[s:e].transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=G > 1)
            else:
                kh = k[s:e].repeat_interleave(G, 1).transpose(0, 1)[None].to(q.dtype)
                vh = v[s:e].repeat_interleave(G, 1).transpose(0, 1)[None].to(q.dtype)
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
            return o[0].transpose(0, 1)
        # [Rg * Qmax, H, D] -> [Rg, Hkv, G * Qmax, D]
        qg = qs.view(rg, qmax, hkv, G, D).permute(0, 2, 3, 1, 4).reshape(rg, hkv, G * qmax, D)
        if g.block_ids is None:  # a whole prompt from position 0 (windowed or with sinks): its own k/v
            kg, vg = k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None]
        else:
            bs = k_cache.shape[1]
            nb = g.block_ids.shape[0] // rg
            kg = self._gather("k", k_cache, g.block_ids).view(rg, nb * bs, hkv, D)[:, :L].transpose(1, 2)  # [Rg, Hkv, L, D]
            vg = self._gather("v", v_cache, g.block_ids).view(rg, nb * bs, hkv, D)[:, :L].transpose(1, 2)
        if sinks is None:
            o = F.scaled_dot_product_attention(qg, kg.to(q.dtype), vg.to(q.dtype), attn_mask=g.attn_mask,
                                               scale=scale)
        else:
            o = attention_with_sinks(qg, kg.to(q.dtype), vg.to(q.dtype), g.attn_mask, scale, sinks, qmax,
                                     causal=g.block_ids is None)
        o = o.view(rg, hkv, G, qmax, D).permute(0, 3, 1, 2, 4).reshape(rg * qmax, H, D)
        return o if g.valid_index is None else o.index_select(0, g.valid_index)

    def _gather(self, key: str, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """`cache.index_select(0, block_ids)`; on the CPU into a reused buffer (never on CUDA, where a
        captured graph must keep reading the tensors it was captured with)."""
        if cache.device.type != "cpu":
            return cache.index_select(0, block_ids)
        shape = (block_ids.shape[0],) + tuple(cache.shape[1:])
        n = block_ids.shape[0] * cache[0].numel()
        buf = self._gather_bufs.get(key)
        if buf is None or buf.numel() < n or buf.dtype != cache.dtype:
            buf = self._gather_bufs[key] = torch.empty(n, dtype=cache.dtype)
        out = buf[:n].view(shape)
        return torch.index_select(cache, 0, block_ids, out=out)


def attention_with_sinks(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, mask: Optional[torch.Tensor],
                         scale: float, sinks: torch.Tensor, qmax: int, causal: bool = False) -> torch.Tensor:
    """Softmax attention whose denominator also holds `exp(sinks[h])` (gpt-oss; HF's eager
    `combined_logits`): the sink column joins the softmax and is dropped before `@ v`. Folded GQA layout:
    `qg` [Rg, Hkv, G*Qmax, D] with rows (head in group, query), `kg`/`vg` [Rg, Hkv, L, D]; `mask` as
    SDPA's (boolean or additive); without one, every key is visible, or with `causal` (a whole prompt from
    position 0, keys = the queries) query i sees keys 0..i."""
    rg, hkv, rows, _ = qg.shape
    L = kg.shape[2]
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # [Rg, Hkv, G*Qmax, L]
    if mask is None and causal:
        i = torch.arange(rows, device=qg.device) % qmax
        mask = torch.arange(L, device=qg.device)[None, :] <= i[:, None]
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    sink = sinks.to(scores.dtype).view(hkv, -1, 1).expand(hkv, rows // qmax, qmax).reshape(1, hkv, rows, 1)
    scores = torch.cat([scores, sink.expand(rg, hkv, rows, 1)], dim=-1)
    probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs, vg)
