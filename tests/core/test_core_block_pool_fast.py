"""`BlockHashToBlockMap.get_leading_blocks` (a full-attention group's prefix walk in one call) equals the walk
of `get_one_block` calls it replaces, blocks sharing a hash included; `BlockPool.touch` / `free_blocks`
(unlink inlined, counts kept local) equal their one-block-at-a-time versions."""
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.kv_cache.block_pool import BlockHashToBlockMap, BlockPool, KVCacheBlock


@settings(max_examples=200, deadline=None)
@given(inserts=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 20)), max_size=20),
       pops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 20)), max_size=8),
       hashes=st.lists(st.integers(0, 5), max_size=8), group=st.integers(0, 3))
def test_leading_blocks_equal_get_one_block_walk(inserts, pops, hashes, group):
    table = BlockHashToBlockMap()
    blocks: dict[int, KVCacheBlock] = {}
    suffix = lambda g: g.to_bytes(4, "big")  # noqa: E731
    for h, g, block_id in inserts:
        table.insert(bytes([h]) + suffix(g), blocks.setdefault(block_id, KVCacheBlock(block_id)))
    for h, g, block_id in pops:
        table.pop(bytes([h]) + suffix(g), block_id)
    keys = [bytes([h]) for h in hashes]
    walk = []
    for k in keys:
        block = table.get_one_block(k + suffix(group))
        if block is None:
            break
        walk.append(block)
    assert table.get_leading_blocks(keys, suffix(group)) == walk


def _touch_one_by_one(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """`BlockPool.touch` as it was before its unlink was inlined: `remove` per free block."""
    for b in blocks:
        if not b.is_null:
            if b.ref_cnt == 0:
                pool.free_block_queue.remove(b)
            else:
                pool.num_shared_refs += 1
        b.ref_cnt += 1


def _free_one_by_one(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """`BlockPool.free_blocks` with every block appended / prepended singly (the queue's order rule)."""
    first, last = [], []
    for b in blocks:
        if b.is_null:
            continue
        b.ref_cnt -= 1
        if b.ref_cnt:
            pool.num_shared_refs -= 1
        elif b.block_hash is not None and pool.enable_caching:
            last.append(b)
        else:
            first.append(b)
    for b in reversed(first):
        pool.free_block_queue.prepend_n([b])
    for b in last:
        pool.free_block_queue.append(b)


def _state(pool: BlockPool) -> tuple:
    return ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()], pool.num_shared_refs,
            pool.get_num_free_blocks(), [(b.ref_cnt, b.block_hash) for b in pool.blocks])


_PICKS = st.lists(st.integers(0, 40), max_size=8)


@settings(max_examples=200, deadline=None)
@given(rounds=st.lists(st.tuples(st.integers(0, 6), _PICKS, _PICKS, _PICKS), min_size=1, max_size=12),
       caching=st.booleans())
def test_touch_and_free_equal_their_one_block_versions(rounds, caching):
    """Rounds of allocations, registrations, frees and hits (touch: a free cached block leaves the queue, a
    held one gains a reference) leave the free queue's order, the ref counts and the shared count as the
    one-block-at-a-time versions do."""
    pools = [BlockPool(24, caching), BlockPool(24, caching)]
    held: list[list[KVCacheBlock]] = [[], []]
    for num_new, to_cache, to_free, to_touch in rounds:
        for k, pool in enumerate(pools):
            mine = held[k]
            mine.extend(pool.get_new_blocks(min(num_new, pool.get_num_free_blocks())))
            for i in to_cache:  # give held blocks a hash, so that their free goes to the tail
                b = mine[i % len(mine)] if mine else pool.null_block
                if not b.is_null and b.block_hash is None:
                    pool.cache_full_blocks([b], [bytes([b.block_id])], 0, 1)
            chosen = [mine.pop(i % len(mine)) for i in to_free if mine]  # held references, in the order picked
            if k == 0:
                pool.free_blocks(chosen)
            else:
                _free_one_by_one(pool, chosen)
            candidates = [b for b in pool.blocks if b.is_null or b.block_hash is not None or b.ref_cnt]
            hits = [candidates[i % len(candidates)] for i in to_touch]  # cached blocks, free or held; null
            if k == 0:
                pool.touch(hits)
            else:
                _touch_one_by_one(pool, hits)
            mine.extend(hits)
        assert _state(pools[0]) == _state(pools[1])


class _ReferenceMap:
    """`BlockHashToBlockMap` as it was before it kept the looked-up block per key (`_first`): the block, or
    the first of the key's {block_id: block} dict, found at every lookup (vLLM's `get_one_block`)."""

    def __init__(self) -> None:
        self._cache: dict = {}

    def get_one_block(self, key):
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key, block) -> None:
        existing = self._cache.get(key)
        if existing is None:
            self._cache[key] = block
        elif isinstance(existing, KVCacheBlock):
            self._cache[key] = {existing.block_id: existing, block.block_id: block}
        else:
            existing[block.block_id] = block

    def pop(self, key, block_id):
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        return block


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 1), st.integers(0, 6),
                              st.booleans()), max_size=40),
       hashes=st.lists(st.integers(0, 4), max_size=6), group=st.integers(0, 1))
def test_kept_first_blocks_equal_the_lookup_of_the_block_dicts(ops, hashes, group):
    """Any interleaving of inserts and pops (a block id inserted again, as the same block or another object
    with that id): every key's `get_one_block`, the prefix walk and the length equal the map that finds the
    first block at each lookup; `pop` returns the same blocks."""
    fast, ref = BlockHashToBlockMap(), _ReferenceMap()
    objects: dict[int, KVCacheBlock] = {}
    for is_insert, h, g, block_id, fresh in ops:
        key = bytes([h]) + g.to_bytes(4, "big")
        if is_insert:
            block = KVCacheBlock(block_id) if fresh else objects.setdefault(block_id, KVCacheBlock(block_id))
            fast.insert(key, block)
            ref.insert(key, block)
        else:
            assert fast.pop(key, block_id) is ref.pop(key, block_id)
        for kh in range(5):
            for kg in range(2):
                k = bytes([kh]) + kg.to_bytes(4, "big")
                assert fast.get_one_block(k) is ref.get_one_block(k)
    keys = [bytes([h]) for h in hashes]
    walk = []
    for k in keys:
        block = ref.get_one_block(k + group.to_bytes(4, "big"))
        if block is None:
            break
        walk.append(block)
    assert fast.get_leading_blocks(keys, group.to_bytes(4, "big")) == walk and len(fast) == len(ref._cache)
    fast.clear()
    assert all(fast.get_one_block(bytes([h]) + g.to_bytes(4, "big")) is None for h in range(5) for g in range(2))
