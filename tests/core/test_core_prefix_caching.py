"""KVCacheManager + prefix caching, driven directly (docs/scheduler_behaviour.md §4.4-4.11; vLLM test equivalents, §7)."""
from __future__ import annotations

import pytest

from servetwin.core.kv_cache.hashing import hash_block_tokens, sha256
from servetwin.core.kv_cache.kv_cache_manager import KVCacheManager
from servetwin.core.request import RequestStatus

from coretest_utils import GID, check_block_accounting, free_queue_ids, make_request


def make_kv(num_blocks: int, block_size: int = 16, caching: bool = True, max_model_len: int = 8192,
            log_stats: bool = True) -> KVCacheManager:
    return KVCacheManager(num_gpu_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                          enable_caching=caching, log_stats=log_stats)


def admit(kv: KVCacheManager, req, num_tokens=None):
    """Look up, allocate (prompt), set C as the scheduler would. Returns (hit_blocks, hit_len, new)."""
    hits, hit_len = kv.get_computed_blocks(req)
    n = (req.num_tokens if num_tokens is None else num_tokens) - hit_len
    new = kv.allocate_slots(req, n, hit_len, hits)
    if new is not None:
        req.num_computed_tokens = hit_len + n
        req.status = RequestStatus.RUNNING
    return hits[0], hit_len, None if new is None else new[0]  # the one group's blocks


def ids(blocks):
    return [b.block_id for b in blocks]


def test_prefill_worked_example():
    kv = make_kv(11)
    common = list(range(48))  # 3 full blocks
    req0 = make_request("0", common + [100 + i for i in range(7)], block_size=16)
    hits, hit_len, new = admit(kv, req0)
    assert hits == [] and hit_len == 0
    assert ids(new) == [1, 2, 3, 4]
    assert kv.get_block_ids("0")[0] == [1, 2, 3, 4]
    # hash chain of the full blocks, group id 0
    parent = None
    for i in range(3):
        parent = hash_block_tokens(sha256, parent, common[i * 16:(i + 1) * 16])
        assert req0.block_hashes[i] == parent
        assert kv.block_pool.blocks[i + 1].block_hash == parent + GID
    assert kv.block_pool.blocks[4].block_hash is None  # partial block
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(1, 5)] == [1, 1, 1, 1]

    req1 = make_request("1", common + [200 + i for i in range(5)], block_size=16)
    hits, hit_len, new = admit(kv, req1)
    assert ids(hits) == [1, 2, 3] and hit_len == 48
    assert ids(new) == [5]
    assert kv.get_block_ids("1")[0] == [1, 2, 3, 5]
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(1, 6)] == [2, 2, 2, 1, 1]
    assert kv.block_pool.num_shared_refs == 3  # three blocks, one extra holder each
    check_block_accounting(kv)

    kv.free(req0)
    kv.free(req1)
    assert free_queue_ids(kv) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    check_block_accounting(kv)

    # freed cached blocks still hit (lazy eviction)
    req2 = make_request("2", common + [300 + i for i in range(7)], block_size=16)
    (hits,), hit_len = kv.get_computed_blocks(req2)
    assert ids(hits) == [1, 2, 3] and hit_len == 48

    # a 10-block miss receives exactly the free-queue order, evicting the cached blocks
    req3 = make_request("3", [9999] * (16 * 10 - 1), block_size=16)
    hits, hit_len, new = admit(kv, req3)
    assert hit_len == 0
    assert ids(new) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert kv.num_free_blocks == 0
    assert kv.get_computed_blocks(req2) == (([],), 0)
    check_block_accounting(kv)


def test_prefill_plp_never_reads_but_writes_cache():
    kv = make_kv(11)
    common = list(range(48))
    plp = make_request("plp", common + [1, 2, 3], block_size=16, prompt_logprobs=5)
    assert plp.skip_reading_prefix_cache
    hits, hit_len, new = admit(kv, plp)
    assert ids(new) == [1, 2, 3, 4]
    # its blocks are cached for other requests
    other = make_request("o", common + [7, 7], block_size=16)
    hits, hit_len, _ = admit(kv, other)
    assert ids(hits) == [1, 2, 3] and hit_len == 48
    # but a second prompt-logprobs request gets no hit even though the blocks are there
    plp2 = make_request("plp2", common + [9], block_size=16, prompt_logprobs=1)
    assert kv.get_computed_blocks(plp2) == (([],), 0)
    kv.record_prefix_cache_stats(plp2, 0)
    stats = kv.make_prefix_cache_stats()
    assert stats.requests == 0 and stats.queries == 0


