"""`KVCacheManager.allocate_running_slots` (a running request's slots without checks; the coordinator's
group loops inlined) has the effects of `allocate_slots` for the same request: the same blocks in every
group, the same free queue, prefix cache and shared count, over random group mixes with prefix hits."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from servetwin.core.kv_cache.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from servetwin.core.kv_cache.kv_cache_manager import KVCacheManager
from servetwin.core.request import RequestStatus

from coretest_utils import make_request

GROUPS = st.lists(st.one_of(st.just(FullAttentionSpec()), st.builds(SlidingWindowSpec, st.integers(2, 20)),
                            st.builds(ChunkedLocalAttentionSpec, st.integers(2, 20))), min_size=1, max_size=3)


def _state(kv: KVCacheManager, rids: list[str]) -> tuple:
    pool = kv.block_pool
    return ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()], pool.num_shared_refs,
            sorted((b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks),
            [kv.get_block_ids(rid) for rid in rids], [kv.num_blocks_per_group(rid) for rid in rids])


@settings(max_examples=150, deadline=None)
@given(groups=GROUPS, block_size=st.sampled_from([1, 2, 4]), retention=st.sampled_from([0, None]),
       prompts=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=14), min_size=1, max_size=4),
       decodes=st.lists(st.integers(0, 3), max_size=40))
def test_allocate_running_slots_equals_allocate_slots(groups, block_size, retention, prompts, decodes):
    groups = tuple(g for g in groups if not isinstance(g, ChunkedLocalAttentionSpec)) \
        if any(isinstance(g, SlidingWindowSpec) for g in groups) else tuple(groups)  # (never both kinds)
    managers = [KVCacheManager(200, block_size, 64, kv_cache_groups=groups or None,
                               prefix_cache_retention_interval=retention) for _ in range(2)]
    requests: list[list] = [[], []]
    for i, prompt in enumerate(prompts):  # admitted one after the other; later prompts can hit earlier ones
        for kv, reqs in zip(managers, requests):
            r = make_request(str(i), list(prompt), block_size=block_size)
            hits, num_hit = kv.get_computed_blocks(r)
            assert kv.allocate_slots(r, r.num_tokens - num_hit, num_hit, hits) is not None
            r.num_computed_tokens = r.num_tokens
            r.status = RequestStatus.RUNNING
            r.append_output_token_ids(7)
            reqs.append(r)
    rids = [str(i) for i in range(len(prompts))]
    for pick in decodes:  # one decode step of one request: its slot for the token it feeds in
        for k, (kv, reqs) in enumerate(zip(managers, requests)):
            r = reqs[pick % len(reqs)]
            if r.num_tokens >= 60:
                continue
            if k == 0:
                kv.allocate_running_slots(r, 1)
            else:
                assert kv.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
            r.append_output_token_ids(pick)
        assert _state(managers[0], rids) == _state(managers[1], rids)


@settings(max_examples=300, deadline=None)
@given(window=st.integers(2, 20), block_size=st.sampled_from([1, 2, 4]), prompt_len=st.integers(1, 30),
       num_output=st.integers(0, 30), shared=st.one_of(st.none(), st.integers(0, 40)),
       start_frac=st.floats(0, 1))
def test_sliding_window_registration_without_retention_reaches_only_boundaries(
        window, block_size, prompt_len, num_output, shared, start_frac):
    """Sparse registration (retention interval 0), whose decode blocks past every boundary return at once,
    hashes exactly the blocks of `_reachable_ranges` (the general rule) in the range registered."""
    kv = KVCacheManager(200, block_size, 128, kv_cache_groups=(SlidingWindowSpec(window),),
                        prefix_cache_retention_interval=0)
    manager = kv.coordinator.single_type_managers[0]
    r = make_request("r", list(range(prompt_len)), block_size=block_size)
    r.append_output_token_ids(list(range(100, 100 + num_output)))
    r.shared_prefix_boundary = shared
    full = len(r.block_hashes)
    start = int(start_frac * full)
    blocks = kv.block_pool.get_new_blocks(full)
    manager.req_to_blocks["r"], manager.num_cached_block["r"] = blocks, start
    manager.cache_blocks(r, full * block_size)
    expected = {i for lo, hi in manager._reachable_ranges(r, full) for i in range(max(lo, start), min(hi, full))}
    assert {i for i, b in enumerate(blocks) if b.block_hash is not None} == expected
    assert manager.num_cached_block["r"] == full
