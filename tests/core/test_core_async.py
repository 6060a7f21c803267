"""Async scheduling (one-step run-ahead with output placeholders, docs/scheduler_behaviour.md §2.10) and the EngineCore loop."""
from __future__ import annotations

import pytest

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.executor import FakeExecutor, make_executor
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.request import FinishReason, RequestStatus

from coretest_utils import assert_scheduler_empty, check_block_accounting, create_scheduler, make_request


def make_engine(async_scheduling: bool, **kw) -> EngineCore:
    sc = SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 16),
                         max_num_batched_tokens=kw.pop("max_num_batched_tokens", 256),
                         max_model_len=kw.pop("max_model_len", 256), async_scheduling=async_scheduling)
    cc = CacheConfig(block_size=kw.pop("block_size", 16), num_gpu_blocks=kw.pop("num_blocks", 100),
                     enable_prefix_caching=kw.pop("enable_prefix_caching", False))
    assert not kw
    return EngineCore(sc, cc, FakeExecutor())


def _run_to_end(engine: EngineCore, limit: int = 200):
    results = []
    for _ in range(limit):
        if not engine.has_work():
            break
        results.append(engine.step())
    results.extend(engine.drain())
    return results


def test_async_decode_scheduled_before_previous_output_returns():
    eng = make_engine(True)
    eng.add_request(make_request("r", [1] * 20, max_tokens=4))
    r0 = eng.step()
    assert r0.scheduled.num_scheduled_tokens == {"r": 20}
    assert r0.processed is None and r0.outputs == []  # not blocked on the batch yet
    req = eng.scheduler.requests["r"]
    assert req.num_output_placeholders == 1 and req.num_computed_tokens == 20 and req.num_tokens == 20
    r1 = eng.step()
    # the decode is scheduled while step 0's token is still in flight
    assert r1.scheduled.num_scheduled_tokens == {"r": 1}
    assert r1.processed is r0.scheduled
    assert [o.new_token_ids for o in r1.outputs] == [[10]]  # FakeExecutor: step 0, row 0 -> 10
    assert req.num_computed_tokens == 21 and req.num_tokens == 21


def test_async_max_tokens_1_not_rescheduled():
    eng = make_engine(True)
    eng.add_request(make_request("r", [1] * 20, max_tokens=1))
    r0 = eng.step()
    assert r0.scheduled.num_scheduled_tokens == {"r": 20}
    r1 = eng.step()
    # the in-flight step already produces the last token: nothing scheduled for it
    assert "r" not in r1.scheduled.num_scheduled_tokens
    assert r1.outputs and r1.outputs[0].finish_reason == FinishReason.LENGTH
    rest = _run_to_end(eng)
    assert all("r" not in (res.scheduled.num_scheduled_tokens if res.scheduled else {}) for res in rest)
    eng.scheduler.schedule()
    assert_scheduler_empty(eng.scheduler)


def test_async_max_tokens_respected_and_everything_freed():
    for max_tokens in (1, 2, 3, 7):
        eng = make_engine(True, block_size=4, num_blocks=50)
        eng.add_request(make_request("a", [1] * 9, max_tokens=max_tokens))
        eng.add_request(make_request("b", [2] * 3, max_tokens=max_tokens + 1))
        tokens = {"a": [], "b": []}
        reasons = {}
        for res in _run_to_end(eng):
            for o in res.outputs:
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    reasons[o.request_id] = o.finish_reason
            check_block_accounting(eng.scheduler.kv_cache_manager)
        assert len(tokens["a"]) == max_tokens and len(tokens["b"]) == max_tokens + 1
        assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
        eng.scheduler.schedule()
        assert_scheduler_empty(eng.scheduler)


def test_sync_and_async_produce_same_tokens_per_request():
    def run(async_scheduling):
        eng = make_engine(async_scheduling, block_size=4, num_blocks=200, enable_prefix_caching=True)
        for i in range(4):
            eng.add_request(make_request(f"r{i}", [i] * (5 + 3 * i), max_tokens=5))
        counts = {}
        for res in _run_to_end(eng):
            for o in res.outputs:
                counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
        return counts

    assert run(False) == run(True) == {f"r{i}": 5 for i in range(4)}


