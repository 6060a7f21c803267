"""Priority scheduling (docs/scheduler_behaviour.md §1.11, §2.2, §8.11; vLLM's priority tests)."""
from __future__ import annotations

import random

from servetwin.core.request import RequestStatus
from servetwin.core.sched.request_queue import (FCFSRequestQueue, PriorityRequestQueue, SchedulingPolicy, create_request_queue)

from coretest_utils import (assert_scheduler_empty, check_block_accounting, create_scheduler, make_output,
                            make_request, running_ids, step, waiting_ids)


def _prio_scheduler(**kw):
    kw.setdefault("policy", "priority")
    return create_scheduler(**kw)


def _add(s, rid, prio, arrival, n=10, max_tokens=16, tok=None):
    r = make_request(rid, [tok if tok is not None else len(s.requests)] * n, max_tokens=max_tokens,
                     priority=prio, arrival_time=arrival)
    s.add_request(r)
    return r


def test_priority_scheduling_basic_ordering():
    s = _prio_scheduler()
    for rid, prio, arr in (("a", 3, 0.0), ("b", 1, 1.0), ("c", 2, 2.0), ("d", 0, 3.0)):
        _add(s, rid, prio, arr)
    so = s.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["d", "b", "c", "a"]
    assert list(so.num_scheduled_tokens) == ["d", "b", "c", "a"]
    assert running_ids(s) == ["d", "b", "c", "a"]


def test_priority_scheduling_arrival_time_tiebreaker():
    s = _prio_scheduler()
    for rid, arr in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
        _add(s, rid, 1, arr)
    so = s.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b", "c", "a"]


def test_priority_scheduling_mixed_priority_and_arrival():
    s = _prio_scheduler()
    spec = [("a", 2, 1.0), ("b", 1, 4.0), ("c", 1, 2.0), ("d", 2, 0.5), ("e", 0, 9.0)]
    for rid, prio, arr in spec:
        _add(s, rid, prio, arr)
    so = s.schedule()
    expected = [rid for rid, _, _ in sorted(spec, key=lambda x: (x[1], x[2]))]
    assert [n.req_id for n in so.scheduled_new_reqs] == expected == ["e", "c", "b", "d", "a"]


def test_priority_scheduling_fcfs_fallback():
    s = _prio_scheduler()
    for i in range(5):
        _add(s, f"r{i}", 0, float(i))
    so = s.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == [f"r{i}" for i in range(5)]


def test_priority_scheduling_with_limited_slots():
    s = _prio_scheduler(max_num_seqs=2)
    for rid, prio, arr in (("a", 5, 0.0), ("b", 1, 1.0), ("c", 3, 2.0), ("d", 2, 3.0)):
        _add(s, rid, prio, arr)
    so = s.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b", "d"]
    assert waiting_ids(s) == ["c", "a"]


def test_priority_scheduling_waiting_queue_order():
    s = _prio_scheduler(max_num_seqs=1)
    for rid, prio, arr in (("a", 5, 0.0), ("b", 1, 1.0), ("c", 3, 2.0), ("d", 1, 0.5)):
        _add(s, rid, prio, arr)
    assert waiting_ids(s) == ["d", "b", "c", "a"]


def test_priority_scheduling_heap_property():
    q = PriorityRequestQueue()
    rng = random.Random(0)
    reqs = [make_request(f"r{i}", [1], priority=rng.randint(0, 5), arrival_time=float(rng.randint(0, 3)))
            for i in range(40)]
    for r in reqs[:20]:
        q.add_request(r)
    popped = [q.pop_request() for _ in range(5)]
    for r in reqs[20:]:
        q.add_request(r)
    rest = []
    while q:
        assert q.peek_request() is min(q._heap)
        rest.append(q.pop_request())
    key = lambda r: (r.priority, r.arrival_time, r.request_id)  # noqa: E731
    assert [key(r) for r in rest] == sorted(key(r) for r in rest)
    assert [key(r) for r in popped] == sorted(key(r) for r in popped)
    assert len(popped) + len(rest) == 40


def test_priority_queue_remove_and_prepend():
    q = PriorityRequestQueue()
    a, b, c = (make_request(x, [1], priority=p) for x, p in (("a", 2), ("b", 0), ("c", 1)))
    for r in (a, b, c):
        q.add_request(r)
    q.remove_request(b)
    assert [r.request_id for r in q] == ["c", "a"]
    q.prepend_request(b)  # no notion of front: plain push
    assert q.peek_request() is b
    q.remove_requests([a, b])
    assert [r.request_id for r in q] == ["c"] and len(q) == 1


def test_fcfs_queue_prepend_requests_reverses():
    q = FCFSRequestQueue()
    a, b, c, d = (make_request(x, [1]) for x in "abcd")
    q.add_request(d)
    q.prepend_request(c)
    q.prepend_requests([a, b])  # extendleft reverses the iterable
    assert [r.request_id for r in q] == ["b", "a", "c", "d"]
    q.remove_requests([a, c])
    assert [r.request_id for r in q] == ["b", "d"]
    assert q.pop_request() is b and q.peek_request() is d
    assert isinstance(create_request_queue(SchedulingPolicy.FCFS), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)


def test_priority_scheduling_no_preemption_when_space_available():
    s = _prio_scheduler(num_blocks=100)
    _add(s, "lo", 5, 0.0, n=20)
    step(s)
    _add(s, "hi", 0, 1.0, n=20)
    for _ in range(5):
        so, _ = step(s)
        assert so.preempted_order == []
    assert running_ids(s) == ["lo", "hi"]


