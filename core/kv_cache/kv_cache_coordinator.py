"""The KV cache coordinator: the managers of every KV cache group over one shared `BlockPool`
(vLLM 0.33 `v1/core/kv_cache_coordinator.py`).

- `KVCacheCoordinatorNoPrefixCache`: prefix caching off, any number of groups (no hits; windows
  still free their blocks).
- `UnitaryKVCacheCoordinator`: one group.
- `HybridKVCacheCoordinator`: several groups; a hit must hold in every group (the search below).

Demand is summed over groups; new blocks are taken, and blocks freed, group by group in group order.
"""
from __future__ import annotations

from typing import Optional

from servetwin.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from servetwin.core.kv_cache.kv_cache_interface import FULL_ATTENTION, KVCacheGroupSpec
from servetwin.core.kv_cache.single_type_kv_cache_manager import (
    MANAGER_FOR_SPEC, FullAttentionManager, SingleTypeKVCacheManager, SlidingWindowManager)
from servetwin.core.request import Request

BlocksPerGroup = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    def __init__(self, groups: tuple[KVCacheGroupSpec, ...], block_pool: BlockPool, block_size: int,
                 enable_caching: bool, max_in_flight_tokens: int, max_model_len: int,
                 retention_interval: Optional[int]) -> None:
        self.kv_cache_groups = groups
        self.block_pool = block_pool
        self.block_size = block_size
        self.retention_interval = retention_interval
        self.single_type_managers: list[SingleTypeKVCacheManager] = []
        for gid, spec in enumerate(groups):
            cls = MANAGER_FOR_SPEC[type(spec)]
            extra = {"retention_interval": retention_interval} if cls is SlidingWindowManager else {}
            self.single_type_managers.append(cls(
                spec, block_pool, block_size, gid, enable_caching,
                spec.max_admission_blocks_per_request(block_size, max_in_flight_tokens, max_model_len),
                **extra))
        self.has_windows = any(g.type != FULL_ATTENTION for g in groups)
        # the managers whose attention skips leading tokens (speed: `remove_skipped_blocks` of a full-attention
        # manager skips nothing and returns at once; it runs at every allocation of a hybrid model)
        self.window_managers = [m for m in self.single_type_managers if type(m) is not FullAttentionManager]
        self.empty_hits: BlocksPerGroup = tuple([] for _ in groups)
        # EAGLE / MTP without lookahead block hashes (a KV connector keeps the legacy hashes): a hit
        # gives back its last block, whose KV the drafter must recompute (single_type_kv_cache_manager
        # .py:826-830); set by make_coordinator
        self.drop_eagle_block = False

    # -- demand and allocation (summed / in group order) ------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, hits: BlocksPerGroup,
                                   total_computed_tokens: int, apply_admission_cap: bool = False) -> int:
        total = 0  # (plain loops: this runs for every allocation)
        for m, h in zip(self.single_type_managers, hits):
            total += m.get_num_blocks_to_allocate(request_id, num_tokens, h, total_computed_tokens,
                                                  apply_admission_cap)
        return total

    def save_new_computed_blocks(self, request_id: str, hits: BlocksPerGroup,
                                 total_computed_tokens: int) -> None:
        for m, h in zip(self.single_type_managers, hits):
            m.save_new_computed_blocks(request_id, h, total_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> BlocksPerGroup:
        return tuple([m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers])

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.single_type_managers:
            m.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.window_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        for m in self.single_type_managers:
            blocks = m.req_to_blocks.pop(request_id, [])
            m.num_cached_block.pop(request_id, None)
            out.extend(b for b in blocks if not b.is_null)  # (null entries are only the head)
        return out

    def get_blocks(self, request_id: str) -> BlocksPerGroup:
        return tuple([m.req_to_blocks.get(request_id, []) for m in self.single_type_managers])

    # -- cache hits --------------------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: list[bytes],
                               max_length: int) -> tuple[BlocksPerGroup, int, int]:
        """(hit blocks per group, hit length, the longest hit of any single group's lookup)."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes, max_length):
        return self.empty_hits, 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes, max_length):
        m = self.single_type_managers[0]
        blocks = m.find_longest_cache_hit(block_hashes, max_length, [0], self.block_pool,
                                          m.kv_cache_spec, self.block_size)
        if self.drop_eagle_block and blocks[0] and type(m) is FullAttentionManager:
            del blocks[0][-1]  # (a lone sliding-window group: not modelled)
        hit = len(blocks[0]) * self.block_size
        return tuple(blocks), hit, hit


class HybridKVCacheCoordinator(KVCacheCoordinator):
    def __init__(self, groups: tuple[KVCacheGroupSpec, ...], block_pool: BlockPool, block_size: int,
                 enable_caching: bool, max_in_flight_tokens: int, max_model_len: int,
                 retention_interval: Optional[int]) -> None:
        super().__init__(groups, block_pool, block_size, enable_caching, max_in_flight_tokens, max_model_len,
                         retention_interval)
        # groups with the same spec are looked up together, full attention first
        by_spec: dict[KVCacheGroupSpec, list[int]] = {}
        for gid, spec in enumerate(self.kv_cache_groups):
            by_spec.setdefault(spec, []).append(gid)
        self.attention_groups = sorted(by_spec.items(), key=lambda kv: kv[0].type != FULL_ATTENTION)
        self.simple_hybrid = (len(self.attention_groups) == 2
                              and self.attention_groups[0][0].type == FULL_ATTENTION)

    def find_longest_cache_hit(self, block_hashes, max_length):
        """Each spec bounds the next one's search; repeat until no spec shortens the hit (one pass
        for full attention + one other spec). The full-attention blocks are cut to the result."""
        bs = self.block_size
        hits: list[Optional[list[KVCacheBlock]]] = [None] * len(self.kv_cache_groups)
        hit_length = max_length
        longest_hit = 0
        # EAGLE: each spec peeks one block past the candidate and drops it, once per candidate
        # length (kv_cache_coordinator.py:840-915)
        eagle_verified: set[int] = set()
        while True:
            curr = hit_length
            for idx, (spec, gids) in enumerate(self.attention_groups):
                if spec.type == FULL_ATTENTION and hits[gids[0]] is not None:
                    curr = curr // bs * bs  # a prefix of a full-attention hit is a hit
                    for g in gids:
                        del hits[g][curr // bs:]
                    continue
                m = self.single_type_managers[gids[0]]
                drop = self.drop_eagle_block and idx not in eagle_verified
                search = min(curr + bs, len(block_hashes) * bs) if drop else curr
                found = m.find_longest_cache_hit(block_hashes, search, gids, self.block_pool, spec, bs,
                                                 drop_eagle_block=drop)
                new = len(found[0]) * bs
                if drop:
                    eagle_verified.add(idx)
                elif new < curr:
                    eagle_verified.clear()
                curr = new
                # the longest hit of any one lookup, not only full attention's: the junction a
                # lagging sliding-window group pins (vLLM 0.33 v1/core/kv_cache_coordinator.py:913,937)
                longest_hit = max(longest_hit, curr)
                for g, blocks in zip(gids, found):
                    hits[g] = blocks
            if curr >= hit_length:
                break
            hit_length = curr
            if self.simple_hybrid:
                break
        for g, spec in enumerate(self.kv_cache_groups):
            if spec.type == FULL_ATTENTION:
                del hits[g][hit_length // bs:]
        return tuple(h if h is not None else [] for h in hits), hit_length, longest_hit


def make_coordinator(groups: tuple[KVCacheGroupSpec, ...], block_pool: BlockPool, block_size: int,
                     enable_caching: bool, max_in_flight_tokens: int, max_model_len: int,
                     retention_interval: Optional[int], drop_eagle_block: bool = False) -> KVCacheCoordinator:
    """The coordinator for these groups. `drop_eagle_block`: EAGLE's last-block drop on a hit (one
    full-attention group; not modelled for hybrid groups yet)."""
    cls: type[KVCacheCoordinator]
    if not enable_caching:
        cls = KVCacheCoordinatorNoPrefixCache
    elif len(groups) == 1:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    coordinator = cls(groups, block_pool, block_size, enable_caching, max_in_flight_tokens, max_model_len,
                      retention_interval)
    coordinator.drop_eagle_block = drop_eagle_block
    for manager in coordinator.single_type_managers:
        manager.use_eagle = drop_eagle_block
    return coordinator