def test_decode_fills_partial_block_then_appends_new():
    kv = make_kv(11)
    req = make_request("0", list(range(55)), max_tokens=100, block_size=16)
    admit(kv, req)
    assert kv.get_block_ids("0")[0] == [1, 2, 3, 4]
    for t in range(9):  # tokens 55..63 fill block 4
        req.append_output_token_ids(1000 + t)
        (new,) = kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert new == []
        if req.num_computed_tokens < 64:
            assert kv.block_pool.blocks[4].block_hash is None
    assert req.num_computed_tokens == 64
    assert kv.block_pool.blocks[4].block_hash == req.block_hashes[3] + GID
    assert kv.num_cached_block["0"] == 4
    req.append_output_token_ids(2000)
    (new,) = kv.allocate_slots(req, 1)
    assert ids(new) == [5] and new[0].block_hash is None
    assert kv.get_block_ids("0")[0] == [1, 2, 3, 4, 5]
    check_block_accounting(kv)


def test_evict_order_and_reuse():
    kv = make_kv(11)
    p0 = list(range(5 * 16 + 7))
    req0 = make_request("0", p0, block_size=16)
    admit(kv, req0)
    assert kv.get_block_ids("0")[0] == [1, 2, 3, 4, 5, 6]
    req1 = make_request("1", [500 + i for i in range(48)], block_size=16)
    admit(kv, req1)
    assert kv.get_block_ids("1")[0] == [7, 8, 9]
    assert kv.num_free_blocks == 1
    kv.free(req0)
    assert free_queue_ids(kv) == [6, 10, 5, 4, 3, 2, 1]
    kv.free(req1)
    assert free_queue_ids(kv) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    req2 = make_request("2", p0[:32] + [777, 778, 779], block_size=16)
    hits, hit_len, new = admit(kv, req2)
    assert ids(hits) == [1, 2] and hit_len == 32
    assert ids(new) == [6]
    assert kv.get_block_ids("2")[0] == [1, 2, 6]
    assert free_queue_ids(kv) == [10, 5, 4, 3, 9, 8, 7]
    check_block_accounting(kv)


def test_hash_block_correct_reuse():
    kv = make_kv(2)  # one usable block
    req0 = make_request("0", list(range(16)), block_size=16)
    admit(kv, req0)
    blk = kv.req_to_blocks["0"][0]
    assert blk.block_hash == req0.block_hashes[0] + GID
    kv.free(req0)
    assert blk.block_hash is not None  # lazily kept
    req1 = make_request("1", list(range(7)), block_size=16)
    hits, hit_len, new = admit(kv, req1)
    assert hit_len == 0 and new == [blk]
    assert blk.block_hash is None  # recycled: old hash dropped
    assert kv.block_pool.cached_block_hash_to_block.get_one_block(req0.block_hashes[0] + GID) is None
    check_block_accounting(kv)


def test_computed_blocks_not_evicted():
    kv = make_kv(3)  # 2 usable
    req0 = make_request("0", list(range(16)), block_size=16)
    admit(kv, req0)
    req1 = make_request("1", list(range(100, 116)), block_size=16)
    admit(kv, req1)
    assert kv.get_block_ids("0")[0] == [1] and kv.get_block_ids("1")[0] == [2]
    kv.free(req0)
    kv.free(req1)
    assert free_queue_ids(kv) == [1, 2]
    req2 = make_request("2", list(range(16)) + list(range(200, 216)), block_size=16)
    hits, hit_len, new = admit(kv, req2)
    assert ids(hits) == [1] and hit_len == 16
    # the hit is touched before new blocks are taken: block 2 (other content) is evicted instead
    assert ids(new) == [2]
    assert kv.get_block_ids("2")[0] == [1, 2]
    assert kv.block_pool.blocks[1].block_hash == req0.block_hashes[0] + GID
    check_block_accounting(kv)


