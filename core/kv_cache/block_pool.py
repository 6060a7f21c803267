"""KV blocks, the O(1) free-block queue, the hash->block map and the `BlockPool` (vLLM 0.33 placement)."""
from __future__ import annotations

from typing import Callable, Iterable, Optional

from servetwin.core.kv_cache.hashing import make_block_hash_with_group_id


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None  # hash + group id while registered in the cache
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None
        self.is_null = False

    def reset_hash(self) -> None:
        self.block_hash = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly-linked list threaded through the blocks; head = next to be reused or evicted.

    Blocks never handed out yet can stay virtual: `fresh` is a range of block ids that sits, in id
    order, where a marker node is in the list (vLLM's queue starts as every block in id order, so
    never-used blocks are always one contiguous run). `make_block(id)` materialises one when it
    reaches the head, so a pool of millions of blocks costs nothing until it is used.
    """

    def __init__(self, blocks: list[KVCacheBlock], fresh: range = range(0),
                 make_block: Optional[Callable[[int], KVCacheBlock]] = None) -> None:
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        self._marker = KVCacheBlock(-2)
        self._fresh_next, self._fresh_end = fresh.start, fresh.stop
        self._make_block = make_block
        nodes = list(blocks) + ([self._marker] if len(fresh) else [])
        self.num_free_blocks = len(blocks) + len(fresh)
        prev = self.fake_head
        for b in nodes:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def _take_fresh(self) -> KVCacheBlock:
        block = self._make_block(self._fresh_next)
        self._fresh_next += 1
        if self._fresh_next == self._fresh_end:  # the virtual run is used up: drop its marker
            marker = self._marker
            marker.prev_free_block.next_free_block = marker.next_free_block
            marker.next_free_block.prev_free_block = marker.prev_free_block
            marker.prev_free_block = marker.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft(self) -> KVCacheBlock:
        first = self.fake_head.next_free_block
        if first is self.fake_tail or first is None:
            raise ValueError("No free blocks available")
        if first is self._marker:
            return self._take_fresh()
        nxt = first.next_free_block  # = self._unlink(first), inlined: one pop per block handed out
        self.fake_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} available")
        return [self.popleft() for _ in range(n)]

    def expand_fresh(self) -> None:
        """Materialise every virtual block in place (inspection helpers)."""
        marker = self._marker
        if marker.prev_free_block is None:
            return
        prev, nxt = marker.prev_free_block, marker.next_free_block
        for i in range(self._fresh_next, self._fresh_end):
            b = self._make_block(i)
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        marker.prev_free_block = marker.next_free_block = None
        self._fresh_next = self._fresh_end

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self.fake_tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """`append` each block, in order (linked in one pass: a finished request frees every block)."""
        self._link_between(self.fake_tail.prev_free_block, self.fake_tail, blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Insert at the head keeping list order: the result is `blocks + old queue`."""
        self._link_between(self.fake_head, self.fake_head.next_free_block, blocks)

    def _link_between(self, left: Optional[KVCacheBlock], right: Optional[KVCacheBlock],
                      blocks: list[KVCacheBlock]) -> None:
        """Link `blocks`, in order, between the adjacent `left` and `right`."""
        if not blocks:
            return
        prev = left
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = right
        right.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        self.expand_fresh()
        out: list = []
        cur = self.fake_head.next_free_block
        while cur is not self.fake_tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


