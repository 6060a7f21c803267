"""Input preparation: flattened ids, positions, query_start_loc, seq_lens, block table, slots."""
from __future__ import annotations

import numpy as np
import pytest

from servetwin.core.engine.runner_state import CachedRequestState, ScheduledRow
from servetwin.gpu.input_batch import build_block_table, prepare_inputs

B = 4
PAD = 99


def row(req_id, tokens, num_prompt, blocks, computed, scheduled):
    st = CachedRequestState(req_id, list(tokens), num_prompt, (list(blocks),), None, computed + scheduled)
    return ScheduledRow(req_id, st, computed, scheduled)


def test_mixed_batch():
    rows = [
        row("dec", range(100, 110), 6, [7, 3, 8], 9, 1),  # decode: 9 computed, last token at pos 9
        row("chunk", range(200, 213), 13, [5, 6, 1, 2], 4, 6),  # prefill chunk after 4 (prefix hit)
        row("new", range(300, 303), 3, [11], 0, 3),  # whole prompt
    ]
    b = prepare_inputs(rows, B, PAD)
    assert b.input_ids.tolist() == [109, *range(204, 210), 300, 301, 302]
    assert b.positions.tolist() == [9, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    assert b.query_start_loc.tolist() == [0, 1, 7, 10]
    assert b.seq_lens.tolist() == [10, 10, 3]
    assert b.logits_indices.tolist() == [0, 6, 9]
    # width = max blocks needed (3); rows padded with the pad block, extra allocated blocks not copied
    assert b.block_table.tolist() == [[7, 3, 8], [5, 6, 1], [11, PAD, PAD]]
    assert b.slot_mapping.tolist() == [8 * B + 1, 6 * B + 0, 6 * B + 1, 6 * B + 2, 6 * B + 3, 1 * B + 0,
                                       1 * B + 1, 11 * B, 11 * B + 1, 11 * B + 2]
    assert b.max_query_len == 6 and b.max_seq_len == 10 and not b.is_decode_only
    assert [r.samples for r in rows] == [True, False, True]


def test_decode_only_and_block_boundary():
    rows = [row("a", range(8), 5, [2, 4], 7, 1), row("b", range(5), 4, [9, 1], 4, 1)]
    b = prepare_inputs(rows, B, PAD)
    assert b.is_decode_only
    assert b.slot_mapping.tolist() == [4 * B + 3, 1 * B + 0]  # pos 7 -> block 1 off 3; pos 4 -> block 1 off 0


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="needs 2 blocks"):
        prepare_inputs([row("a", range(6), 6, [3], 0, 6)], B, PAD)


def test_scheduling_unknown_tokens_is_an_error():
    with pytest.raises(ValueError, match="only 4 are known"):
        prepare_inputs([row("a", range(4), 4, [3, 4], 3, 2)], B, PAD)


def test_build_block_table_fixed_width():
    t = build_block_table([[1, 2], [3]], np.array([2, 1]), PAD, width=4)
    assert t.tolist() == [[1, 2, PAD, PAD], [3, PAD, PAD, PAD]] and t.dtype == np.int32


def test_one_block_table_and_slot_mapping_per_kv_cache_group():
    """Two KV groups (full, sliding window): each has its own table and slots; the window group's
    table may hold the null block 0 for blocks the scheduler freed."""
    import torch

    from servetwin.core.engine.runner_state import RunnerState
    from servetwin.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from servetwin.core.kv_cache.kv_sizing import KVCacheSpec
    from servetwin.gpu.kv_cache import allocate_kv_caches

    state = RunnerState()
    so = SchedulerOutput([NewRequestData("a", list(range(9)), None, ([1, 2, 3], [0, 5, 6]), 4)],
                         CachedRequestData(), {"a": 5}, 5, set(), set())
    rows = state.update(so)
    b = prepare_inputs(rows, B, PAD)
    assert [t.tolist() for t in b.block_tables] == [[[1, 2, 3]], [[0, 5, 6]]]
    assert b.slot_mappings[0].tolist() == [2 * B, 2 * B + 1, 2 * B + 2, 2 * B + 3, 3 * B]
    assert b.slot_mappings[1].tolist() == [5 * B, 5 * B + 1, 5 * B + 2, 5 * B + 3, 6 * B]
    assert b.block_table is b.block_tables[0] and b.slot_mapping is b.slot_mappings[0]
    # the next step appends each group's new blocks to that group's table
    so2 = SchedulerOutput([], CachedRequestData(["a"], [([4], [7])], [9], [0]), {"a": 4}, 4, set(), set())
    assert [list(g) for g in state.update(so2)[0].state.block_ids] == [[1, 2, 3, 4], [0, 5, 6, 7]]
    # the j-th layer of each group shares one KV tensor (layer plans per group: test_kv_group_tables.py)
    spec = KVCacheSpec(num_layers=4, num_kv_heads=1, head_size=2, dtype="float32", block_size=B)
    caches = allocate_kv_caches(spec, 8, torch.float32, torch.device("cpu"), layer_to_group=(1, 0, 1, 0))
    assert caches[0][0] is caches[1][0] and caches[2][0] is caches[3][0] and caches[0][0] is not caches[2][0]
    assert len({id(k) for k, _ in allocate_kv_caches(spec, 8, torch.float32, torch.device("cpu"))}) == 4