def test_basic_prefix_caching_disabled():
    kv = make_kv(5, block_size=4, caching=False)  # 4 usable
    req1 = make_request("1", list(range(10)), block_size=None)
    admit(kv, req1)
    assert kv.get_block_ids("1")[0] == [1, 2, 3]
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    kv.free(req1)
    req2 = make_request("2", list(range(10)))
    hits, hit_len, new = admit(kv, req2)
    assert hits == [] and hit_len == 0  # no hits with caching off
    assert ids(new) == [3, 2, 1]  # freed blocks reused from the head (tail block first)
    req3 = make_request("3", list(range(5)))
    assert kv.allocate_slots(req3, 5) is None  # needs 2 blocks, 1 free
    assert "3" not in kv.req_to_blocks or kv.req_to_blocks["3"] == []
    req4 = make_request("4", list(range(4)))
    assert ids(kv.allocate_slots(req4, 4)[0]) == [4]
    assert kv.allocate_slots(make_request("5", [1]), 1) is None
    assert kv.num_free_blocks == 0


def test_cache_blocks_registers_range_and_updates_num_cached():
    kv = make_kv(10, block_size=4)
    req = make_request("r", list(range(14)), block_size=4)
    kv.allocate_slots(req, 14)  # caches the 3 full blocks
    assert kv.num_cached_block["r"] == 3
    blocks = kv.req_to_blocks["r"]
    for i in range(3):
        assert blocks[i].block_hash == req.block_hashes[i] + GID
    assert blocks[3].block_hash is None
    # caching fewer tokens than already cached is a no-op
    kv.cache_blocks(req, 8)
    assert kv.num_cached_block["r"] == 3
    # tokens beyond the known hashes are never cached
    kv.cache_blocks(req, 100)
    assert kv.num_cached_block["r"] == 3 and blocks[3].block_hash is None


def test_cache_key_salting():
    kv = make_kv(20)
    prompt = list(range(40))
    salted = make_request("s", prompt, cache_salt="pepper", block_size=16)
    admit(kv, salted)
    assert kv.get_computed_blocks(make_request("u", prompt, block_size=16)) == (([],), 0)
    assert kv.get_computed_blocks(make_request("d", prompt, cache_salt="salt", block_size=16)) == (([],), 0)
    (hits,), hit_len = kv.get_computed_blocks(make_request("same", prompt, cache_salt="pepper", block_size=16))
    assert hit_len == 32 and ids(hits) == kv.get_block_ids("s")[0][:2]
    unsalted = make_request("u2", prompt, block_size=16)
    admit(kv, unsalted)
    assert set(kv.get_block_ids("u2")[0]).isdisjoint(kv.get_block_ids("s")[0])


def test_prefill_not_enough_free_blocks_with_computed_blocks():
    kv = make_kv(11)  # 10 usable
    prefix = list(range(96))
    req0 = make_request("0", prefix[:48], block_size=16)
    admit(kv, req0)  # 3 blocks, ref 1
    req1 = make_request("1", prefix, block_size=16)
    hits, hit_len, new = admit(kv, req1)
    assert hit_len == 48 and len(new) == 3
    req2 = make_request("2", [5000 + i for i in range(32)], block_size=16)
    admit(kv, req2)  # holds 2 more blocks
    kv.free(req1)  # its own 3 blocks: ref 0, cached; req0's: ref 1
    assert kv.num_free_blocks == 5
    req3 = make_request("3", prefix + [7000 + i for i in range(48)], block_size=16)  # 144 tokens, 9 blocks
    (hits,), hit_len = kv.get_computed_blocks(req3)
    assert len(hits) == 6 and hit_len == 96
    assert sorted(b.ref_cnt for b in hits) == [0, 0, 0, 1, 1, 1]
    before_refs = [b.ref_cnt for b in kv.block_pool.blocks]
    before_queue = free_queue_ids(kv)
    # demand: 3 new + 3 evictable hits = 6 > 5 free
    assert kv.allocate_slots(req3, 48, 96, (hits,)) is None
    assert [b.ref_cnt for b in kv.block_pool.blocks] == before_refs
    assert free_queue_ids(kv) == before_queue
    assert not kv.req_to_blocks.get("3")
    assert "3" not in kv.num_cached_block
    check_block_accounting(kv)
    # after freeing one more holder it fits
    kv.free(req2)
    assert kv.allocate_slots(req3, 48, 96, (hits,)) is not None
    assert len(kv.get_block_ids("3")[0]) == 9
    check_block_accounting(kv)


