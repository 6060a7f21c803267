"""KVCacheBlock, the free-block queue, the hash->block map and the BlockPool (docs/scheduler_behaviour.md §1.3-1.7, §4.8-4.11)."""
from __future__ import annotations

import pytest

from servetwin.core.kv_cache.block_pool import (BlockHashToBlockMap, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock)
from servetwin.core.kv_cache.hashing import make_block_hash_with_group_id

from coretest_utils import GID


def _ids(blocks):
    return [b.block_id for b in blocks]


def _queue(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


# -- KVCacheBlock ------------------------------------------------------------------------------

def test_kv_cache_block_defaults_and_hash_reset():
    b = KVCacheBlock(7)
    assert b.block_id == 7 and b.ref_cnt == 0 and b.block_hash is None
    assert b.prev_free_block is None and b.next_free_block is None and not b.is_null
    b.block_hash = b"h" + GID
    b.reset_hash()
    assert b.block_hash is None


def test_kv_cache_block_uses_slots():
    b = KVCacheBlock(0)
    assert not hasattr(b, "__dict__")
    with pytest.raises(AttributeError):
        b.some_new_attribute = 1


# -- FreeKVCacheBlockQueue ---------------------------------------------------------------------

def test_free_queue_initialization_links_in_id_order():
    blocks, q = _queue(4)
    assert q.num_free_blocks == 4
    assert q.fake_head.next_free_block is blocks[0]
    assert blocks[0].prev_free_block is q.fake_head
    for a, b in zip(blocks, blocks[1:]):
        assert a.next_free_block is b and b.prev_free_block is a
    assert blocks[-1].next_free_block is q.fake_tail
    assert q.fake_tail.prev_free_block is blocks[-1]
    assert _ids(q.get_all_free_blocks()) == [0, 1, 2, 3]


def test_free_queue_popleft_remove_append():
    blocks, q = _queue(6)
    first = q.popleft()
    assert first is blocks[0] and q.num_free_blocks == 5
    assert first.prev_free_block is None and first.next_free_block is None
    assert q.fake_head.next_free_block is blocks[1]
    q.remove(blocks[3])  # from the middle
    assert q.num_free_blocks == 4
    assert blocks[2].next_free_block is blocks[4] and blocks[4].prev_free_block is blocks[2]
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    q.append(blocks[3])
    assert _ids(q.get_all_free_blocks()) == [1, 2, 4, 5, 3]
    assert q.fake_tail.prev_free_block is blocks[3] and q.num_free_blocks == 5
    q.remove(blocks[1])  # the head
    q.remove(blocks[3])  # the tail
    assert _ids(q.get_all_free_blocks()) == [2, 4, 5]


def test_free_queue_errors():
    blocks, q = _queue(2)
    q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])  # not linked any more
    q.popleft()
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)


def test_free_queue_append_n_and_prepend_n():
    blocks, q = _queue(3)
    extra = [KVCacheBlock(i) for i in range(10, 14)]
    q.append_n(extra[:2])
    assert _ids(q.get_all_free_blocks()) == [0, 1, 2, 10, 11]
    q.prepend_n(extra[2:])  # result = list + old queue, list order kept
    assert _ids(q.get_all_free_blocks()) == [12, 13, 0, 1, 2, 10, 11]
    assert q.num_free_blocks == 7
    assert q.fake_head.next_free_block is extra[2]
    assert extra[3].next_free_block is blocks[0] and blocks[0].prev_free_block is extra[3]
    q.prepend_n([])
    q.append_n([])
    assert q.num_free_blocks == 7


def test_free_queue_prepend_into_empty_queue():
    blocks, q = _queue(2)
    q.popleft_n(2)
    q.prepend_n(blocks[::-1])
    assert _ids(q.get_all_free_blocks()) == [1, 0]
    assert q.fake_tail.prev_free_block is blocks[0]


