"""Scheduler behaviour (docs/scheduler_behaviour.md §2, §3, §6, §8; vLLM test equivalents, §7), FCFS policy."""
from __future__ import annotations

import pytest

from servetwin.core.sched.config import SchedulerConfig
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.request import FinishReason, RequestStatus

from coretest_utils import (assert_scheduler_empty, block_ids, check_block_accounting, create_requests,
                            create_scheduler, make_output, make_request, running_ids, step, waiting_ids)


# -- bookkeeping -------------------------------------------------------------------------------

def test_add_requests():
    s = create_scheduler()
    for i, req in enumerate(create_requests(10)):
        s.add_request(req)
        assert req.request_id in s.requests
        assert len(s.waiting) == i + 1
        assert req.status == RequestStatus.WAITING


def test_add_duplicate_id_rejected():
    s = create_scheduler()
    s.add_request(make_request("a", [1, 2, 3]))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("a", [4, 5]))


def test_finish_request_waiting():
    s = create_scheduler()
    reqs = create_requests(10)
    for r in reqs:
        s.add_request(r)
    for i, r in enumerate(reqs):
        done = s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
        assert done == [r]
        assert r.request_id not in s.requests
        assert r.request_id not in waiting_ids(s)
        assert len(s.waiting) == 9 - i
        assert r.status == RequestStatus.FINISHED_ABORTED
        assert r.get_finished_reason() == FinishReason.ABORT


def test_get_num_unfinished_requests():
    s = create_scheduler()
    reqs = create_requests(10)
    for r in reqs:
        s.add_request(r)
    for i, r in enumerate(reqs):
        s.finish_requests(r.request_id, RequestStatus.FINISHED_STOPPED)
        assert s.get_num_unfinished_requests() == 9 - i
    assert not s.has_unfinished_requests()
    assert s.has_finished_requests() and s.has_requests()


def test_finish_requests_rejects_non_finished_status():
    s = create_scheduler()
    with pytest.raises(ValueError):
        s.finish_requests("x", RequestStatus.RUNNING)


def test_finish_requests_from_every_state():
    s = create_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    for rid, arr in (("A", 0.0), ("B", 1.0), ("C", 2.0)):
        s.add_request(make_request(rid, [1] * 8, max_tokens=10, arrival_time=arr))
    s.add_request(make_request("D", [2] * 8, max_tokens=10, arrival_time=3.0))
    step(s)  # A B C D admitted, 2 blocks each, pool full
    step(s)  # A needs a block -> D preempted, B -> C... (see preemption test)
    states = {r.request_id: r.status for r in s.requests.values()}
    assert states["A"] == RequestStatus.RUNNING
    assert RequestStatus.PREEMPTED in states.values()
    s.add_request(make_request("W", [3] * 4, max_tokens=2, arrival_time=9.0))  # plain WAITING
    victims = [rid for rid, st in states.items() if st == RequestStatus.PREEMPTED]
    free_before = s.kv_cache_manager.num_free_blocks
    a_blocks = len(block_ids(s, "A"))
    done = s.finish_requests(["A", victims[0], "W", "nonexistent"], RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in done) == sorted(["A", victims[0], "W"])
    for r in done:
        assert r.status == RequestStatus.FINISHED_ABORTED
        assert r.request_id not in s.requests
        assert r.request_id in s.finished_req_ids
    assert "A" not in running_ids(s)
    assert victims[0] not in waiting_ids(s) and "W" not in waiting_ids(s)
    assert s.kv_cache_manager.num_free_blocks == free_before + a_blocks
    assert "A" not in s.kv_cache_manager.req_to_blocks
    # finishing an already finished request is a no-op
    assert s.finish_requests("A", RequestStatus.FINISHED_ABORTED) == []
    # None = all
    rest = s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in rest} == {"B", "C", "D"} - {victims[0]}
    s.schedule()
    assert_scheduler_empty(s)


# -- admission / budget ------------------------------------------------------------------------