def test_num_blocks_to_allocate_counts_evictable_hits_once():
    kv = make_kv(30)
    req0 = make_request("0", list(range(160)), block_size=16)  # 10 full blocks
    admit(kv, req0)
    kv.free(req0)
    req = make_request("1", list(range(160)) + [1] * 160, block_size=16)  # 20 blocks
    (hits,), hit_len = kv.get_computed_blocks(req)
    assert len(hits) == 10
    # 10 new + 10 evictable hits (they leave the free queue when touched)
    assert kv.coordinator.get_num_blocks_to_allocate("1", 320, (hits,), 160) == 20
    before = kv.num_free_blocks
    (new,) = kv.allocate_slots(req, 160, 160, (hits,))
    assert len(new) == 10  # only the truly new blocks are physically allocated
    assert kv.num_free_blocks == before - 20
    check_block_accounting(kv)


def test_max_hit_is_n_minus_1_and_block_aligned():
    kv = make_kv(20)
    prompt = list(range(33))
    admit(kv, make_request("a", prompt, block_size=16))
    # a 33-token prompt fully cached: hit 32, compute 1
    assert kv.get_computed_blocks(make_request("b", prompt, block_size=16))[1] == 32
    # a block-aligned 32-token prompt hits only 16: its whole last block is recomputed
    b32 = make_request("c", prompt[:32], block_size=16)
    hits, hit_len, new = admit(kv, b32)
    assert hit_len == 16 and len(new) == 1
    # the recomputed block is a new physical block; its key now maps to two blocks, first one wins
    key = b32.block_hashes[1] + GID
    entry = kv.block_pool.cached_block_hash_to_block._cache[key]
    assert isinstance(entry, dict) and list(entry) == [kv.get_block_ids("a")[0][1], new[0].block_id]
    assert kv.get_computed_blocks(make_request("d", prompt, block_size=16))[0][0][1].block_id == \
        kv.get_block_ids("a")[0][1]
    # one-token prompt: nothing can hit
    assert kv.get_computed_blocks(make_request("e", prompt[:1], block_size=16)) == (([],), 0)


def test_hits_stop_at_first_miss():
    kv = make_kv(20, block_size=4)
    a = make_request("a", list(range(12)) + [0], block_size=4)
    admit(kv, a)
    kv.free(a)
    # evict the middle block of the chain by handing it out
    pool = kv.block_pool
    middle = kv.block_pool.blocks[2]
    assert middle.block_hash == a.block_hashes[1] + GID
    pool._maybe_evict_cached_block(middle)
    (hits,), hit_len = kv.get_computed_blocks(make_request("b", list(range(12)) + [5], block_size=4))
    assert ids(hits) == [1] and hit_len == 4


def test_reset_prefix_cache():
    kv = make_kv(11)
    req = make_request("0", list(range(40)), block_size=16)
    admit(kv, req)
    assert kv.reset_prefix_cache() is False
    kv.free(req)
    stats = kv.make_prefix_cache_stats()
    assert stats.reset is False
    assert kv.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert len(kv.block_pool.cached_block_hash_to_block) == 0
    assert kv.get_computed_blocks(make_request("1", list(range(40)), block_size=16)) == (([],), 0)
    assert kv.make_prefix_cache_stats().reset is True