class BlockHashToBlockMap:
    """hash-with-group-id -> block, or -> {block_id: block} when the same content sits in several blocks."""

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # hash-with-group-id -> the block a lookup returns: the one block, or the first of several (vLLM's
        # `next(iter(blocks.values()))`). (speed: a prefix hit's walk reads one map, no type test, no
        # iterator per block - ~50 blocks a long prompt, ~90% of them held by several blocks on the gpt-oss
        # ladder; kept by `insert` and `pop`)
        self._first: dict[bytes, KVCacheBlock] = {}

    def get_one_block(self, key: bytes) -> Optional[KVCacheBlock]:
        return self._first.get(key)

    def get_leading_blocks(self, block_hashes: list[bytes], suffix: bytes) -> list[KVCacheBlock]:
        """`get_one_block(h + suffix)` for the hashes in order, up to the first miss (a full-attention
        group's prefix hit; speed: one call for the whole walk, ~50 blocks of a long prompt)."""
        first = self._first
        hits: list[KVCacheBlock] = []
        for h in block_hashes:
            block = first.get(h + suffix)
            if block is None:
                break
            hits.append(block)
        return hits

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        existing = self._cache.get(key)
        if existing is None:
            self._cache[key] = self._first[key] = block
        elif isinstance(existing, KVCacheBlock):
            self._cache[key] = {existing.block_id: existing, block.block_id: block}
            if existing.block_id == block.block_id:  # (a dict keeps the first key's place, takes the last value)
                self._first[key] = block
        else:
            existing[block.block_id] = block
            if self._first[key].block_id == block.block_id:
                self._first[key] = block

    def pop(self, key: bytes, block_id: int) -> Optional[KVCacheBlock]:
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                del self._first[key]
                return blocks
            self._cache[key] = blocks  # not the block asked for: put it back
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
            if block is not None and self._first[key] is block:
                for first in blocks.values():  # the next one inserted
                    self._first[key] = first
                    break
        else:
            del self._first[key]
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()
        self._first.clear()


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks: need at least 2 blocks (one is the null block), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self._blocks: list[KVCacheBlock] = []  # materialised blocks; _blocks[i].block_id == i
        self.free_block_queue = FreeKVCacheBlockQueue([], range(num_gpu_blocks), self._new_block)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # sum over blocks of (ref_cnt - 1) where ref_cnt >= 1: reads of a block beyond its first when
        # every holder reads its blocks (a step's rows sharing prefix blocks; kept for the cost model)
        self.num_shared_refs = 0
        # vLLM's KV cache events (`enable_kv_cache_events`, `kv_event_queue`, vLLM 0.33 v1/core/block_pool.py:194-195):
        # ("stored", key) when a block is cached (:582), ("removed", key) when a cached block's hash is dropped
        # (:658), ("cleared", None) on a prefix-cache reset (:908); a key is the block hash + its group id.
        # None: off (the default: the hot paths only test it).
        self.kv_event_queue: Optional[list[tuple[str, Optional[bytes]]]] = None

    def enable_kv_cache_events(self) -> None:
        if self.kv_event_queue is None:
            self.kv_event_queue = []

    def take_events(self) -> list[tuple[str, Optional[bytes]]]:
        """The events since the last call (vLLM's `take_events`, block_pool.py:934-945); [] when off."""
        events = self.kv_event_queue
        if not events:
            return []
        self.kv_event_queue = []
        return events

    def _new_block(self, block_id: int) -> KVCacheBlock:
        block = KVCacheBlock(block_id)
        self._blocks.append(block)
        return block

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block, by id (materialises the never-used ones; meant for inspection)."""
        self.free_block_queue.expand_fresh()
        return self._blocks

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> Optional[list[KVCacheBlock]]:
        out = []
        for gid in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, gid))
            if block is None:
                return None
            out.append(block)
        return out

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes],
                          num_cached_blocks: int, num_full_blocks: int, kv_cache_group_id: int = 0) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        gid = kv_cache_group_id.to_bytes(4, "big")
        table = self.cached_block_hash_to_block
        events = self.kv_event_queue
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.is_null:
                continue
            if blk.block_hash is not None:
                if table.pop(blk.block_hash, blk.block_id) is not None and events is not None:
                    events.append(("removed", blk.block_hash))
            key = block_hashes[i] + gid
            blk.block_hash = key
            table.insert(key, blk)
            if events is not None:
                events.append(("stored", key))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.free_block_queue.num_free_blocks} free)")
        queue = self.free_block_queue  # (one block: the common case, a decode crossing a boundary)
        blocks = [queue.popleft()] if num_blocks == 1 else queue.popleft_n(num_blocks)
        table = self.cached_block_hash_to_block
        events = self.kv_event_queue
        for b in blocks:
            key = b.block_hash
            if key is not None:  # = self._maybe_evict_cached_block(b), inlined (most reused blocks are hashed)
                if table.pop(key, b.block_id) is not None and events is not None:
                    events.append(("removed", key))
                b.block_hash = None
            b.ref_cnt = 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        key = block.block_hash
        if key is None:
            return False
        if self.cached_block_hash_to_block.pop(key, block.block_id) is not None and self.kv_event_queue is not None:
            self.kv_event_queue.append(("removed", key))
        block.block_hash = None
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (a KV connector reported their KV invalid); a
        held block stays held (vLLM 0.33 block_pool.py `evict_blocks`)."""
        blocks = self.blocks
        for block_id in block_ids:
            self._maybe_evict_cached_block(blocks[block_id])

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        queue = self.free_block_queue
        for b in blocks:
            if b.is_null:
                b.ref_cnt += 1
                continue
            if b.ref_cnt == 0:
                # = queue.remove(b), inlined (speed: an admission touches its ~50 hit blocks, most of
                # them free; the same unlink, check and count)
                prev, nxt = b.prev_free_block, b.next_free_block
                if prev is None or nxt is None:
                    raise RuntimeError(f"remove() called on a block that is not free: {b}")
                prev.next_free_block = nxt
                nxt.prev_free_block = prev
                b.prev_free_block = b.next_free_block = None
                queue.num_free_blocks -= 1
            else:
                self.num_shared_refs += 1
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Un-hashed blocks that reach ref 0 go to the head (reused first), hashed ones to the tail (LRU)."""
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        caching = self.enable_caching
        shared = 0  # (speed: the count and the flag kept local; a finished request frees ~100 blocks)
        for b in ordered_blocks:
            if b.is_null:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt:
                shared += 1
            elif b.block_hash is not None and caching:
                evict_last.append(b)
            else:
                evict_first.append(b)
        self.num_shared_refs -= shared
        queue = self.free_block_queue
        if evict_first:
            queue.prepend_n(evict_first)
        if evict_last:
            queue.append_n(evict_last)

    def reset_prefix_cache(self) -> bool:
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            return False
        self.cached_block_hash_to_block.clear()
        for b in self._blocks:  # never-used blocks have no hash
            b.reset_hash()
        if self.kv_event_queue is not None:
            self.kv_event_queue.append(("cleared", None))
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        if total <= 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / total  # (speed: read every step; no call)