def test_free_queue_popleft_n():
    blocks, q = _queue(5)
    got = q.popleft_n(3)
    assert _ids(got) == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    assert q.num_free_blocks == 2
    assert q.fake_head.next_free_block is blocks[3] and blocks[3].prev_free_block is q.fake_head
    assert q.popleft_n(0) == []
    assert _ids(q.get_all_free_blocks()) == [3, 4]
    with pytest.raises(ValueError):
        q.popleft_n(3)


def test_free_queue_popleft_n_drain_and_refill():
    blocks, q = _queue(4)
    assert _ids(q.popleft_n(4)) == [0, 1, 2, 3]
    assert q.num_free_blocks == 0
    assert q.fake_head.next_free_block is q.fake_tail and q.fake_tail.prev_free_block is q.fake_head
    assert q.get_all_free_blocks() == []
    q.append_n([blocks[2], blocks[0]])
    q.append(blocks[3])
    assert _ids(q.get_all_free_blocks()) == [2, 0, 3]
    assert _ids(q.popleft_n(3)) == [2, 0, 3]
    q.append(blocks[1])
    assert q.popleft() is blocks[1]


# -- BlockHashToBlockMap -----------------------------------------------------------------------

def test_block_lookup_cache_single_block_per_key():
    m = BlockHashToBlockMap()
    k1, k2 = b"a" + GID, b"b" + GID
    b1, b2 = KVCacheBlock(1), KVCacheBlock(2)
    m.insert(k1, b1)
    m.insert(k2, b2)
    assert m.get_one_block(k1) is b1 and m.get_one_block(k2) is b2
    assert m.get_one_block(b"zz" + GID) is None
    assert m.pop(k1, 99) is None  # wrong block id: entry kept
    assert m.get_one_block(k1) is b1
    assert m.pop(k1, 1) is b1
    assert m.get_one_block(k1) is None
    assert m.pop(k1, 1) is None
    assert len(m) == 1


def test_block_lookup_cache_multi_blocks_per_key():
    m = BlockHashToBlockMap()
    k = b"same" + GID
    b1, b2, b3 = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    m.insert(k, b1)
    m.insert(k, b2)  # no de-duplication: same content in two physical blocks
    m.insert(k, b3)
    assert m.get_one_block(k) is b1  # first inserted
    assert m.pop(k, 1) is b1
    assert m.get_one_block(k) is b2
    assert m.pop(k, 42) is None
    assert m.pop(k, 3) is b3
    assert m.get_one_block(k) is b2
    assert m.pop(k, 2) is b2
    assert m.get_one_block(k) is None and len(m) == 0


# -- BlockPool ---------------------------------------------------------------------------------

def test_block_pool_null_block_is_block_zero():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4]
    assert _ids(pool.get_new_blocks(2)) == [1, 2]  # a fresh pool hands out 1, 2, 3, ...
    assert pool.get_usage() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_block_pool_free_and_touch_skip_null_block():
    pool = BlockPool(4, enable_caching=True)
    b = pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block, b[0]])
    assert pool.get_num_free_blocks() == 3
    assert pool.null_block not in pool.free_block_queue.get_all_free_blocks()


def test_block_pool_get_new_blocks_sets_ref_and_usage():
    pool = BlockPool(11, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(0.4)
    pool.free_blocks(reversed(blocks))
    assert all(b.ref_cnt == 0 for b in blocks)
    assert pool.get_usage() == 0.0
    # un-hashed blocks go to the head, in the order they were freed
    assert _ids(pool.free_block_queue.get_all_free_blocks())[:4] == [4, 3, 2, 1]


def test_block_pool_free_places_unhashed_at_head_hashed_at_tail():
    pool = BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # ids 1..4
    hashes = [bytes([i]) * 4 for i in range(4)]
    pool.cache_full_blocks(blocks, hashes, 0, 3)  # 1..3 hashed, 4 partial
    pool.free_blocks(reversed(blocks))
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 6, 7, 3, 2, 1]


