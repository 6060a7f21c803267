"""Request model, statuses, configs, and a few scheduler corner cases (docs/scheduler_behaviour.md §1, §3.3, §8)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.testbed.replay import replay
from servetwin.core.request import FinishReason, Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.testbed.scenario import parse_scenario

from coretest_utils import (GID, check_block_accounting, create_scheduler, free_queue_ids, make_request, step)


def test_request_status_order_and_finished():
    order = [RequestStatus.WAITING, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
             RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING_FOR_STREAMING_REQ,
             RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.FINISHED_STOPPED,
             RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_IGNORED, RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_REPETITION]
    assert order == sorted(order)
    for s in order:
        assert RequestStatus.is_finished(s) == (s > RequestStatus.PREEMPTED)
    reasons = {s: RequestStatus.get_finished_reason(s) for s in order if RequestStatus.is_finished(s)}
    assert reasons == {
        RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
        RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
        RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
    }
    assert [int(f) for f in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR,
                             FinishReason.REPETITION)] == [0, 1, 2, 3, 4]
    assert str(FinishReason.LENGTH) == "length"


def test_request_fields_and_token_views():
    r = make_request("r", [1, 2, 3], max_tokens=5)
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
    assert r.num_prompt_tokens == 3 and r.num_tokens == 3 and r.num_output_tokens == 0
    assert r.max_tokens == 5 and r.priority == 0 and r.num_preemptions == 0
    r.append_output_token_ids(9)
    r.append_output_token_ids([8, 7])
    assert r.output_token_ids == [9, 8, 7] and r.all_token_ids == [1, 2, 3, 9, 8, 7]
    assert r.num_tokens == 6 and r.num_tokens_with_spec == 6
    assert r.prompt_token_ids == [1, 2, 3]


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 50), min_size=1, max_size=12),
       appends=st.lists(st.one_of(st.integers(0, 50), st.lists(st.integers(0, 50), max_size=4)), max_size=8),
       read_at=st.integers(0, 8), data=st.data())
def test_request_token_views_without_the_all_tokens_list(prompt, appends, read_at, data):
    """`num_tokens` and `get_token_ids` (which read the prompt and output lists) equal the length and slices
    of `all_token_ids` (the prompt followed by the output), whether that list was built (read) before the
    output grew or not; the prompt list is never changed and never is `all_token_ids`."""
    sent = list(prompt)
    r = make_request("r", sent, max_tokens=100)
    expected = list(prompt)
    views = []
    for i, tokens in enumerate(appends):
        if i == read_at:
            views.append(r.all_token_ids)  # built here: it grows with the output from now on
        r.append_output_token_ids(tokens)
        expected += [tokens] if isinstance(tokens, int) else tokens
        assert r.num_tokens == len(expected) and r.num_tokens_with_spec == len(expected)
        start = data.draw(st.integers(0, len(expected)))
        end = data.draw(st.integers(start, len(expected)))
        assert r.get_token_ids(start, end) == expected[start:end]
    assert r.all_token_ids == expected and r.all_token_ids is not sent and sent == prompt
    assert all(view is r.all_token_ids for view in views)
    assert r.output_token_ids == expected[len(prompt):]


def test_request_needs_params_and_max_tokens():
    with pytest.raises(ValueError, match="sampling_params"):
        Request("r", [1], None)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("r", [1], SamplingParams(max_tokens=None))


def test_request_ordering_priority_arrival_id():
    a = make_request("a", [1], priority=1, arrival_time=5.0)
    b = make_request("b", [1], priority=0, arrival_time=9.0)
    c = make_request("c", [1], priority=1, arrival_time=2.0)
    d = make_request("d", [1], priority=1, arrival_time=2.0)
    assert sorted([a, b, c, d]) == [b, c, d, a]
    assert not (a < a)


def test_skip_reading_prefix_cache_from_prompt_logprobs():
    assert make_request("r", [1], prompt_logprobs=1).skip_reading_prefix_cache
    assert not make_request("r", [1]).skip_reading_prefix_cache


def test_cache_config_validation():
    assert CacheConfig().block_size == 16 and CacheConfig().enable_prefix_caching
    for kwargs, field in ((dict(block_size=0), "block_size"), (dict(num_gpu_blocks=1), "num_gpu_blocks"),
                          (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
                          (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                          (dict(prefix_caching_hash_algo="md5"), "prefix_caching_hash_algo"),
                          (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes")):
        with pytest.raises(ValueError, match=field):
            CacheConfig(**kwargs)


def test_scheduler_config_defaults_and_validation():
    sc = SchedulerConfig()
    assert (sc.max_num_batched_tokens, sc.max_num_seqs, sc.policy) == (2048, 128, "fcfs")
    assert sc.enable_chunked_prefill and sc.scheduler_reserve_full_isl and sc.watermark == 0.0
    assert sc.max_num_scheduled_tokens == sc.max_num_batched_tokens
    assert sc.long_prefill_token_threshold == 0
    for kwargs, field in ((dict(policy="lifo"), "policy"), (dict(watermark=1.0), "watermark"),
                          (dict(max_num_seqs=0), "max_num_seqs"),
                          (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold")):
        with pytest.raises(ValueError, match=field):
            SchedulerConfig(**kwargs)


def test_scheduler_needs_pool_size():
    from servetwin.core.sched.scheduler import Scheduler
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig())


def test_last_sampled_token_never_cached():
    s = create_scheduler(num_blocks=11, block_size=16, enable_prefix_caching=True)
    prompt = list(range(15))
    s.add_request(make_request("a", prompt, max_tokens=1))
    so, outs = step(s)  # 15 prompt tokens + 1 sampled -> 16 known tokens, but token 16 has no KV
    assert outs[0].finish_reason == FinishReason.LENGTH
    # the block was never hashed; freed un-hashed -> to the head of the free queue
    assert all(b.block_hash is None for b in s.kv_cache_manager.block_pool.blocks)
    assert free_queue_ids(s.kv_cache_manager)[0] == 1
    s.add_request(make_request("b", prompt + [1000, 5], max_tokens=1))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_finished_request_full_blocks_stay_cached_partial_goes_to_head():
    s = create_scheduler(num_blocks=11, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=64,
                         max_model_len=64)
    s.add_request(make_request("a", list(range(9)), max_tokens=2))
    step(s)
    step(s)  # finished: 11 tokens known, KV for 10; blocks [1, 2, 3]: 1-2 hashed, 3 partial
    assert free_queue_ids(s.kv_cache_manager) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    check_block_accounting(s.kv_cache_manager)
    s.add_request(make_request("b", list(range(9)) + [77], max_tokens=1))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.scheduled_new_reqs[0].block_ids == ([1, 2, 3],)


def test_decode_block_registered_in_the_step_that_completes_it():
    s = create_scheduler(num_blocks=20, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=64,
                         max_model_len=64)
    r = make_request("a", [5, 6, 7], max_tokens=10)
    s.add_request(r)
    step(s)  # C=3, N=4
    kv = s.kv_cache_manager
    assert kv.num_cached_block.get("a", 0) == 0
    s.schedule()  # schedules token index 3: block 0 full once computed -> cached now (allocation time)
    assert kv.num_cached_block["a"] == 1
    assert kv.req_to_blocks["a"][0].block_hash == r.block_hashes[0] + GID
    # visible to a lookup in the same step
    other = make_request("o", [5, 6, 7, 1000, 1], max_tokens=1)
    s.add_request(other)
    hits, n = kv.get_computed_blocks(other)
    assert n == 4


def test_servable_check_uses_max_model_len_cap():
    s = create_scheduler(num_blocks=5, block_size=16, max_num_batched_tokens=64, max_model_len=64)
    # 4 usable blocks = 64 tokens = max_model_len: a huge max_tokens is still servable
    s.add_request(make_request("r", [1] * 10, max_tokens=10_000))
    for _ in range(100):
        so, outs = step(s)
        if outs and outs[0].finish_reason is not None:
            break
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert s.kv_cache_manager.num_free_blocks == 4


def test_replay_idle_steps_before_late_arrival():
    d = {"settings": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_gpu_blocks": 64},
         "requests": [{"id": "late", "arrival_step": 2, "prompt_token_ids": [1, 2, 3], "max_tokens": 1}]}
    lines = list(replay(parse_scenario(d)))
    steps = [x for x in lines if x["type"] == "step"]
    # steps 0-1 idle; step 3 is the empty step that hands the finished id over (has_requests())
    assert [x.get("idle", False) for x in steps] == [True, True, False, False]
    assert steps[3]["num_scheduled_tokens"] == {}
    assert steps[0]["num_scheduled_tokens"] == {} and steps[0]["arrived"] == []
    assert steps[2]["arrived"] == ["late"] and steps[2]["num_scheduled_tokens"] == {"late": 3}
    assert lines[-1]["finish_step"] == {"late": 2}
    json.dumps(lines)  # serialisable


def test_stats_waiting_and_preemption_counters():
    s = create_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    s.add_request(make_request("a", [1] * 8, max_tokens=6, arrival_time=0.0))
    s.add_request(make_request("b", [2] * 8, max_tokens=6, arrival_time=1.0))
    s.add_request(make_request("c", [3] * 4, max_tokens=2, arrival_time=2.0))
    step(s)
    st = s.make_stats()
    assert (st.num_running_reqs, st.num_waiting_reqs, st.num_skipped_waiting_reqs) == (2, 1, 0)
    assert st.kv_cache_usage == 1.0 and st.num_free_blocks == 0
    step(s)  # a needs a 3rd block -> b preempted
    st = s.make_stats()
    assert st.num_preempted_reqs == 1 and st.num_waiting_reqs == 2
    assert s.make_stats().num_preempted_reqs == 0
    assert s.get_request_counts() == (1, 2)
