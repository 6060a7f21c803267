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
