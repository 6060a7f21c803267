"""CUDA graphs for decode-only batches (CUDA only; `enforce_eager=True` disables them).

Graphs are captured once at start, largest first, sharing one memory pool, for every pair of
  - a padded batch size (1, 2, 4, then every 8 up to a cap) and
  - a key width in blocks: the full block-table width `cdiv(max_model_len, block_size)`, then
    quarters of it down to `min_width_blocks` (attention work follows the batch's longest sequence
    up to 4x, not max_model_len).
A decode batch of n requests replays the graph of the next captured size >= n and the narrowest
width that holds its longest sequence: padded requests read and write only the pad block. Logits and
sampling run eagerly after the replay.
"""
from __future__ import annotations

import bisect
import logging
from typing import Any, Optional

import numpy as np
import torch

from servetwin.gpu.attention.backend import AttentionBackend
from servetwin.gpu.attention.metadata import CommonAttentionMetadata, copy_tensors_into
from servetwin.gpu.input_batch import InputBatch
from servetwin.gpu.kv_cache import KVCaches

logger = logging.getLogger(__name__)


def width_buckets(full_width: int, min_width: int = 16, factor: int = 4) -> list[int]:
    """Key widths in blocks, ascending: full_width, full_width // factor, ... while >= min_width."""
    widths = [full_width]
    while widths[-1] // factor >= min_width:
        widths.append(widths[-1] // factor)
    return sorted(widths)


def default_capture_sizes(max_num_seqs: int, cap: int = 256) -> list[int]:
    limit = max(1, min(max_num_seqs, cap))
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_caches: KVCaches,
                 block_size: int, pad_block_id: int, max_model_len: int, device: torch.device,
                 capture_sizes: list[int], min_width_blocks: int = 16) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size, self.pad_block_id, self.device = block_size, pad_block_id, device
        self.capture_sizes = sorted(set(capture_sizes))
        self.max_bs = self.capture_sizes[-1]
        self.width = -(-max_model_len // block_size)
        self.widths = width_buckets(self.width, min_width_blocks)
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[Any, Any, Optional[torch.Tensor]]] = {}  # (bs, width)
        self.pool: Optional[Any] = None
        self._last_out: Optional[torch.Tensor] = None

    def can_run(self, batch: InputBatch) -> bool:
        return (batch.is_decode_only and batch.num_reqs <= self.max_bs and bool(self.graphs)
                and batch.block_table.shape[1] <= self.width)

    def padded_size(self, n: int) -> int:
        return self.capture_sizes[bisect.bisect_left(self.capture_sizes, n)]

    def padded_width(self, num_blocks: int) -> int:
        return self.widths[bisect.bisect_left(self.widths, num_blocks)]

    def graph_key(self, batch: InputBatch) -> tuple[int, int]:
        return self.padded_size(batch.num_reqs), self.padded_width(batch.block_table.shape[1])

    def _common(self, n: int, bs: int, width: int, seq_lens: np.ndarray, block_table: np.ndarray,
                slot_mapping: np.ndarray) -> CommonAttentionMetadata:
        """Decode metadata for n real requests padded to bs rows and `width` blocks (pad rows live in
        the pad block)."""
        B = self.block_size
        sl = np.ones(bs, dtype=np.int32)
        sl[:n] = seq_lens
        bt = np.full((bs, width), self.pad_block_id, dtype=np.int32)
        bt[:n, :block_table.shape[1]] = block_table
        sm = np.full(bs, self.pad_block_id * B, dtype=np.int64)
        sm[:n] = slot_mapping
        qsl = np.arange(bs + 1, dtype=np.int32)
        dev = self.device
        return CommonAttentionMetadata(
            num_reqs=bs, num_actual_tokens=bs, max_query_len=1, max_seq_len=width * B, block_size=B,
            query_start_loc=torch.from_numpy(qsl).to(dev), seq_lens=torch.from_numpy(sl).to(dev),
            block_table=torch.from_numpy(bt).to(dev), slot_mapping=torch.from_numpy(sm).to(dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=sl)

    def static_metadata(self, bs: int, width: int) -> Any:
        """Attention metadata for a padded batch of bs pad-only requests (the capture-time tensors)."""
        none = np.zeros(0, dtype=np.int64)
        return self.backend.build_metadata(
            self._common(0, bs, width, none.astype(np.int32), np.zeros((0, 0), dtype=np.int32), none),
            for_cuda_graph=True)

    @torch.inference_mode()
    def capture(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        for width in reversed(self.widths):
            for bs in reversed(self.capture_sizes):
                meta = self.static_metadata(bs, width)
                self.graphs[(bs, width)] = (self._capture_one(bs, meta), meta, self._last_out)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs: decode batch sizes %s x key widths %s blocks", len(self.graphs),
                    self.capture_sizes, self.widths)

    def _capture_one(self, bs: int, meta: Any) -> Any:
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture (lazy inits, autotuning)
                self.model(ids, pos, self.kv_caches, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._last_out = self.model(ids, pos, self.kv_caches, meta)
        return graph

    def _replay(self, key: tuple[int, int]) -> torch.Tensor:
        graph, _, out = self.graphs[key]
        graph.replay()
        return out

    def prepare(self, batch: InputBatch, input_ids: torch.Tensor, positions: torch.Tensor,
                key: tuple[int, int]) -> None:
        """Fill the static inputs and the static metadata of graph `key` for this decode batch."""
        n = batch.num_reqs
        bs, width = key
        fresh = self.backend.build_metadata(
            self._common(n, bs, width, batch.seq_lens, batch.block_table, batch.slot_mapping),
            for_cuda_graph=True)
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:bs].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:bs].zero_()
        copy_tensors_into(self.graphs[key][1], fresh)

    def run(self, batch: InputBatch, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Replay for a decode-only batch; returns (hidden [n, hidden], padded batch size)."""
        key = self.graph_key(batch)
        self.prepare(batch, input_ids, positions, key)
        return self._replay(key)[:batch.num_reqs], key[0]
