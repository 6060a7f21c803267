"""KV cache groups of a model from its per-layer attention types, and the pool they share
(vLLM 0.33 `v1/core/kv_cache_planning.py`, one block size and one page size for every layer).

- Grouping: layers are bucketed by spec in order of first appearance; the group size is the smallest
  bucket (the largest if it is < 1.5x the smallest); each bucket is cut into consecutive groups of
  that many layers. gpt-oss (sliding 128 / full alternating) -> [sliding 128, full]; Gemma 3 (5
  sliding : 1 full) -> five sliding groups, then one full.
- Promotion: without the hybrid manager (`disable_hybrid_kv_cache_manager`, or chunked local layers
  without VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1) the window layers of a model that
  also has full attention become full attention: one full-attention group.
- Pool: a block of the pool holds one block of one layer of every group's `group_size` layers, so
  `num_blocks = available // (page_size * group_size)`: a window group of 12 layers costs what a full
  group of 12 layers costs per block, and a gpt-oss pool has 2x the blocks of an all-full one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_cache_interface import (
    CHUNKED_LOCAL_ATTENTION, FULL_ATTENTION, ChunkedLocalAttentionSpec, FullAttentionSpec,
    ONE_FULL_GROUP, KVCacheGroupSpec, SlidingWindowSpec, check_group_mix)
from servetwin.core.kv_cache.kv_sizing import KVCacheSpec, cdiv, check_or_fit_max_model_len

ALLOW_CHUNKED_LOCAL_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"
# the per-layer names of a model config (HF `layer_types`)
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
GROUP_SIZE_SLACK = 1.5  # vLLM: use the largest bucket when it is below 1.5x the smallest


@dataclass(slots=True, frozen=True)
class KVCachePlan:
    """The groups (group order = vLLM's `KVCacheGroupSpec` order), which group each layer is in, and
    the layers per group (all groups equal; the last group of a bucket may be short: padding)."""
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    layer_to_group: tuple[int, ...]
    group_size: int

    def num_blocks(self, available_bytes: int, page_size_bytes: int) -> int:
        """Blocks of the shared pool: one page per layer of a group, `group_size` layers."""
        return max(0, int(available_bytes) // (page_size_bytes * self.group_size))

    @property
    def scheduler_groups(self) -> Optional[tuple[KVCacheGroupSpec, ...]]:
        """What `CacheConfig.kv_cache_groups` takes: None for one full-attention group (its default)."""
        return None if self.kv_cache_groups == ONE_FULL_GROUP else self.kv_cache_groups

    def fit_max_model_len(self, num_blocks: int, spec: KVCacheSpec, max_model_len: int, derived_max_len: int,
                          max_in_flight_tokens: int) -> int:
        """vLLM's start-up check (or auto-fit, -1) of max_model_len against the pool: one full-attention
        group as `kv_sizing.check_or_fit_max_model_len`, several as `check_or_fit_max_model_len_groups`."""
        if self.scheduler_groups is None:
            return check_or_fit_max_model_len(num_blocks, spec, max_model_len, derived_max_len)
        return check_or_fit_max_model_len_groups(num_blocks, self.kv_cache_groups, spec.block_size, max_model_len,
                                                 derived_max_len, max_in_flight_tokens)


def layer_specs(num_layers: int, layer_types: Optional[Sequence[str]] = None,
                sliding_window: Optional[int] = None,
                attention_chunk_size: Optional[int] = None) -> list[KVCacheGroupSpec]:
    """Per-layer specs from a model's fields (`layer_types` None: every layer full attention)."""
    if layer_types is None:
        return [FullAttentionSpec()] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError("layer_types", f"has {len(layer_types)} entries for {num_layers} layers")
    out: list[KVCacheGroupSpec] = []
    for i, t in enumerate(layer_types):
        if t == "full_attention":
            out.append(FullAttentionSpec())
        elif t == "sliding_attention":
            if not isinstance(sliding_window, int) or sliding_window < 2:
                raise ConfigError("sliding_window", f"layer {i} is sliding_attention: needs an int >= 2, "
                                  f"got {sliding_window!r}")
            out.append(SlidingWindowSpec(sliding_window))
        elif t == "chunked_attention":
            if not isinstance(attention_chunk_size, int) or attention_chunk_size < 1:
                raise ConfigError("attention_chunk_size", f"layer {i} is chunked_attention: needs an int "
                                  f">= 1, got {attention_chunk_size!r}")
            out.append(ChunkedLocalAttentionSpec(attention_chunk_size))
        else:
            raise ConfigError(f"layer_types[{i}]", f"unknown attention type {t!r} (one of {', '.join(LAYER_TYPES)})")
    return out


def _promote_to_full(specs: list[KVCacheGroupSpec]) -> list[KVCacheGroupSpec]:
    """Without the hybrid manager: one spec for every layer, or an error naming why not."""
    kinds = set(specs)
    if len(kinds) <= 1:
        return specs
    if any(s.type == FULL_ATTENTION for s in specs):
        return [FullAttentionSpec()] * len(specs)
    raise ConfigError("disable_hybrid_kv_cache_manager", "the model's layers have different attention "
                      f"windows and no full-attention layer ({sorted(map(str, kinds))}): they need the "
                      "hybrid KV cache manager")


def kv_cache_groups_for_layers(specs: Sequence[KVCacheGroupSpec], disable_hybrid_kv_cache_manager: bool = False,
                               allow_chunked_local: Optional[bool] = None) -> KVCachePlan:
    """vLLM's grouping of per-layer attention specs into equal-size KV cache groups.

    `allow_chunked_local` None reads VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE."""
    specs = list(specs)
    if not specs:
        raise ConfigError("layer_types", "a model needs at least one layer")
    if allow_chunked_local is None:
        allow_chunked_local = os.environ.get(ALLOW_CHUNKED_LOCAL_ENV, "0") not in ("", "0")
    has_chunked = any(s.type == CHUNKED_LOCAL_ATTENTION for s in specs)
    if disable_hybrid_kv_cache_manager or (has_chunked and not allow_chunked_local):
        specs = _promote_to_full(specs)
    check_group_mix(tuple(dict.fromkeys(specs)), "layer_types")
    buckets: dict[KVCacheGroupSpec, list[int]] = {}
    for i, s in enumerate(specs):
        buckets.setdefault(s, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < GROUP_SIZE_SLACK * group_size:
        group_size = max(sizes)
    groups: list[KVCacheGroupSpec] = []
    layer_to_group = [0] * len(specs)
    for spec, layers in buckets.items():
        for start in range(0, len(layers), group_size):
            for layer in layers[start:start + group_size]:
                layer_to_group[layer] = len(groups)
            groups.append(spec)
    return KVCachePlan(tuple(groups), tuple(layer_to_group), group_size)


def model_kv_plan(model: Any, disable_hybrid_kv_cache_manager: bool = False) -> KVCachePlan:
    """The KV cache groups of a model description with `num_layers` and, where it has them,
    `layer_types` / `sliding_window` / `attention_chunk_size` (ModelSpec, the torch backend's
    DecoderConfig); a model that names no layer types is all full attention."""
    specs = layer_specs(model.num_layers, getattr(model, "layer_types", None),
                        getattr(model, "sliding_window", None), getattr(model, "attention_chunk_size", None))
    return kv_cache_groups_for_layers(specs, disable_hybrid_kv_cache_manager)


def describe_kv_plan(plan: KVCachePlan) -> str:
    """One line for reports and `servetwin presets`, e.g. "sliding_window 128 + full_attention (2 KV
    cache groups x 12 layers)": each group's attention type (and window), the layers a pool block holds
    one page of."""
    kinds = " + ".join(" ".join(str(v) for v in g.to_dict().values()) for g in dict.fromkeys(plan.kv_cache_groups))
    n = len(plan.kv_cache_groups)
    return f"{kinds} ({n} KV cache group{'s' if n > 1 else ''} x {plan.group_size} layers)"


def max_blocks_per_request(groups: Sequence[KVCacheGroupSpec], block_size: int, num_tokens: int,
                           max_in_flight_tokens: int, max_model_len: int) -> int:
    """Blocks one request of `num_tokens` holds at most, summed over groups (a window group at most
    its admission cap): vLLM's startup check wants this <= the pool for max_model_len."""
    blocks = cdiv(num_tokens, block_size)
    total = 0
    for g in groups:
        cap = g.max_admission_blocks_per_request(block_size, max_in_flight_tokens, max_model_len)
        total += blocks if cap is None else min(blocks, cap)
    return total


def check_or_fit_max_model_len_groups(num_blocks: int, groups: Sequence[KVCacheGroupSpec], block_size: int,
                                      max_model_len: int, derived_max_len: int,
                                      max_in_flight_tokens: int) -> int:
    """`kv_sizing.check_or_fit_max_model_len` for several groups: one request of max_model_len must
    fit the usable blocks (-1: the largest length that fits, at most the model's)."""
    usable = num_blocks - 1
    if num_blocks <= 1:
        raise ConfigError("num_gpu_blocks", "no available memory for the KV cache (0 blocks); "
                          "increase gpu_memory_utilization or the KV budget.")

    def fits(n: int) -> bool:
        return max_blocks_per_request(groups, block_size, n, max_in_flight_tokens, n) <= usable

    if max_model_len == -1:
        lo, hi = 0, derived_max_len  # largest n <= derived with fits(n); fits is monotone in n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        if lo <= 0:
            raise ConfigError("max_model_len", "the KV cache cannot serve even a single token.")
        return lo
    if not fits(max_model_len):
        need = max_blocks_per_request(groups, block_size, max_model_len, max_in_flight_tokens, max_model_len)
        raise ConfigError(
            "max_model_len", f"{max_model_len} tokens need {need} blocks over {len(groups)} KV cache groups "
            f"but the KV cache has {usable} usable blocks. Lower max_model_len or give the KV cache more memory.")
    return max_model_len