def test_priority_scheduling_preemption_unschedules_already_scheduled_victim():
    # 5 usable blocks of 16 tokens
    s = _prio_scheduler(num_blocks=6, max_num_batched_tokens=256, max_model_len=256)
    lo = _add(s, "lo1", 5, 0.0, n=20, max_tokens=10)
    so, _ = step(s)
    hi = _add(s, "hi1", 0, 1.0, n=48, max_tokens=10)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"lo1": 1, "hi1": 48}
    assert s.kv_cache_manager.num_free_blocks == 0
    so = s.schedule()
    # lo1 was scheduled first (no new block needed), then hi1 needs a 4th block: the least urgent
    # running request (lo1) is preempted and un-scheduled; only hi1 remains in the output
    assert so.preempted_order == ["lo1"]
    assert so.num_scheduled_tokens == {"hi1": 1}
    assert so.total_num_scheduled_tokens == 1
    assert so.scheduled_cached_reqs.req_ids == ["hi1"]
    assert lo.status == RequestStatus.PREEMPTED and lo.num_computed_tokens == 0
    assert hi.status == RequestStatus.RUNNING and hi.num_computed_tokens == 49
    assert running_ids(s) == ["hi1"] and waiting_ids(s) == ["lo1"]
    assert so.scheduled_new_reqs == []
    check_block_accounting(s.kv_cache_manager)


def test_priority_victim_is_max_priority_then_latest_arrival_over_all_running():
    s = _prio_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    b = _add(s, "b", 3, 1.0, n=8, max_tokens=8)
    step(s)
    for rid, prio, arr in (("a", 0, 0.0), ("c", 3, 0.5), ("d", 1, 2.0)):
        _add(s, rid, prio, arr, n=8, max_tokens=8)
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["b", "a", "d", "c"]  # running b, then heap order
    assert running_ids(s) == ["b", "a", "d", "c"]
    assert s.kv_cache_manager.num_free_blocks == 2
    so = s.schedule()
    # b (no new block), a and d (one new block each) are scheduled; c needs a block and none is
    # left: the victim is max(priority, arrival) over ALL running = b (3, 1.0) rather than
    # c (3, 0.5) or the tail; b was already scheduled this step and is un-scheduled
    assert so.preempted_order == ["b"]
    assert so.num_scheduled_tokens == {"a": 1, "d": 1, "c": 1}
    assert b.status == RequestStatus.PREEMPTED
    assert running_ids(s) == ["a", "d", "c"]
    check_block_accounting(s.kv_cache_manager)


def test_priority_scheduling_equal_priority_preemption_latest_arrival():
    s = _prio_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    late = _add(s, "late", 0, 5.0, n=6, max_tokens=8)  # admitted first but arrived last
    step(s)
    early = _add(s, "early", 0, 1.0, n=6, max_tokens=8)
    step(s)
    assert running_ids(s) == ["late", "early"]
    assert s.kv_cache_manager.num_free_blocks == 0
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"late": 1, "early": 1} and so.preempted_order == []
    so = s.schedule()
    # 'late' needs a 3rd block: equal priorities -> the victim is the latest arrival = itself
    # (running[0], not the tail)
    assert so.preempted_order == ["late"]
    assert late.status == RequestStatus.PREEMPTED
    # the pass continues after a self-preemption in priority mode: 'early' is still scheduled
    assert so.num_scheduled_tokens == {"early": 1}
    assert early.status == RequestStatus.RUNNING
    assert s.kv_cache_manager.num_free_blocks == 2


def test_priority_scheduling_preemption_and_resumption_when_out_of_kv():
    # 3 usable blocks of 16 tokens
    s = _prio_scheduler(num_blocks=4, max_num_batched_tokens=256, max_model_len=256)
    low = _add(s, "low", 1, 0.0, n=10, max_tokens=6)
    step(s)
    high = _add(s, "high", 0, 1.0, n=32, max_tokens=3, tok=7)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"low": 1, "high": 32}
    so, outs = step(s)
    assert so.preempted_order == ["low"]
    assert so.num_scheduled_tokens == {"high": 1}  # low was scheduled, then un-scheduled
    assert low.status == RequestStatus.PREEMPTED
    assert low.output_token_ids == [1000, 1000]
    so, outs = step(s)  # high's last token; low cannot fit yet
    assert so.num_scheduled_tokens == {"high": 1}
    assert [o.request_id for o in outs if o.finish_reason is not None] == ["high"]
    so, outs = step(s)
    c = so.scheduled_cached_reqs
    assert c.req_ids == ["low"] and c.resumed_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"low": 12}  # prompt 10 + 2 outputs recomputed
    assert c.all_token_ids["low"] == low.prompt_token_ids + [1000, 1000]
    assert c.new_block_ids == [s.kv_cache_manager.get_block_ids("low")]
    assert low.num_preemptions == 1
    for _ in range(10):
        step(s)
    s.schedule()
    assert_scheduler_empty(s)


def test_priority_self_preemption_then_continue_with_next():
    s = _prio_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    a = _add(s, "a", 2, 0.0, n=4, max_tokens=6)   # 1 block exactly full
    b = _add(s, "b", 0, 1.0, n=7, max_tokens=4)   # 2 blocks, one slot left
    so, _ = step(s)
    assert running_ids(s) == ["b", "a"]
    assert s.kv_cache_manager.num_free_blocks == 0
    so = s.schedule()
    # b (slot 8 left in its 2nd block) fits; a needs a 2nd block -> victim = a itself
    assert so.num_scheduled_tokens == {"b": 1}
    assert so.preempted_order == ["a"]
    assert a.status == RequestStatus.PREEMPTED
    s.update_from_output(so, make_output(s, so))