def test_async_preempt_during_execution_late_token_still_appended():
    # 10 usable blocks; two 80-token prompts take 5 blocks each
    s = create_scheduler(num_blocks=11, block_size=16, max_num_batched_tokens=256, max_model_len=256,
                         async_scheduling=True)
    s.add_request(make_request("r0", [1] * 80, max_tokens=16, arrival_time=0.0))
    s.add_request(make_request("r1", [2] * 80, max_tokens=16, arrival_time=1.0))
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"r0": 80, "r1": 80}
    so2 = s.schedule()  # before so1's output: r0's decode needs a 6th block -> tail r1 preempted
    assert so2.preempted_order == ["r1"]
    assert so2.num_scheduled_tokens == {"r0": 1}
    r1 = s.requests["r1"]
    assert r1.status == RequestStatus.PREEMPTED and r1.num_output_placeholders == 0
    out = ModelRunnerOutput(["r0", "r1"], {"r0": 0, "r1": 1}, [[41], [42]])
    outs = s.update_from_output(so1, out)
    assert {o.request_id: o.new_token_ids for o in outs} == {"r0": [41], "r1": [42]}
    assert r1.output_token_ids == [42]  # the late token still belongs to it
    assert r1.num_output_placeholders == 0 and r1.num_stale_output_tokens == 0
    assert s.requests["r0"].num_output_placeholders == 1  # so2's token still in flight
    check_block_accounting(s.kv_cache_manager)


def test_async_output_does_not_cache_inflight_tokens():
    s = create_scheduler(num_blocks=50, block_size=4, enable_prefix_caching=True, async_scheduling=True,
                         max_num_batched_tokens=64, max_model_len=64)
    s.add_request(make_request("r", [1] * 7, max_tokens=10))
    so1 = s.schedule()
    r = s.requests["r"]
    assert s.kv_cache_manager.num_cached_block["r"] == 1  # only the full prompt block
    so2 = s.schedule()  # decode of token 7 (not yet known)
    assert so2.num_scheduled_tokens == {"r": 1}
    # token 7 is unknown, block 2 cannot be hashed/cached yet
    assert s.kv_cache_manager.num_cached_block["r"] == 1
    s.update_from_output(so1, ModelRunnerOutput(["r"], {"r": 0}, [[5]]))
    # 8 tokens known now, but the KV of token 7 is still being written by so2: not cached yet
    assert r.num_tokens == 8 and len(r.block_hashes) == 2
    assert s.kv_cache_manager.num_cached_block["r"] == 1
    s.update_from_output(so2, ModelRunnerOutput(["r"], {"r": 0}, [[6]]))
    assert s.kv_cache_manager.num_cached_block["r"] == 2
    check_block_accounting(s.kv_cache_manager)


def test_engine_sync_step_processes_its_own_batch():
    eng = make_engine(False)
    assert eng.step().scheduled is None  # nothing to do
    eng.add_request(make_request("r", [1] * 5, max_tokens=2))
    r0 = eng.step()
    assert r0.processed is r0.scheduled and len(r0.outputs[0].new_token_ids) == 1
    r1 = eng.step()
    assert r1.finished and r1.finished[0].finish_reason == FinishReason.LENGTH
    assert eng.abort_requests(["r"]) == []
    assert eng.has_work()  # finished ids still to hand over
    eng.step()
    assert not eng.has_work()


def test_engine_abort_running_request():
    eng = make_engine(False)
    eng.add_request(make_request("r", [1] * 5, max_tokens=20))
    eng.step()
    done = eng.abort_requests(["r"])
    assert [r.request_id for r in done] == ["r"] and done[0].status == RequestStatus.FINISHED_ABORTED
    res = eng.step()
    assert res.scheduled.finished_req_ids == {"r"}
    assert not eng.has_work()
    assert_scheduler_empty(eng.scheduler)


def test_fake_executor_token_rule_and_make_executor():
    eng = make_engine(False)
    for i in range(3):
        eng.add_request(make_request(f"r{i}", [i + 1] * 4, max_tokens=3, arrival_time=float(i)))
    toks = {}
    for res in _run_to_end(eng):
        for o in res.outputs:
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert toks == {"r0": [10, 17, 24], "r1": [11, 18, 25], "r2": [12, 19, 26]}
    assert isinstance(make_executor("fake"), FakeExecutor)
    with pytest.raises(ValueError, match="backend"):
        make_executor("nope")


def test_async_request_preempted_in_flight_that_then_stops_leaves_waiting_queue():
    s = create_scheduler(num_blocks=11, block_size=16, max_num_batched_tokens=256, max_model_len=256,
                         async_scheduling=True)
    s.add_request(make_request("r0", [1] * 80, max_tokens=16, arrival_time=0.0))
    s.add_request(make_request("r1", [2] * 80, max_tokens=1, arrival_time=1.0))
    so1 = s.schedule()
    so2 = s.schedule()
    assert so2.preempted_order == ["r1"]
    assert [r.request_id for r in s.waiting] == ["r1"]
    outs = s.update_from_output(so1, ModelRunnerOutput(["r0", "r1"], {"r0": 0, "r1": 1}, [[41], [42]]))
    by = {o.request_id: o for o in outs}
    assert by["r1"].finish_reason == FinishReason.LENGTH and by["r1"].new_token_ids == [42]
    assert len(s.waiting) == 0 and "r1" not in s.requests
    assert "r1" in s.finished_req_ids
    check_block_accounting(s.kv_cache_manager)