@pytest.mark.parametrize("enable_prefix_caching", [False, True])
@pytest.mark.parametrize("prompt_logprobs", [None, 5])
def test_schedule(enable_prefix_caching, prompt_logprobs):
    s = create_scheduler(enable_prefix_caching=enable_prefix_caching)
    reqs = create_requests(10, prompt_logprobs=prompt_logprobs)
    for r in reqs:
        s.add_request(r)
    so = s.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == [r.request_id for r in reqs]
    assert so.scheduled_cached_reqs.num_reqs == 0
    assert so.finished_req_ids == set()
    assert so.num_scheduled_tokens == {r.request_id: 10 for r in reqs}
    assert so.total_num_scheduled_tokens == 100
    assert running_ids(s) == [r.request_id for r in reqs]
    assert len(s.waiting) == 0
    for r in reqs:
        assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 10


def test_max_num_seqs_caps_admission():
    s = create_scheduler(max_num_seqs=3)
    for r in create_requests(5):
        s.add_request(r)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["0", "1", "2"]
    assert waiting_ids(s) == ["3", "4"]


def test_max_num_active_seqs_caps_admission():
    s = create_scheduler(max_num_seqs=8, max_num_active_seqs=2)
    for r in create_requests(5):
        s.add_request(r)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["0", "1"]
    assert len(s.running) == 2 and len(s.waiting) == 3
    s.update_from_output(so, make_output(s, so))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["0", "1"]  # still capped while both run


def test_schedule_concurrent_partial_requests():
    for caching in (False, True):
        s = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400,
                             enable_prefix_caching=caching)
        for r in create_requests(3, num_tokens=800):
            s.add_request(r)
        so, _ = step(s)
        assert so.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
        assert [n.req_id for n in so.scheduled_new_reqs] == ["0", "1", "2"]
        so, _ = step(s)
        assert so.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
        assert so.scheduled_cached_reqs.req_ids == ["0", "1", "2"]
        so, _ = step(s)
        assert so.num_scheduled_tokens == {"0": 1, "1": 1, "2": 352}


def test_long_prefill_threshold_ignored_when_alone():
    s = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400, max_model_len=4096)
    s.add_request(make_request("long", [1] * 2000))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 1024}


def test_long_prefill_threshold_applies_with_other_requests():
    s = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400, max_model_len=4096)
    s.add_request(make_request("long", [1] * 2000, arrival_time=0.0))
    s.add_request(make_request("short", [2] * 10, arrival_time=1.0))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 400, "short": 10}


def test_long_prefill_threshold_floored_by_fair_share():
    s = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=100, max_model_len=4096,
                         long_prefill_token_threshold_adaptive=True)
    s.add_request(make_request("long", [1] * 2000, arrival_time=0.0))
    s.add_request(make_request("short", [2] * 10, arrival_time=1.0))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 512, "short": 10}  # max(100, 1024 // 2)


def test_long_prefill_threshold_chunks_even_without_chunked_prefill():
    s = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=300,
                         enable_chunked_prefill=False, max_model_len=1024)
    s.add_request(make_request("a", [1] * 800, arrival_time=0.0))
    s.add_request(make_request("b", [2] * 500, arrival_time=1.0))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 300, "b": 300}


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_schedule_order(enable_chunked_prefill):
    s = create_scheduler(max_num_batched_tokens=1024, enable_chunked_prefill=enable_chunked_prefill,
                         max_model_len=1024)
    for r in create_requests(2, num_tokens=800) + create_requests(2, num_tokens=10, start=2):
        s.add_request(r)
    so = s.schedule()
    if enable_chunked_prefill:
        assert so.num_scheduled_tokens == {"0": 800, "1": 224}
    else:
        # head-of-line: the 2nd long prompt does not fit; no skipping ahead to the short ones
        assert so.num_scheduled_tokens == {"0": 800}
        assert waiting_ids(s) == ["1", "2", "3"]


def test_chunked_prefill_disabled_requires_budget_ge_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="max_num_active_seqs"):
        SchedulerConfig(max_num_seqs=4, max_num_active_seqs=5)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(max_model_len=100, long_prefill_token_threshold=101)


