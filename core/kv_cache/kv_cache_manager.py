"""`KVCacheManager`: the scheduler's interface to the KV cache groups (vLLM 0.33 `kv_cache_manager.py`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servetwin.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from servetwin.core.kv_cache.kv_cache_coordinator import BlocksPerGroup, make_coordinator
from servetwin.core.kv_cache.kv_cache_interface import ONE_FULL_GROUP, KVCacheGroupSpec
from servetwin.core.request import Request, RequestStatus


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    """vLLM 0.33's `KVCacheManager`: the coordinator of every KV cache group (one full-attention
    group unless `kv_cache_groups` says otherwise) over one `BlockPool`.

    `req_to_blocks` / `num_cached_block` are group 0's tables; with `single_full_attention` they are
    the whole state, and the scheduler's one-group fast path reads them directly."""

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, watermark: float = 0.0, log_stats: bool = True,
                 kv_cache_groups: Optional[tuple[KVCacheGroupSpec, ...]] = None,
                 prefix_cache_retention_interval: Optional[int] = 0,
                 max_in_flight_tokens: Optional[int] = None, drop_eagle_block: bool = False) -> None:
        """`max_in_flight_tokens` sizes the window groups' admission cap (the scheduler passes
        `SchedulerConfig.max_in_flight_tokens`; None: max_model_len, no cap below the sequence).
        `drop_eagle_block`: vLLM's `use_eagle_block_drop` (a hit gives back its last block)."""
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        groups = kv_cache_groups or ONE_FULL_GROUP
        self.kv_cache_groups = groups
        self.coordinator = make_coordinator(
            groups, self.block_pool, block_size, enable_caching,
            max_model_len if max_in_flight_tokens is None else max_in_flight_tokens, max_model_len,
            prefix_cache_retention_interval, drop_eagle_block)
        self.single_full_attention = groups == ONE_FULL_GROUP
        self.has_windows = self.coordinator.has_windows
        manager0 = self.coordinator.single_type_managers[0]
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = manager0.req_to_blocks
        self.num_cached_block: dict[str, int] = manager0.num_cached_block
        self.prefix_cache_stats: Optional[PrefixCacheStats] = PrefixCacheStats() if log_stats else None

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    # -- lookup ------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[BlocksPerGroup, int]:
        """The longest prefix cached in every group, block-granular, capped at N-1 tokens.

        When one group's lookup alone would hit further than all groups together, the request keeps
        that length as its `shared_prefix_boundary` (its sliding-window blocks there get retained;
        vLLM 0.33 v1/core/kv_cache_manager.py:319-325); every lookup sets it, to 0 when there is no
        such junction (v1/core/sched/scheduler.py:1121-1126), so a resumed request drops a stale one."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            request.shared_prefix_boundary = 0
            return self.coordinator.empty_hits, 0
        blocks, hit, longest_hit = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1)
        request.shared_prefix_boundary = longest_hit if longest_hit > hit else 0
        return blocks, hit

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.prefix_cache_stats is None or not self.enable_caching or request.skip_reading_prefix_cache:
            return
        self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> Optional[PrefixCacheStats]:
        stats = self.prefix_cache_stats
        if stats is None:
            return None
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Optional[BlocksPerGroup] = None,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = False, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, reserved_blocks: int = 0) -> Optional[BlocksPerGroup]:
        """Allocate blocks for `num_new_tokens` more tokens in every group; the new blocks per group,
        or None when they don't fit (then only the out-of-window blocks were freed).

        KV connectors: `num_external_computed_tokens` get blocks too (the connector fills them);
        `delay_cache_blocks` leaves them out of the prefix cache until the load is done;
        `reserved_blocks` must stay free for in-flight prefills (an async load's admission)."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens")
        coord = self.coordinator
        hits = new_computed_blocks or coord.empty_hits
        rid = request.request_id
        local_computed = request.num_computed_tokens + num_new_computed_tokens
        if self.has_windows:  # on what is processed: an in-flight step's tokens do not count yet
            coord.remove_skipped_blocks(rid, local_computed + num_external_computed_tokens
                                        - request.num_in_flight_tokens)
        total_computed = min(local_computed + num_external_computed_tokens, self.max_model_len)
        free = self.block_pool.free_block_queue.num_free_blocks
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        if full_sequence_must_fit:  # the admission gate: window groups count at most their cap
            full_len = min(request.num_tokens, self.max_model_len)
            if coord.get_num_blocks_to_allocate(rid, full_len, hits, total_computed, True) + watermark > free:
                return None
        need_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if coord.get_num_blocks_to_allocate(rid, need_slots, hits, total_computed) + watermark > free - reserved_blocks:
            return None
        if new_computed_blocks or rid not in self.num_cached_block:
            # (speed: a running request adopts no hits - every group's `save_new_computed_blocks` returns at
            # once for it; the groups hold a request together, so group 0's table says it is running)
            coord.save_new_computed_blocks(rid, hits, total_computed)
        new_blocks = coord.allocate_new_blocks(rid, need_slots)
        if self.enable_caching and not delay_cache_blocks:
            coord.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def allocate_running_slots(self, request: Request, num_new_tokens: int,
                               computed: Optional[int] = None,
                               num_in_flight: Optional[int] = None) -> BlocksPerGroup:
        """`allocate_slots(request, num_new_tokens)` for a running request whose new blocks the caller
        already knows to be free: the same effects in the same order (window groups first drop the
        blocks out of their window, then every group allocates, then caches), no checks.
        `computed` / `num_in_flight` override `request.num_computed_tokens` / `num_in_flight_tokens`
        (the state a scheduler subclass keeps implicitly: the simulator's implicit decodes,
        servetwin.sim.lazy_decode)."""
        if computed is None:
            computed = request.num_computed_tokens
        if not self.has_windows and len(self.kv_cache_groups) == 1:  # (one group: no extra layer)
            manager = self.coordinator.single_type_managers[0]
            group_blocks = manager.allocate_new_blocks(request.request_id, min(computed + num_new_tokens,
                                                                               self.max_model_len))
            if self.enable_caching:
                manager.cache_blocks(request, min(computed + num_new_tokens, request.num_tokens))
            return (group_blocks,)
        coord = self.coordinator
        rid = request.request_id
        if self.has_windows:  # on what is processed, as allocate_slots
            if num_in_flight is None:
                num_in_flight = request.num_in_flight_tokens
            coord.remove_skipped_blocks(rid, computed - num_in_flight)
        total_computed = min(computed, self.max_model_len)
        new_blocks = coord.allocate_new_blocks(rid, min(total_computed + num_new_tokens, self.max_model_len))
        if self.enable_caching:
            coord.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full of known tokens in the prefix cache."""
        for manager in self.coordinator.single_type_managers:  # (the scheduler's hot path: no extra layer)
            manager.cache_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Free the request's blocks group by group, each tail first."""
        self.coordinator.free(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Take the request's blocks (group order, no null head) without returning them to the pool:
        the caller frees them later, in reverse (a consumer's deferred free)."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def get_blocks(self, request_id: str) -> BlocksPerGroup:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks] for blocks in self.coordinator.get_blocks(request_id))

    def num_blocks_per_group(self, request_id: str) -> list[int]:
        """Non-null blocks the request holds in each group (the oracle's `blocks_per_group`)."""
        return [m.num_held_blocks(request_id) for m in self.coordinator.single_type_managers]

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True
