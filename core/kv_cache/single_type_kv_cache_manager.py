"""One manager per attention type, each owning one KV cache group's block tables (vLLM 0.33
`v1/core/single_type_kv_cache_manager.py`). All groups draw from the one shared `BlockPool`.

- `FullAttentionManager`: a request holds every block until it finishes; hits are the longest
  cached prefix.
- `SlidingWindowManager` (W): blocks wholly before `n - W + 1` are freed and replaced by the null
  block; a hit needs `cdiv(W - 1, B)` consecutive cached blocks (right to left); with sparse
  retention only blocks a later request can hit are hashed.
- `ChunkedLocalAttentionManager` (C): blocks before the current chunk `floor(n / C) * C` are freed;
  a hit treats those as cached and looks up the rest.
"""
from __future__ import annotations

from typing import Optional

from servetwin.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from servetwin.core.kv_cache.kv_cache_interface import (
    ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec)
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.request import Request


class SingleTypeKVCacheManager:
    """Block tables of one group: `req_to_blocks[id]` (null entries included) and how many of a
    request's leading blocks have been through `cache_blocks` (`num_cached_block`)."""

    def __init__(self, spec: KVCacheGroupSpec, block_pool: BlockPool, block_size: int,
                 kv_cache_group_id: int, enable_caching: bool,
                 max_admission_blocks_per_request: Optional[int] = None) -> None:
        self.kv_cache_spec = spec
        self.block_pool = block_pool
        self.block_size = block_size
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.null_block = block_pool.null_block
        # EAGLE / MTP without lookahead hashes: hits peek one block further and drop it (the
        # coordinator sets it; vLLM's `use_eagle` of a manager)
        self.use_eagle = False
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens attention no longer reads (0: full attention keeps everything)."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list,
                                   total_computed_tokens: int, apply_admission_cap: bool = False) -> int:
        """New blocks for `num_tokens` slots, plus the hits that sit in the free queue (touching them
        takes them out of it); blocks skipped by the window need no slot."""
        required = cdiv(num_tokens, self.block_size)
        cap = self.max_admission_blocks_per_request
        if apply_admission_cap and cap is not None and cap < required:
            required = cap
        held = self.req_to_blocks.get(request_id)
        num_held = len(held) if held else 0
        if request_id in self.num_cached_block:  # running: no new hits
            return max(required - num_held, 0)
        skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(required - max(skipped, len(new_computed_blocks) + num_held), 0)
        kept = new_computed_blocks[max(0, skipped - num_held):] if skipped else new_computed_blocks
        for b in kept:  # = sum(1 for b in kept if ...) (speed: no generator; ~50 hits an admission, twice)
            if b.ref_cnt == 0 and not b.is_null:
                num_new += 1
        return num_new

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list,
                                 total_computed_tokens: int) -> None:
        """A new request adopts its hits: skipped ones become null entries, the rest are touched."""
        if request_id in self.num_cached_block:
            if new_computed_blocks:
                raise AssertionError(f"running request {request_id} cannot adopt prefix-cache hits")
            return
        skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        hits = new_computed_blocks[skipped:] if skipped else new_computed_blocks
        if hits:
            self.block_pool.touch(hits)
        blocks = [self.null_block] * skipped if skipped else []
        blocks.extend(hits)
        self.req_to_blocks[request_id] = blocks
        self.num_cached_block[request_id] = len(blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks[request_id]
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full of known tokens in the prefix cache."""
        rid = request.request_id
        already = self.num_cached_block.get(rid, 0)
        num_full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if already >= num_full:
            return
        self._cache_range(request, already, num_full)
        self.num_cached_block[rid] = num_full

    def _cache_range(self, request: Request, start: int, end: int) -> None:
        self.block_pool.cache_full_blocks(self.req_to_blocks[request.request_id], request.block_hashes,
                                          start, end, self.kv_cache_group_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the whole blocks attention skips and put the null block in their place (from the
        highest index down; an earlier call already nulled everything below the first null)."""
        skipped = self.get_num_skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null = self.null_block
        removed = []
        for i in range(min(skipped // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def free(self, request_id: str) -> None:
        """Tail first (the null head is skipped by the pool): the deepest block is evicted first."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def num_held_blocks(self, request_id: str) -> int:
        """Non-null blocks the request holds in this group."""
        null = self.null_block
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not null)


class FullAttentionManager(SingleTypeKVCacheManager):
    @staticmethod
    def find_longest_cache_hit(block_hashes: list[bytes], max_length: int, group_ids: list[int],
                               block_pool: BlockPool, spec: KVCacheGroupSpec, block_size: int,
                               drop_eagle_block: bool = False) -> list[list[KVCacheBlock]]:
        """The longest cached prefix (chained hashes: the first miss ends it), in every group of
        `group_ids`; `drop_eagle_block` gives back its last block (single_type_kv_cache_manager.py:
        826-830)."""
        hashes = block_hashes[:max_length // block_size]
        if len(group_ids) == 1:  # one group (the common case): the hash map directly
            hits = block_pool.cached_block_hash_to_block.get_leading_blocks(hashes, group_ids[0].to_bytes(4, "big"))
            if drop_eagle_block and hits:
                hits.pop()
            return [hits]
        out: list[list[KVCacheBlock]] = [[] for _ in group_ids]
        get = block_pool.get_cached_block
        for h in hashes:
            cached = get(h, group_ids)
            if cached is None:
                break
            for blocks, b in zip(out, cached):
                blocks.append(b)
        if drop_eagle_block and out[0]:
            for blocks in out:
                blocks.pop()
        return out


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, spec: SlidingWindowSpec, block_pool: BlockPool, block_size: int,
                 kv_cache_group_id: int, enable_caching: bool,
                 max_admission_blocks_per_request: Optional[int] = None, *,
                 retention_interval: Optional[int] = 0) -> None:
        super().__init__(spec, block_pool, block_size, kv_cache_group_id, enable_caching,
                         max_admission_blocks_per_request)
        self.sliding_window = spec.sliding_window
        self.retention_interval = retention_interval
        # consecutive cached blocks a hit needs: the W - 1 tokens before the next one
        self.contiguous_blocks = cdiv(spec.sliding_window - 1, self.block_size)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    @staticmethod
    def find_longest_cache_hit(block_hashes: list[bytes], max_length: int, group_ids: list[int],
                               block_pool: BlockPool, spec: SlidingWindowSpec, block_size: int,
                               drop_eagle_block: bool = False) -> list[list[KVCacheBlock]]:
        """Right to left: the hit ends at the right end of the first run of `cdiv(W - 1, B)` cached
        blocks (null before it); without such a run only a run starting at block 0 counts. With
        `drop_eagle_block` the run is one block longer and its last block is given back
        (single_type_kv_cache_manager.py:956-1062)."""
        need = cdiv(spec.sliding_window - 1, block_size) + drop_eagle_block
        n = max_length // block_size
        null = block_pool.null_block
        out = [[null] * n for _ in group_ids]
        get = block_pool.get_cached_block
        run = 0
        for i in range(n - 1, -1, -1):
            cached = get(block_hashes[i], group_ids)
            if cached is None:
                run = 0
                continue
            for blocks, b in zip(out, cached):
                blocks[i] = b
            run += 1
            if run >= need:
                for blocks in out:
                    del blocks[i + run:]
                break
        else:
            for blocks in out:
                del blocks[run:]
        if drop_eagle_block and out[0]:
            for blocks in out:
                blocks.pop()
        return out

    def _cache_range(self, request: Request, start: int, end: int) -> None:
        """Sparse retention: hash only the blocks a later lookup can reach (the window tail before
        a reachable boundary); the others are counted as cached but never hashed."""
        interval = self.retention_interval
        if interval is None or (interval and self.contiguous_blocks + self.use_eagle >= interval // self.block_size):
            # dense, or a run a hit needs spans a whole retention interval: every block is reachable
            # (single_type_kv_cache_manager.py:1114-1118)
            super()._cache_range(request, start, end)
            return
        if not interval and not self.use_eagle and start >= self._last_boundary(request):
            return  # (speed: a decode's block past every boundary - each range below ends at one - hashes nothing)
        for lo, hi in self._reachable_ranges(request, end):
            lo, hi = max(lo, start), min(hi, end)
            if lo < hi:
                super()._cache_range(request, lo, hi)

    def _reachable_ranges(self, request: Request, end: int) -> list[tuple[int, int]]:
        """Block index ranges [lo, hi) that end at a boundary a hit can stop at: the prompt's
        replay boundary, the request's shared-prefix boundary and every retention interval."""
        bs = self.block_size
        if self.use_eagle:
            return self._eagle_reachable_ranges(request, end)
        boundaries = {(request.num_prompt_tokens - 1) // bs}
        shared = request.shared_prefix_boundary
        if shared:
            boundaries.add(shared // bs)
        k = self.contiguous_blocks
        if self.retention_interval:
            # every segment's tail, also of the segment `end` is still inside (vLLM 0.33
            # v1/core/single_type_kv_cache_manager.py:1115-1122 masks block i by i % per_segment alone)
            step = self.retention_interval // bs
            boundaries.update(range(step, end + k + 1, step))
        return sorted((max(0, b - k), b) for b in boundaries if b > 0)

    def _last_boundary(self, request: Request) -> int:
        """The highest block index `_reachable_ranges` ends a range at, without retention intervals."""
        shared = request.shared_prefix_boundary
        last = (request.num_prompt_tokens - 1) // self.block_size
        return max(last, shared // self.block_size) if shared else last

    def _eagle_reachable_ranges(self, request: Request, end: int) -> list[tuple[int, int]]:
        """EAGLE's hits peek one block past a boundary: each kept run is one block longer and ends
        one block later; a resend resumes a block lower (kv_cache_coordinator.py:65-86,
        single_type_kv_cache_manager.py:510-520, :1093-1145)."""
        bs, p = self.block_size, request.num_prompt_tokens
        boundaries = {max((p - 1) // bs - 1, 0), max(p // bs - 1, 0)}
        shared = request.shared_prefix_boundary
        if shared:
            boundaries.update((shared // bs, max(shared // bs - 1, 0)))
        if self.retention_interval:
            step = self.retention_interval // bs
            boundaries.update(range(step, end + 1, step))
        k = self.contiguous_blocks + 1
        return sorted((max(0, b + 1 - k), b + 1) for b in boundaries)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    def __init__(self, spec: ChunkedLocalAttentionSpec, block_pool: BlockPool, block_size: int,
                 kv_cache_group_id: int, enable_caching: bool,
                 max_admission_blocks_per_request: Optional[int] = None) -> None:
        super().__init__(spec, block_pool, block_size, kv_cache_group_id, enable_caching,
                         max_admission_blocks_per_request)
        self.attention_chunk_size = spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    @staticmethod
    def find_longest_cache_hit(block_hashes: list[bytes], max_length: int, group_ids: list[int],
                               block_pool: BlockPool, spec: ChunkedLocalAttentionSpec, block_size: int,
                               drop_eagle_block: bool = False) -> list[list[KVCacheBlock]]:
        """Blocks before the current chunk count as hits (null, never read); from there on the
        cached blocks must be consecutive."""
        n = max_length // block_size
        start = max_length // spec.attention_chunk_size * spec.attention_chunk_size // block_size
        null = block_pool.null_block
        out = [[null] * start for _ in group_ids]
        get = block_pool.get_cached_block
        for i in range(start, n):
            cached = get(block_hashes[i], group_ids)
            if cached is None:
                break
            for blocks, b in zip(out, cached):
                blocks.append(b)
        return out


MANAGER_FOR_SPEC = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
}