def test_budget_starvation_running_requests_in_admission_order():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=1024)
    s.add_request(make_request("short", [1] * 4, arrival_time=0.0))
    step(s)  # short admitted and decoding
    s.add_request(make_request("long", [2] * 300, arrival_time=1.0))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"short": 1, "long": 63}
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"short": 1, "long": 63}


def test_running_request_with_zero_tokens_keeps_blocks():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=1024, block_size=16)
    s.add_request(make_request("long", [1] * 300, arrival_time=0.0))
    s.add_request(make_request("late", [2] * 10, arrival_time=1.0))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"long": 64}  # budget exhausted by the first
    assert waiting_ids(s) == ["late"]
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"long": 64}


def test_prompt_exactly_budget_chunked_off():
    s = create_scheduler(max_num_batched_tokens=100, enable_chunked_prefill=False, max_model_len=100)
    s.add_request(make_request("a", [1] * 60, arrival_time=0))
    s.add_request(make_request("b", [1] * 40, arrival_time=1))
    s.add_request(make_request("c", [1] * 1, arrival_time=2))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 60, "b": 40}


# -- max_model_len ------------------------------------------------------------------------------

def test_max_model_len_clamp_keeps_room_for_sampled_token():
    s = create_scheduler(max_num_batched_tokens=16, max_model_len=20, block_size=4)
    s.add_request(make_request("r", [1] * 19, max_tokens=100))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"r": 16}
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"r": 3}  # C + n <= max_model_len - 1
    assert outs[0].finish_reason == FinishReason.LENGTH  # N == max_model_len
    assert len(outs[0].new_token_ids) == 1


def test_unservable_requests_rejected_at_add():
    s = create_scheduler(num_blocks=5, block_size=16, max_num_batched_tokens=256, max_model_len=256)
    # 4 usable blocks = 64 tokens; prompt 60 + 16 max output = 76 tokens -> 5 blocks
    with pytest.raises(ValueError) as e:
        s.add_request(make_request("big", [1] * 60, max_tokens=16))
    msg = str(e.value)
    assert "76" in msg and "4" in msg and "64" in msg
    assert "big" not in s.requests and len(s.waiting) == 0
    s.add_request(make_request("ok", [1] * 48, max_tokens=16))  # 64 tokens fit exactly


def test_prompt_too_long_or_empty_rejected_at_add():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=64)
    with pytest.raises(ValueError, match="64"):
        s.add_request(make_request("eq", [1] * 64))  # == max_model_len: no room for an output
    with pytest.raises(ValueError):
        s.add_request(make_request("gt", [1] * 65))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("empty", []))
    s.add_request(make_request("fine", [1] * 63, max_tokens=100))
    so, outs = step(s)
    assert outs[0].finish_reason == FinishReason.LENGTH and len(outs[0].new_token_ids) == 1


# -- stop conditions ----------------------------------------------------------------------------

def _run_one(s, rid, toks):
    so = s.schedule()
    return s.update_from_output(so, make_output(s, so, tokens={rid: toks}))


def test_stop_via_eos():
    s = create_scheduler()
    r = make_request("r", [1, 2, 3], max_tokens=10)
    s.add_request(r)
    outs = _run_one(s, "r", [50256])
    assert outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason is None
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert "r" in s.finished_req_ids and "r" not in s.requests and not s.running
    assert r.output_token_ids == [50256]


def test_stop_via_stop_token_trims_following_tokens():
    s = create_scheduler()
    r = make_request("r", [1, 2, 3], max_tokens=10, stop_token_ids=[42, 43])
    s.add_request(r)
    outs = _run_one(s, "r", [10, 42, 11, 12])
    assert outs[0].new_token_ids == [10, 42]
    assert outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason == 42
    assert r.output_token_ids == [10, 42] and r.stop_reason == 42
    # the 2 surplus tokens after the stop token are un-counted from C (C -= len(generated) - k)
    assert r.num_computed_tokens == 3 - 2


def test_stop_via_max_tokens_truncates():
    s = create_scheduler()
    r = make_request("r", [1, 2, 3], max_tokens=2)
    s.add_request(r)
    outs = _run_one(s, "r", [10, 11, 12, 13])
    assert outs[0].new_token_ids == [10, 11]
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.stop_reason is None


