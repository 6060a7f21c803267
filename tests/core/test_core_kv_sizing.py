"""KV-cache sizing (docs/scheduler_behaviour.md §5) and the iteration annotation (§6.3)."""
from __future__ import annotations

import pytest

from servetwin.core.testbed.iteration import IterationDetails, compute_iteration_details, parse_annotation
from servetwin.core.kv_cache.kv_sizing import (KVCacheSpec, cdiv, check_or_fit_max_model_len, dtype_bytes, max_concurrency, max_len_that_fits, num_blocks_for_memory)

from coretest_utils import create_scheduler, make_request, step

GiB = 1 << 30
MiB = 1 << 20
LLAMA8B = KVCacheSpec(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)


def test_cdiv_and_dtype():
    assert cdiv(0, 16) == 0 and cdiv(1, 16) == 1 and cdiv(16, 16) == 1 and cdiv(17, 16) == 2
    assert dtype_bytes("bfloat16") == 2 and dtype_bytes("torch.float16") == 2 and dtype_bytes("fp32") == 4
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("int3")


def test_llama8b_like_page_and_block_sizes():
    assert LLAMA8B.page_size_bytes == 64 * 1024  # 8 * 16 * (128 + 128) * 2
    assert LLAMA8B.bytes_per_block == 2 * MiB
    assert LLAMA8B.bytes_per_token == 128 * 1024


def test_worked_example_40_gib():
    blocks = num_blocks_for_memory(40 * GiB, LLAMA8B)
    assert blocks == 20480
    assert max_len_that_fits(blocks, LLAMA8B) == 20479 * 16 == 327_664
    assert max_concurrency(blocks, LLAMA8B, 8192) == pytest.approx(40.0)
    assert num_blocks_for_memory(40 * GiB + 2 * MiB - 1, LLAMA8B) == 20480  # floor
    assert num_blocks_for_memory(-5, LLAMA8B) == 0


def test_mla_like_spec_has_no_value_head():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_size=576, head_size_v=0, dtype="bf16", block_size=16)
    assert spec.page_size_bytes == 1 * 16 * 576 * 2


def test_max_model_len_that_fits_is_accepted_and_one_more_is_not():
    spec = LLAMA8B
    assert check_or_fit_max_model_len(100, spec, 1584, derived_max_len=8192) == 1584  # 99 usable blocks
    with pytest.raises(ValueError) as e:
        check_or_fit_max_model_len(100, spec, 1585, derived_max_len=8192)
    msg = str(e.value)
    assert "max_model_len" in msg and "1584" in msg  # quotes the largest length that fits


def test_max_model_len_error_quotes_largest_fit():
    with pytest.raises(ValueError, match="1584"):
        check_or_fit_max_model_len(100, LLAMA8B, 8192, derived_max_len=8192)


def test_auto_fit_reserves_null_block():
    assert check_or_fit_max_model_len(100, LLAMA8B, -1, derived_max_len=8192) == 1584
    assert check_or_fit_max_model_len(10_000, LLAMA8B, -1, derived_max_len=8192) == 8192  # not above derived
    with pytest.raises(ValueError, match="single token"):
        check_or_fit_max_model_len(1, LLAMA8B, -1, derived_max_len=8192)


def test_no_memory_for_kv_cache():
    with pytest.raises(ValueError):
        check_or_fit_max_model_len(0, LLAMA8B, 128, derived_max_len=8192)


def test_net_guarantee_one_max_len_request_fits_in_empty_pool():
    for blocks in (2, 3, 17, 100):
        L = check_or_fit_max_model_len(blocks, LLAMA8B, -1, derived_max_len=10**6)
        assert blocks - 1 >= cdiv(L, LLAMA8B.block_size)
        assert blocks - 1 < cdiv(L + 1, LLAMA8B.block_size)  # and it is the largest such length


def test_max_len_request_fits_in_scheduler_pool():
    # 9 blocks of 16 -> 8 usable -> max_model_len 128 fits exactly: a 127-token prompt + 1 output
    L = check_or_fit_max_model_len(9, LLAMA8B, -1, derived_max_len=4096)
    assert L == 128
    s = create_scheduler(num_blocks=9, block_size=16, max_num_batched_tokens=256, max_model_len=L)
    s.add_request(make_request("r", [1] * 127, max_tokens=1))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"r": 127}
    assert outs[0].finish_reason is not None


# -- iteration details / annotation ------------------------------------------------------------

def test_annotation_string_classifies_context_and_generation():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=1024)
    s.add_request(make_request("dec", [1] * 5, max_tokens=10, arrival_time=0.0))
    step(s)  # dec now decoding
    s.add_request(make_request("long", [2] * 100, arrival_time=1.0))
    so, _ = step(s)  # dec: 1 (generation); long: 63 (new -> context)
    d = compute_iteration_details(so)
    assert d == IterationDetails(1, 63, 1, 1)
    assert d.annotation == "execute_context_1(63)_generation_1(1)"
    s.add_request(make_request("new", [3] * 4, arrival_time=2.0))
    so, _ = step(s)  # long continues its chunked prefill: still context (no outputs yet)
    assert so.num_scheduled_tokens == {"dec": 1, "long": 37, "new": 4}
    assert compute_iteration_details(so).annotation == "execute_context_2(41)_generation_1(1)"
    assert parse_annotation(d.annotation) == d


def test_annotation_empty_step_and_parse_errors():
    s = create_scheduler()
    so = s.schedule()
    assert compute_iteration_details(so).annotation == "execute_context_0(0)_generation_0(0)"
    with pytest.raises(ValueError, match="annotation"):
        parse_annotation("execute_context_x")
