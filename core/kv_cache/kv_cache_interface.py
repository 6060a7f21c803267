"""KV cache group specs: full attention, sliding window W, chunked local attention C (vLLM 0.33
`v1/kv_cache_interface.py`), and their typed parsing from a scenario / config list.

Every group uses the pool's one block size, so a spec carries only what its attention type adds.
`max_admission_blocks_per_request` is vLLM's per-request cap that the admission gate and the
startup fit check both use for a group that recycles its blocks (docs/scheduler_behaviour.md §4.12).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_sizing import cdiv

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"


@dataclass(slots=True, frozen=True)
class FullAttentionSpec:
    type = FULL_ATTENTION

    def max_admission_blocks_per_request(self, block_size: int, max_in_flight_tokens: int,
                                         max_model_len: int) -> Optional[int]:
        return None  # holds every block until the request finishes: no cap

    def to_dict(self) -> dict:
        return {"type": self.type}


@dataclass(slots=True, frozen=True)
class SlidingWindowSpec:
    sliding_window: int
    type = SLIDING_WINDOW

    def max_admission_blocks_per_request(self, block_size: int, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        # the window (W - 1 past tokens) plus what can be in flight; +1: the window starts mid-block
        return cdiv(min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1

    def to_dict(self) -> dict:
        return {"type": self.type, "sliding_window": self.sliding_window}


@dataclass(slots=True, frozen=True)
class ChunkedLocalAttentionSpec:
    attention_chunk_size: int
    type = CHUNKED_LOCAL_ATTENTION

    def max_admission_blocks_per_request(self, block_size: int, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        return cdiv(min(self.attention_chunk_size + max_in_flight_tokens, max_model_len), block_size)

    def to_dict(self) -> dict:
        return {"type": self.type, "attention_chunk_size": self.attention_chunk_size}


KVCacheGroupSpec = Union[FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec]
ONE_FULL_GROUP: tuple[KVCacheGroupSpec, ...] = (FullAttentionSpec(),)

# type -> (spec class, its extra key, the smallest value vLLM accepts)
_GROUP_TYPES: dict[str, tuple[type, Optional[str], int]] = {
    FULL_ATTENTION: (FullAttentionSpec, None, 0),
    SLIDING_WINDOW: (SlidingWindowSpec, "sliding_window", 2),
    CHUNKED_LOCAL_ATTENTION: (ChunkedLocalAttentionSpec, "attention_chunk_size", 1),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_kv_cache_group(raw: Any, path: str) -> KVCacheGroupSpec:
    """One entry: exactly `{"type": ...}` plus the key its type needs (a ConfigError names the field)."""
    if not isinstance(raw, dict):
        raise ConfigError(path, f'must be an object with a "type", got {raw!r}')
    kind = raw.get("type")
    if kind not in _GROUP_TYPES:
        raise ConfigError(f"{path}.type", f"unknown KV cache group type {kind!r} "
                          f"(one of {', '.join(_GROUP_TYPES)})")
    cls, key, minimum = _GROUP_TYPES[kind]
    if key is not None:
        if key not in raw:
            raise ConfigError(f"{path}.{key}", f"required for a {kind} group")
        if not _is_int(raw[key]) or raw[key] < minimum:
            raise ConfigError(f"{path}.{key}", f"must be an int >= {minimum}, got {raw[key]!r}")
    extra = sorted(set(raw) - {"type", key})
    if extra:
        raise ConfigError(f"{path}.{extra[0]}", f"unknown key for a {kind} group (allowed: type"
                          + (f", {key})" if key else ")"))
    return cls(raw[key]) if key is not None else cls()


def parse_kv_cache_groups(raw: Any, path: str = "kv_cache_groups") -> tuple[KVCacheGroupSpec, ...]:
    """The `kv_cache_groups` list: entry i is KV cache group i (vLLM's `KVCacheGroupSpec` i)."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(path, f"must be a non-empty list of groups, got {raw!r}")
    groups = tuple(parse_kv_cache_group(g, f"{path}[{i}]") for i, g in enumerate(raw))
    check_group_mix(groups, path)
    return groups


def check_group_mix(groups: tuple[KVCacheGroupSpec, ...], path: str = "kv_cache_groups") -> None:
    types = {g.type for g in groups}
    if SLIDING_WINDOW in types and CHUNKED_LOCAL_ATTENTION in types:
        raise ConfigError(path, "sliding_window and chunked_local_attention groups in one model are not "
                          "supported (no vLLM model has both)")


def check_retention_interval(interval: Any, groups: tuple[KVCacheGroupSpec, ...], block_size: int,
                             path: str = "prefix_cache_retention_interval") -> Optional[int]:
    """vLLM's `CacheConfig.prefix_cache_retention_interval`: None (dense) or an int >= 0; a positive
    value must be a multiple of the block size and needs a sliding-window group."""
    if interval is None:
        return None
    if not _is_int(interval) or interval < 0:
        raise ConfigError(path, f"must be null or an int >= 0, got {interval!r}")
    if interval > 0:
        if interval % block_size:
            raise ConfigError(path, f"{interval} must be a multiple of block_size ({block_size})")
        if not any(g.type == SLIDING_WINDOW for g in groups):
            raise ConfigError(path, f"{interval} > 0 needs a sliding_window KV cache group")
    return interval