def test_ignore_eos_keeps_running_but_stop_ids_apply():
    s = create_scheduler()
    r = make_request("r", [1, 2, 3], max_tokens=10, ignore_eos=True, stop_token_ids=[7])
    s.add_request(r)
    assert r.sampling_params.eos_token_id is None
    outs = _run_one(s, "r", [50256])
    assert outs[0].finish_reason is None and r.status == RequestStatus.RUNNING
    outs = _run_one(s, "r", [7])
    assert outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason == 7


def test_eos_checked_before_length_cap():
    s = create_scheduler()
    r = make_request("r", [1, 2, 3], max_tokens=1)
    s.add_request(r)
    outs = _run_one(s, "r", [50256])
    assert outs[0].finish_reason == FinishReason.STOP


def test_stop_token_checked_before_length_cap():
    s = create_scheduler()
    r = make_request("r", [1, 2, 3], max_tokens=1, stop_token_ids=[9])
    s.add_request(r)
    outs = _run_one(s, "r", [9])
    assert outs[0].finish_reason == FinishReason.STOP and outs[0].stop_reason == 9


def test_check_stop_min_tokens():
    s = create_scheduler()
    normal = make_request("normal", [1, 2], max_tokens=10, min_tokens=5)
    eos = make_request("eos", [1, 2], max_tokens=10, min_tokens=5)
    stop = make_request("stop", [1, 2], max_tokens=10, min_tokens=5, stop_token_ids=[77])
    ign = make_request("ign", [1, 2], max_tokens=10, min_tokens=5, ignore_eos=True)
    for r in (normal, eos, stop, ign):
        s.add_request(r)
    so = s.schedule()
    outs = s.update_from_output(so, make_output(s, so, tokens={
        "normal": [5], "eos": [50256], "stop": [77], "ign": [50256]}))
    by = {o.request_id: o for o in outs}
    assert by["normal"].finish_reason is None  # below min_tokens ordinary tokens continue
    assert by["eos"].finish_reason == FinishReason.STOP  # sampled EOS still stops
    assert by["stop"].finish_reason == FinishReason.STOP and by["stop"].stop_reason == 77
    assert by["ign"].finish_reason is None  # ignore_eos suppresses EOS


def test_check_stop_length_cap_below_min_tokens():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=10)
    a = make_request("a", [1] * 8, max_tokens=5, min_tokens=5)  # hits max_model_len after 2 outputs
    b = make_request("b", [1] * 2, max_tokens=3, min_tokens=3)
    s.add_request(a)
    s.add_request(b)
    finished = {}
    for _ in range(5):
        _, outs = step(s)
        finished.update({o.request_id: o.finish_reason for o in outs if o.finish_reason is not None})
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert a.num_output_tokens == 2 and b.num_output_tokens == 3


def test_stopped_request_blocks_freed_and_removed_from_running():
    s = create_scheduler(num_blocks=100, block_size=4)
    r = make_request("r", [1] * 10, max_tokens=3)
    s.add_request(r)
    for _ in range(3):
        so, outs = step(s)
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert r.output_token_ids == [1000, 1000, 1000]
    assert not s.running and s.kv_cache_manager.num_free_blocks == 99
    so = s.schedule()
    assert so.finished_req_ids == {"r"}
    assert s.finished_req_ids == set()  # handed over once, then replaced


def test_outputs_ignored_for_request_aborted_during_execution():
    s = create_scheduler()
    r = make_request("r", [1, 2, 3], max_tokens=5)
    s.add_request(r)
    so = s.schedule()
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    outs = s.update_from_output(so, make_output(s, so, tokens={"r": [5]}))
    assert outs == [] and r.output_token_ids == []


def test_non_final_prefill_chunk_gives_no_output():
    s = create_scheduler(max_num_batched_tokens=16, max_model_len=1024)
    s.add_request(make_request("r", [1] * 40))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"r": 16} and outs == []
    so, outs = step(s)
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"r": 8} and outs[0].new_token_ids == [1000]


# -- preemption (FCFS) --------------------------------------------------------------------------

