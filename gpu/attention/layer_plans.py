"""One step's attention plans for every layer: layers that attend differently get different plans.

A plan (`AttentionBackend.build_metadata`) is built from a `CommonAttentionMetadata` (one block table,
one slot mapping) and an `AttentionWindow` (full / sliding W / chunked C). Layers sharing both share the
plan object. Today every layer reads the same block table, so a model with sliding and full layers gets
one plan per window over that table; with one KV-cache group per attention type, the caller passes each
group's `CommonAttentionMetadata` and the layer -> group index, and the same function builds one plan per
group.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from servetwin.gpu.attention.backend import AttentionBackend
from servetwin.gpu.attention.metadata import CommonAttentionMetadata
from servetwin.gpu.models.config import AttentionWindow


def build_layer_metadata(backend: AttentionBackend, commons: Sequence[CommonAttentionMetadata],
                         windows: Sequence[AttentionWindow],
                         layer_group: Optional[Sequence[int]] = None) -> Any:
    """The plan of every layer: a single plan when all layers share it (the dense full-attention case,
    as before), else a list with one entry per layer. `commons[g]` is KV-cache group g's step inputs and
    `layer_group[i]` layer i's group (None: one group, `commons[0]`, for every layer)."""
    groups = layer_group if layer_group is not None else [0] * len(windows)
    if len(groups) != len(windows):
        raise ValueError(f"layer_group has {len(groups)} entries for {len(windows)} layers")
    plans: dict[tuple[int, AttentionWindow], Any] = {}
    for g, w in zip(groups, windows):
        if (g, w) not in plans:
            plans[(g, w)] = (backend.build_metadata(commons[g]) if w.is_full
                             else backend.build_metadata(commons[g], window=w))
    if len(plans) == 1:
        return next(iter(plans.values()))
    return [plans[(g, w)] for g, w in zip(groups, windows)]
