"""Per-step attention inputs shared by every backend (vLLM's `CommonAttentionMetadata`)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass(slots=True)
class CommonAttentionMetadata:
    """Device tensors of one flattened step plus their CPU copies (backends plan on the CPU side).

    `seq_lens[i]` counts the request's tokens once this step's are written (computed + scheduled);
    `query_start_loc` is the prefix sum of scheduled tokens; `slot_mapping[t]` is the flat cache slot
    of token t; `block_table` is padded with `pad_block_id`.
    """
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray


@dataclass(slots=True)
class GroupedAttentionMetadata:
    """A step's attention metadata when the model has several KV cache groups: one backend metadata
    per group (its own block table and slot mapping), and the group of each layer. Layer i reads
    `for_layer(i)`; a one-group model gets its backend metadata itself, not this wrapper."""
    groups: list
    layer_to_group: tuple[int, ...]

    def for_layer(self, layer_index: int):
        return self.groups[self.layer_to_group[layer_index]]


def metadata_for_layer(attn_metadata, layer_index: int):
    """The metadata layer `layer_index` attends with (the step's own, or its KV group's)."""
    if type(attn_metadata) is GroupedAttentionMetadata:
        return attn_metadata.for_layer(layer_index)
    return attn_metadata


def copy_tensors_into(static: object, fresh: object) -> None:
    """Copy every tensor field of the dataclass `fresh` into the same-shaped field of `static`.

    Used by CUDA-graph replay: captured kernels read the static tensors' memory.
    """
    for f in fields(static):  # type: ignore[arg-type]
        dst = getattr(static, f.name)
        src = getattr(fresh, f.name)
        if isinstance(dst, torch.Tensor):
            dst.copy_(src, non_blocking=True)
        elif isinstance(dst, list):
            for d, s in zip(dst, src):
                copy_tensors_into(d, s)