def _fcfs_preemption_setup():
    s = create_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    for i, rid in enumerate("ABCD"):
        s.add_request(make_request(rid, [i + 1] * 8, max_tokens=10, arrival_time=float(i)))
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["A", "B", "C", "D"]
    assert s.kv_cache_manager.num_free_blocks == 0
    return s


def test_fcfs_preemption_victim_is_last_running_and_self_preemption():
    s = _fcfs_preemption_setup()
    s.add_request(make_request("E", [9] * 2, max_tokens=2, arrival_time=10.0))  # never ran
    so = s.schedule()
    # A needs a 3rd block -> D (tail) preempted; B needs one -> free block from D;
    # C needs one -> the tail is C itself -> self-preemption ends the pass
    assert so.preempted_order == ["D", "C"]
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert so.scheduled_new_reqs == []  # no admission in a step with a preemption
    assert running_ids(s) == ["A", "B"]
    assert waiting_ids(s) == ["C", "D", "E"]  # victims at the front, in admission order
    for rid in "CD":
        r = s.requests[rid]
        assert r.status == RequestStatus.PREEMPTED
        assert r.num_computed_tokens == 0 and r.num_preemptions == 1
        assert r.output_token_ids == [1000]  # outputs kept
        assert rid not in s.kv_cache_manager.req_to_blocks
    assert so.preempted_req_ids == {"C", "D"}
    check_block_accounting(s.kv_cache_manager)


def test_preempted_request_resumes_with_prompt_plus_outputs():
    s = _fcfs_preemption_setup()
    so = s.schedule()
    s.update_from_output(so, make_output(s, so))
    assert so.preempted_order == ["D", "C"]
    # run A and B to completion; then C and D are resumed and recompute prompt + outputs
    resumed = {}
    for _ in range(30):
        so, _ = step(s)
        cached = so.scheduled_cached_reqs
        for rid in cached.resumed_req_ids:
            if rid in resumed:
                continue  # first resumption only
            resumed[rid] = (so.num_scheduled_tokens[rid], cached.all_token_ids[rid],
                            cached.num_computed_tokens[cached.req_ids.index(rid)])
        if not s.has_unfinished_requests():
            break
    assert {"C", "D"} <= set(resumed)
    for rid, tok in (("C", 3), ("D", 4)):
        n, all_ids, computed = resumed[rid]
        assert all_ids == [tok] * 8 + [1000]
        assert n == 9 and computed == 0
    s.schedule()
    assert_scheduler_empty(s)


def test_no_admission_in_a_step_that_preempted_priority():
    s = create_scheduler(num_blocks=6, block_size=16, policy="priority", max_num_batched_tokens=256,
                         max_model_len=256)
    s.add_request(make_request("hi", [1] * 32, max_tokens=10, priority=0, arrival_time=0.0))
    s.add_request(make_request("lo", [2] * 48, max_tokens=10, priority=5, arrival_time=1.0))
    step(s)  # hi: 2 blocks (32 tokens exactly), lo: 3 blocks -> pool full
    assert s.kv_cache_manager.num_free_blocks == 0
    s.add_request(make_request("tiny", [3] * 4, max_tokens=2, priority=1, arrival_time=2.0))
    so, _ = step(s)
    # hi's decode needs a 3rd block -> lo preempted (frees 3); tiny would fit but no admission
    assert so.preempted_order == ["lo"]
    assert so.num_scheduled_tokens == {"hi": 1}
    assert so.scheduled_new_reqs == []
    assert s.kv_cache_manager.num_free_blocks == 2
    so, _ = step(s)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["tiny"]


def test_memory_leak():
    s = create_scheduler(num_blocks=50, block_size=4, enable_prefix_caching=True,
                         max_num_batched_tokens=64, max_model_len=64)
    for r in create_requests(5, num_tokens=10, max_tokens=6):
        s.add_request(r)
    for _ in range(50):
        step(s)
        check_block_accounting(s.kv_cache_manager)
        if not s.has_unfinished_requests():
            break
    s.schedule()
    assert_scheduler_empty(s)


