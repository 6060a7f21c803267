"""Flatten one step's scheduled rows into model inputs (vLLM `_prepare_inputs`), vectorised.

For R requests with `num_scheduled_tokens[i]` new tokens after `num_computed_tokens[i]` cached ones:
  input_ids       [T]      the scheduled tokens, request after request
  positions       [T]      num_computed_tokens[i] + arange(num_scheduled_tokens[i])
  query_start_loc [R + 1]  prefix sum of num_scheduled_tokens
  seq_lens        [R]      num_computed_tokens + num_scheduled_tokens
  block_table     [R, W]   each request's first cdiv(seq_len, B) blocks, padded with `pad_block_id`
  slot_mapping    [T]      block_table[req, pos // B] * B + pos % B
  block_tables, slot_mappings: the same per KV cache group (group order; [0] is block_table /
                  slot_mapping). A window group's table keeps the ids the scheduler has since freed
                  (the runner learns only new blocks): attention must read only in-window blocks.
  logits_indices  [R]      query_start_loc[1:] - 1 (the last scheduled token of each request)
Only per-request Python work (list slicing, one block-table row each); no per-token loops.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import numpy as np
import torch

from servetwin.core.engine.runner_state import ScheduledRow


@dataclass(slots=True)
class InputBatch:
    req_ids: list[str]
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [R + 1]
    seq_lens: np.ndarray  # int32 [R]
    num_computed_tokens: np.ndarray  # int32 [R]
    num_scheduled_tokens: np.ndarray  # int32 [R]
    block_table: np.ndarray  # int32 [R, W]
    slot_mapping: np.ndarray  # int64 [T]
    logits_indices: np.ndarray  # int64 [R]
    block_size: int
    block_tables: list[np.ndarray]  # per KV cache group: int32 [R, W]
    slot_mappings: list[np.ndarray]  # per KV cache group: int64 [T]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_query_len(self) -> int:
        return int(self.num_scheduled_tokens.max()) if self.num_reqs else 0

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.num_reqs else 0

    @property
    def is_decode_only(self) -> bool:
        return self.num_reqs > 0 and self.max_query_len == 1


def build_block_table(block_ids: Sequence[Sequence[int]], num_blocks_needed: np.ndarray,
                      pad_block_id: int, width: int | None = None) -> np.ndarray:
    """`[R, width]` int32: row i holds the first `num_blocks_needed[i]` of `block_ids[i]`, then pads."""
    R = len(block_ids)
    W = int(num_blocks_needed.max()) if width is None and R else (width or 0)
    table = np.full((R, max(W, 1)), pad_block_id, dtype=np.int32)
    for i, (ids, n) in enumerate(zip(block_ids, num_blocks_needed.tolist())):
        if len(ids) < n:
            raise ValueError(f"block_table: request row {i} needs {n} blocks but has {len(ids)}")
        table[i, :n] = ids[:n]
    return table


def _row_tokens(row: ScheduledRow, c: int, n: int) -> list[int]:
    """Tokens [c, c + n) of a row: its known tokens, then its drafts (a padded -1 draft runs as token
    0; verification never accepts it)."""
    if not row.spec_token_ids:
        return row.state.token_ids[c:c + n]
    return row.state.token_ids[c:] + [max(t, 0) for t in row.spec_token_ids]


def prepare_inputs(rows: Sequence[ScheduledRow], block_size: int, pad_block_id: int) -> InputBatch:
    R = len(rows)
    computed = np.fromiter((r.num_computed_before for r in rows), dtype=np.int64, count=R)
    q_lens = np.fromiter((r.num_scheduled for r in rows), dtype=np.int64, count=R)
    T = int(q_lens.sum())
    qsl = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    seq_lens = computed + q_lens
    for r, c, n in zip(rows, computed.tolist(), q_lens.tolist()):
        if c + n > len(r.state.token_ids) + len(r.spec_token_ids):
            raise ValueError(f"input_ids: request {r.req_id} schedules tokens [{c}, {c + n}) but only "
                             f"{len(r.state.token_ids)} are known")
    input_ids = np.fromiter(chain.from_iterable(_row_tokens(r, c, n) for r, c, n in
                                                zip(rows, computed.tolist(), q_lens.tolist())),
                            dtype=np.int64, count=T)
    req_of_token = np.repeat(np.arange(R), q_lens)
    positions = np.arange(T, dtype=np.int64) - np.repeat(qsl[:-1] - computed, q_lens)
    num_blocks = -(-seq_lens // block_size)
    block_tables, slot_mappings = [], []
    for g in range(len(rows[0].state.block_ids) if R else 1):  # one table + slot mapping per KV group
        table = build_block_table([r.state.block_ids[g] for r in rows], num_blocks, pad_block_id)
        block_tables.append(table)
        slot_mappings.append(table[req_of_token, positions // block_size].astype(np.int64) * block_size
                             + positions % block_size)
    return InputBatch(
        req_ids=[r.req_id for r in rows],
        input_ids=input_ids,
        positions=positions,
        query_start_loc=qsl.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        num_computed_tokens=computed.astype(np.int32),
        num_scheduled_tokens=q_lens.astype(np.int32),
        block_table=block_tables[0],
        slot_mapping=slot_mappings[0],
        logits_indices=qsl[1:] - 1,
        block_size=block_size,
        block_tables=block_tables,
        slot_mappings=slot_mappings,
    )


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)