def test_block_pool_caching_disabled_everything_to_head():
    pool = BlockPool(8, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 4, 5, 6, 7]


def test_block_pool_cache_full_blocks_and_get_cached_block():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = [b"h0", b"h1", b"h2"]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert blocks[0].block_hash == make_block_hash_with_group_id(b"h0", 0)
    assert blocks[1].block_hash == b"h1" + GID
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(b"h0", [0]) == [blocks[0]]
    assert pool.get_cached_block(b"h1", [0]) == [blocks[1]]
    assert pool.get_cached_block(b"h2", [0]) is None
    assert pool.get_cached_block(b"h0", [1]) is None  # other group id: different key
    pool.cache_full_blocks(blocks, hashes, 2, 2)  # nothing to do
    pool.cache_full_blocks(blocks, hashes, 2, 3)
    assert pool.get_cached_block(b"h2", [0]) == [blocks[2]]


def test_block_pool_touch_removes_free_hits_from_queue():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"x", b"y"], 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 5
    pool.touch(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.get_num_free_blocks() == 3
    pool.touch(blocks)  # already referenced: just ref++
    assert [b.ref_cnt for b in blocks] == [2, 2]
    assert pool.get_num_free_blocks() == 3


def test_maybe_evict_cached_block_removes_only_that_block():
    pool = BlockPool(6, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [b"dup"], 0, 1)
    pool.cache_full_blocks([b], [b"dup"], 0, 1)  # same content in a second physical block
    pool.cache_full_blocks([c], [b"other"], 0, 1)
    key = b"dup" + GID
    assert pool.cached_block_hash_to_block.get_one_block(key) is a
    assert pool._maybe_evict_cached_block(a) is True
    assert a.block_hash is None
    assert pool.cached_block_hash_to_block.get_one_block(key) is b
    assert pool.cached_block_hash_to_block.get_one_block(b"other" + GID) is c
    assert pool._maybe_evict_cached_block(a) is False  # no hash any more
    assert pool._maybe_evict_cached_block(b) is True
    assert pool.cached_block_hash_to_block.get_one_block(key) is None


def test_lazy_eviction_hash_survives_free_until_reuse():
    pool = BlockPool(3, enable_caching=True)  # 2 usable blocks
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"A", b"B"], 0, 2)
    pool.free_blocks([b, a])  # queue: [b, a] (both hashed, appended)
    assert pool.get_cached_block(b"A", [0]) == [a]
    assert pool.get_cached_block(b"B", [0]) == [b]
    (got,) = pool.get_new_blocks(1)
    assert got is b and got.block_hash is None and got.ref_cnt == 1
    assert pool.get_cached_block(b"B", [0]) is None
    assert pool.get_cached_block(b"A", [0]) == [a]


def test_block_pool_reset_prefix_cache():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"p", b"q"], 0, 2)
    assert pool.reset_prefix_cache() is False  # blocks still held
    assert pool.get_cached_block(b"p", [0]) == [blocks[0]]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 4


def test_block_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        BlockPool(1, enable_caching=True)


def test_kv_cache_events_are_off_by_default_and_follow_caching_and_eviction():
    pool = BlockPool(4, enable_caching=True)  # 3 usable blocks
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h0", b"h1"], 0, 2)
    assert pool.kv_event_queue is None and pool.take_events() == []  # off: nothing recorded
    pool.enable_kv_cache_events()
    more = pool.get_new_blocks(1)
    pool.cache_full_blocks(more, [b"h2"], 0, 1)
    assert pool.take_events() == [("stored", b"h2" + GID)]
    pool.free_blocks(blocks + more)
    pool.get_new_blocks(2)  # reuses the two least recent hashed blocks: their hashes are dropped
    assert pool.take_events() == [("removed", b"h0" + GID), ("removed", b"h1" + GID)]
    assert pool.take_events() == []
    pool.free_blocks([b for b in pool.blocks if b.ref_cnt and not b.is_null])
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [("cleared", None)]