def test_memory_leak_under_preemption():
    s = create_scheduler(num_blocks=12, block_size=4, enable_prefix_caching=True,
                         max_num_batched_tokens=32, max_model_len=64)
    for r in create_requests(6, num_tokens=9, max_tokens=12, same_prompt=True):
        s.add_request(r)
    preempted = 0
    for _ in range(200):
        so, _ = step(s)
        preempted += len(so.preempted_order)
        check_block_accounting(s.kv_cache_manager)
        if not s.has_unfinished_requests():
            break
    assert preempted > 0
    s.schedule()
    assert_scheduler_empty(s)


# -- prefix-cache interplay / stats -------------------------------------------------------------

def test_same_step_prefix_hit_between_identical_prompts():
    s = create_scheduler(enable_prefix_caching=True)
    for r in create_requests(3, num_tokens=40, same_prompt=True):
        s.add_request(r)
    so = s.schedule()
    hits = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    assert hits == {"0": 0, "1": 32, "2": 32}
    assert so.num_scheduled_tokens == {"0": 40, "1": 8, "2": 8}
    blocks = {n.req_id: n.block_ids[0] for n in so.scheduled_new_reqs}
    assert blocks["1"][:2] == blocks["0"][:2] == blocks["2"][:2]
    assert len({blocks["0"][2], blocks["1"][2], blocks["2"][2]}) == 3
    stats = s.make_stats().prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 120, 64)


def test_preemption_resume_rehits_own_blocks_and_counts_as_preempted():
    s = create_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=True,
                         max_num_batched_tokens=64, max_model_len=64)
    s.add_request(make_request("A", list(range(12)), max_tokens=2, arrival_time=0.0))
    s.add_request(make_request("V", [50, 51, 52, 53, 54], max_tokens=3, arrival_time=1.0))
    so, _ = step(s)
    assert block_ids(s, "A") == [1, 2, 3] and block_ids(s, "V") == [4, 5]
    s.make_stats()
    so, outs = step(s)
    assert so.preempted_order == ["V"]
    assert {o.request_id: o.finish_reason for o in outs} == {"A": FinishReason.LENGTH}
    so = s.schedule()
    stats = s.make_stats().prefix_cache_stats
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["V"] and cached.resumed_req_ids == {"V"}
    assert cached.num_computed_tokens == [4]  # its own first block, still cached
    assert so.num_scheduled_tokens == {"V": 2}  # 5 prompt + 1 output - 4 hit
    assert block_ids(s, "V")[0] == 4
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 6, 4)


def test_prefix_cache_stats_not_recorded_when_caching_disabled():
    s = create_scheduler(enable_prefix_caching=False)
    for r in create_requests(3, num_tokens=40, same_prompt=True):
        s.add_request(r)
    s.schedule()
    st = s.make_stats().prefix_cache_stats
    assert (st.requests, st.queries, st.hits, st.preempted_requests) == (0, 0, 0, 0)


def test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request():
    s = create_scheduler(num_blocks=11, block_size=16, enable_prefix_caching=True,
                         max_num_batched_tokens=512, max_model_len=512)
    p = list(range(40))
    s.add_request(make_request("P", p, max_tokens=1, arrival_time=0.0))
    step(s)  # P finishes after one token; 2 cached blocks stay evictable
    st = s.make_stats().prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (1, 40, 0)
    s.add_request(make_request("Bk", [7] * 112, max_tokens=2, arrival_time=1.0))
    s.add_request(make_request("R", p[:32] + [9] * 80, max_tokens=2, arrival_time=2.0))
    per_step = []
    for _ in range(3):
        so = s.schedule()
        per_step.append((list(so.num_scheduled_tokens), s.make_stats().prefix_cache_stats))
        s.update_from_output(so, make_output(s, so))
    (ids1, st1), (ids2, st2), (ids3, st3) = per_step
    assert ids1 == ["Bk"] and (st1.requests, st1.queries, st1.hits) == (1, 112, 0)
    assert ids2 == ["Bk"] and (st2.requests, st2.queries, st2.hits) == (0, 0, 0)  # R failed: not counted
    assert ids3 == ["R"] and (st3.requests, st3.queries, st3.hits) == (1, 112, 32)


