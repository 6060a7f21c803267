"""`BlockHashToBlockMap.get_leading_blocks` (a full-attention group's prefix walk in one call) equals the walk
of `get_one_block` calls it replaces, blocks sharing a hash included."""
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.kv_cache.block_pool import BlockHashToBlockMap, KVCacheBlock


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