def test_prefix_cache_stats_disabled_without_log_stats():
    kv = make_kv(11, log_stats=False)
    assert kv.prefix_cache_stats is None
    assert kv.make_prefix_cache_stats() is None
    kv.record_prefix_cache_stats(make_request("x", [1, 2, 3], block_size=16), 0)  # no crash


def test_prefix_cache_stats_record_and_split_preempted():
    kv = make_kv(11)
    r = make_request("x", list(range(20)), block_size=16)
    kv.record_prefix_cache_stats(r, 16)
    r.num_preemptions = 1
    kv.record_prefix_cache_stats(r, 0)
    s = kv.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 20, 16)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 20, 0)
    s2 = kv.make_prefix_cache_stats()  # the accumulator was swapped for a fresh one
    assert (s2.requests, s2.queries, s2.hits, s2.preempted_requests) == (0, 0, 0, 0)


def test_allocate_zero_tokens_without_hits_raises():
    kv = make_kv(5)
    with pytest.raises(ValueError):
        kv.allocate_slots(make_request("x", [1, 2], block_size=16), 0)


def test_full_sequence_gate_checks_whole_known_sequence():
    kv = make_kv(5, block_size=4)  # 4 usable blocks
    req = make_request("big", list(range(20)), block_size=4)  # 5 blocks > pool
    # the first chunk alone would fit ...
    assert kv.coordinator.get_num_blocks_to_allocate("big", 8, ([],), 0) == 2
    # ... but the full-sequence admission gate refuses, with no side effect
    assert kv.allocate_slots(req, 8, full_sequence_must_fit=True) is None
    assert kv.num_free_blocks == 4 and not kv.req_to_blocks.get("big")
    # without the gate the chunk is admitted
    assert len(kv.allocate_slots(req, 8)[0]) == 2


def test_allocation_capped_at_max_model_len():
    kv = make_kv(20, block_size=4, max_model_len=10)
    req = make_request("r", list(range(9)), block_size=4)
    (new,) = kv.allocate_slots(req, 9, num_lookahead_tokens=8)
    assert len(new) == 3  # cdiv(min(9 + 8, 10), 4)


def test_allocate_with_lookahead():
    kv = make_kv(20, block_size=4)
    req = make_request("r", list(range(5)), block_size=4)
    assert len(kv.allocate_slots(req, 5, num_lookahead_tokens=4)[0]) == 3  # cdiv(5 + 4, 4)


def test_watermark_applies_to_waiting_requests_when_others_scheduled():
    kv = KVCacheManager(num_gpu_blocks=11, block_size=4, max_model_len=1000, enable_caching=False,
                        watermark=0.2)
    assert kv.watermark_blocks == 2
    req = make_request("r", list(range(32)))  # 8 blocks, 10 free
    assert kv.allocate_slots(req, 32, has_scheduled_reqs=True) is not None
    req2 = make_request("r2", list(range(4)))  # 1 block + 2 watermark > 2 free
    assert kv.allocate_slots(req2, 4, has_scheduled_reqs=True) is None
    assert kv.allocate_slots(req2, 4, has_scheduled_reqs=False) is not None
    # running requests are exempt from the watermark
    req3 = make_request("r3", list(range(4)))
    req3.status = RequestStatus.RUNNING
    assert kv.allocate_slots(req3, 4, has_scheduled_reqs=True) is not None


def test_running_request_cannot_adopt_hits():
    kv = make_kv(20)
    a = make_request("a", list(range(40)), block_size=16)
    admit(kv, a)
    b = make_request("b", list(range(40)), block_size=16)
    admit(kv, b)
    hits, _ = kv.get_computed_blocks(b)  # (per group)
    with pytest.raises(AssertionError):
        kv.allocate_slots(b, 1, 32, hits)


def test_free_is_tail_first_and_usage():
    kv = make_kv(11)
    req = make_request("0", list(range(40)), block_size=16)
    admit(kv, req)
    assert kv.usage == pytest.approx(0.3)
    kv.free(req)
    assert kv.usage == 0.0
    # partial tail block to the head; full blocks appended deepest first
    assert free_queue_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    kv.free(req)  # freeing twice is harmless (nothing tracked)
    check_block_accounting(kv)