def test_prefix_cache_stats_first_step():
    s = create_scheduler(num_blocks=11, block_size=16, enable_prefix_caching=True,
                         max_num_batched_tokens=512, max_model_len=512)
    s.add_request(make_request("P", list(range(40)), max_tokens=1))
    s.schedule()
    st = s.make_stats().prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (1, 40, 0)


def test_scheduler_reset_prefix_cache():
    s = create_scheduler(enable_prefix_caching=True, num_blocks=100)
    for r in create_requests(4, num_tokens=40):
        s.add_request(r)
    step(s)
    before = running_ids(s)
    assert s.reset_prefix_cache() is False
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert waiting_ids(s) == before
    assert not s.running
    assert all(r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in s.requests.values())
    pool = s.kv_cache_manager.block_pool
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 99
    # they resume afterwards with no prefix hits
    so = s.schedule()
    assert so.scheduled_cached_reqs.req_ids == before
    assert so.scheduled_cached_reqs.num_computed_tokens == [0, 0, 0, 0]


def test_reset_prefix_cache_priority_queue():
    s = create_scheduler(enable_prefix_caching=True, policy="priority")
    for i, prio in enumerate([2, 0, 1]):
        s.add_request(make_request(f"r{i}", [i] * 20, priority=prio, arrival_time=float(i)))
    step(s)
    assert s.reset_prefix_cache(reset_running_requests=True)
    assert waiting_ids(s) == ["r1", "r2", "r0"]


def test_kv_usage_and_stats_counts():
    s = create_scheduler(num_blocks=11, block_size=16, enable_prefix_caching=True)
    s.add_request(make_request("a", [1] * 40))
    s.add_request(make_request("b", [2] * 10))
    s.schedule()
    st = s.make_stats()
    assert st.num_running_reqs == 2 and st.num_waiting_reqs == 0
    assert st.kv_cache_usage == pytest.approx(4 / 10)
    assert st.num_free_blocks == 6


def test_schedule_concurrent_batches_without_output():
    # two schedule() calls before any output (sync scheduler): the second admits the next request,
    # the first request gets nothing more until its output arrives
    s = create_scheduler(max_num_batched_tokens=16, max_model_len=64)
    s.add_request(make_request("a", [1] * 16, arrival_time=0.0))
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"a": 16}
    s.add_request(make_request("b", [2] * 10, arrival_time=1.0))
    so2 = s.schedule()
    assert so2.num_scheduled_tokens == {"b": 10}
    s.update_from_output(so1, make_output(s, so1))
    s.update_from_output(so2, make_output(s, so2))
    so3 = s.schedule()
    assert so3.num_scheduled_tokens == {"a": 1, "b": 1}


def test_cached_request_data_fields():
    s = create_scheduler(num_blocks=100, block_size=4)
    s.add_request(make_request("r", [1] * 6, max_tokens=10))
    so, _ = step(s)
    assert so.scheduled_new_reqs[0].block_ids == ([1, 2],)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    so, _ = step(s)  # token 6 -> slot 7, still block 2
    c = so.scheduled_cached_reqs
    assert c.req_ids == ["r"] and c.new_block_ids == [None]
    assert c.num_computed_tokens == [6] and c.num_output_tokens == [1]
    so, _ = step(s)
    so, _ = step(s)  # slot 9 -> new block 3
    c = so.scheduled_cached_reqs
    assert c.new_block_ids == [([3],)] and c.num_computed_tokens == [8]


def test_empty_model_runner_output_for_empty_step():
    s = create_scheduler()
    so = s.schedule()
    assert so.total_num_scheduled_tokens == 0 and so.is_empty
    assert s.update_from_output(so, ModelRunnerOutput([], {}, [])) == []


def test_max_num_scheduled_tokens_caps_the_step():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=1024, max_num_scheduled_tokens=10)
    s.add_request(make_request("a", [1] * 30, arrival_time=0.0))
    s.add_request(make_request("b", [2] * 30, arrival_time=1.0))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 10}
    assert so.total_num_scheduled_tokens == 10
