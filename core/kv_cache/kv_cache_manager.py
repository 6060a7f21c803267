"""`KVCacheManager` for one full-attention group (vLLM 0.33 kv_cache_manager + FullAttentionManager)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servetwin.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.request import Request, RequestStatus

KV_CACHE_GROUP_ID = 0
_GID = KV_CACHE_GROUP_ID.to_bytes(4, "big")


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
    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, watermark: float = 0.0, log_stats: bool = True) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark: must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats: Optional[PrefixCacheStats] = PrefixCacheStats() if log_stats else None

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    # -- lookup ------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix, block-granular, capped at N-1 tokens, stopping at the first miss."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.cached_block_hash_to_block.get_one_block
        hits: list[KVCacheBlock] = []
        hashes = request.block_hashes
        for i in range(min(max_hit_blocks, len(hashes))):
            block = get(hashes[i] + _GID)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
    def _num_blocks_to_allocate(self, request_id: str, num_tokens: int, hits: list[KVCacheBlock]) -> int:
        required = cdiv(num_tokens, self.block_size)
        held = self.req_to_blocks.get(request_id)
        num_held = len(held) if held else 0
        if request_id in self.num_cached_block:
            return max(required - num_held, 0)
        new = max(required - (len(hits) + num_held), 0)
        return new + sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False,
                       has_scheduled_reqs: bool = False) -> Optional[list[KVCacheBlock]]:
        """Allocate blocks for `num_new_tokens` more tokens; None (with no side effect) if they don't fit."""
        hits = new_computed_blocks or []
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens")
        rid = request.request_id
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        free = self.block_pool.free_block_queue.num_free_blocks
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        if full_sequence_must_fit:
            full_len = min(request.num_tokens, self.max_model_len)
            if self._num_blocks_to_allocate(rid, full_len, hits) + watermark > free:
                return None
        need_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if self._num_blocks_to_allocate(rid, need_slots, hits) + watermark > free:
            return None

        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if hits:
            if rid in self.num_cached_block:
                raise AssertionError(f"running request {rid} cannot adopt prefix-cache hits")
            self.block_pool.touch(hits)
            req_blocks.extend(hits)
            self.num_cached_block[rid] = len(req_blocks)
        return self._grow(request, req_blocks, need_slots, min(total_computed + num_new_tokens, request.num_tokens))

    def allocate_running_slots(self, request: Request, num_new_tokens: int,
                               computed: Optional[int] = None) -> list[KVCacheBlock]:
        """`allocate_slots(request, num_new_tokens)` for a running request (it holds blocks, no new
        prefix hits) whose new blocks the caller already knows to be free: the same effects, no checks.
        `computed` overrides `request.num_computed_tokens` (the C a scheduler subclass keeps implicitly:
        the simulator's implicit decodes, servetwin.sim.lazy_decode)."""
        if computed is None:
            computed = request.num_computed_tokens
        need_slots = min(computed + num_new_tokens, self.max_model_len)
        return self._grow(request, self.req_to_blocks[request.request_id], need_slots,
                          min(computed + num_new_tokens, len(request._all_token_ids)))

    def _grow(self, request: Request, req_blocks: list[KVCacheBlock], need_slots: int,
              num_known_tokens: int) -> list[KVCacheBlock]:
        """Give the request blocks for `need_slots` slots and register its full blocks."""
        num_new_blocks = -(-need_slots // self.block_size) - len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            req_blocks.extend(new_blocks)
        if self.enable_caching:
            self.cache_blocks(request, num_known_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full of known tokens in the prefix cache."""
        rid = request.request_id
        already = self.num_cached_block.get(rid, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if already >= num_full:
            return
        self.block_pool.cache_full_blocks(self.req_to_blocks[rid], request.block_hashes, already, num_full,
                                          KV_CACHE_GROUP_ID)
        self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        """Free the request's blocks tail-first (its deepest cached block becomes evictable first)."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True
