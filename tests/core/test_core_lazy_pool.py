"""The block pool materialises never-used blocks lazily; it must behave exactly like an eager queue."""
from hypothesis import given, settings, strategies as st

from servetwin.core.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20), ops=st.lists(st.tuples(st.sampled_from(["pop", "popn", "append", "prepend",
                                                                    "remove"]), st.integers(0, 5)),
                                          max_size=40))
def test_lazy_queue_equals_eager_queue(n, ops):
    eager_blocks = [KVCacheBlock(i) for i in range(n)]
    eager = FreeKVCacheBlockQueue(eager_blocks)
    made: dict[int, KVCacheBlock] = {}
    lazy = FreeKVCacheBlockQueue([], range(n), lambda i: made.setdefault(i, KVCacheBlock(i)))
    held_e, held_l = [], []  # blocks taken out, same order in both
    for op, k in ops:
        if op == "pop" and eager.num_free_blocks:
            held_e.append(eager.popleft())
            held_l.append(lazy.popleft())
        elif op == "popn" and k <= eager.num_free_blocks:
            held_e += eager.popleft_n(k)
            held_l += lazy.popleft_n(k)
        elif op in ("append", "prepend") and held_e:
            i = k % len(held_e)
            be, bl = held_e.pop(i), held_l.pop(i)
            (eager.append if op == "append" else lambda b, q=eager: q.prepend_n([b]))(be)
            (lazy.append if op == "append" else lambda b, q=lazy: q.prepend_n([b]))(bl)
        elif op == "remove" and eager.num_free_blocks and k < len(made):
            ids_e = [b.block_id for b in eager.get_all_free_blocks()]
            target = sorted(made)[k]
            if target in ids_e:  # only a materialised, free block can be removed
                eager.remove(eager_blocks[target])
                lazy.remove(made[target])
                held_e.append(eager_blocks[target])
                held_l.append(made[target])
        assert eager.num_free_blocks == lazy.num_free_blocks
        assert [b.block_id for b in held_e] == [b.block_id for b in held_l]
    assert [b.block_id for b in eager.get_all_free_blocks()] == [b.block_id for b in lazy.get_all_free_blocks()]


def test_a_huge_pool_is_cheap_until_used():
    pool = BlockPool(10_000_000, enable_caching=True)
    assert len(pool._blocks) == 1  # only the null block exists
    assert pool.get_num_free_blocks() == 10_000_000 - 1
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    pool.free_blocks(reversed(blocks))
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]  # freed un-hashed blocks come back first
    assert len(pool._blocks) == 4
