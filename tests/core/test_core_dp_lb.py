"""vLLM's internal DP load balancer (`servetwin.core.engine.dp_lb`): worked cases derived from the rule
(vLLM 0.33 `v1/engine/core_client.py:1751-1812`, `v1/engine/coordinator.py:255-290`) and property tests
against a reference written here from the rule's wording."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.engine.dp_lb import DPLoadBalancer, DPStatsCoordinator, RequestCountsPublisher, engine_score


# -- worked cases ----------------------------------------------------------------------------------
def test_idle_engines_are_taken_in_rotation():
    lb = DPLoadBalancer(3)
    # all scores 0: the scan start (0, then 1, then 2) wins each tie; each pick bumps its waiting
    assert [lb.choose(f"r{i}") for i in range(3)] == [0, 1, 2]
    assert lb.lb_engines == [[1, 0, 0.0], [1, 0, 0.0], [1, 0, 0.0]]
    assert lb.engine_inflight == [1, 1, 1]
    # all equal again (score max(1*1, 1+0) = 1); the start index has come round to 0
    assert lb.choose("r3") == 0


def test_kv_pressure_penalises_waiting_requests():
    lb = DPLoadBalancer(2)
    lb.on_publish([[2, 0, 0.9], [0, 3, 0.1]])
    # engine 0: 2 + 2 * 6 * (0.9 - 0.5) = 6.8; engine 1: 3 (no waiting, no penalty)
    assert lb.scores() == pytest.approx([6.8, 3.0])
    assert lb.choose("a") == 1
    # below 50% usage the penalty is off: [2, 0, 0.4] scores 2 and beats 3
    lb2 = DPLoadBalancer(2)
    lb2.on_publish([[2, 0, 0.4], [0, 3, 0.1]])
    assert lb2.choose("a") == 0


def test_strict_less_keeps_the_first_minimum_in_scan_order():
    lb = DPLoadBalancer(4)
    lb.on_publish([[0, 5, 0.0], [0, 2, 0.0], [0, 9, 0.0], [0, 2, 0.0]])
    lb.eng_start_index = 2  # scan 2, 3, 0, 1: engines 3 and 1 tie at 2, 3 comes first
    assert lb.choose("a") == 3
    assert lb.eng_start_index == 3


def test_inflight_floor_scaled_by_client_count():
    lb = DPLoadBalancer(4, client_index=1, client_count=2)
    assert lb.eng_start_index == 2  # 4 * 1 // 2
    assert lb.choose("a") == 2
    assert lb.lb_engines[2][0] == 2  # the bump is client_count
    # engine 2: max(2 * 1, 2 + 0) = 2; the others 0
    assert lb.scores() == [0, 0, 2, 0]
    lb.on_publish([[0, 0, 0.0]] * 4)  # a stale publish erases the bump, not the in-flight floor
    assert lb.scores() == [0, 0, 2, 0]
    lb.on_finished("a")
    assert lb.scores() == [0, 0, 0, 0]


def test_pinned_rank_and_affinity_bypass_the_score_and_the_rotation():
    lb = DPLoadBalancer(3)
    assert lb.choose("a", data_parallel_rank=2) == 2
    assert lb.eng_start_index == 0 and lb.lb_engines[2][0] == 0  # no bump, no rotation
    assert lb.engine_inflight == [0, 0, 1]
    assert lb.choose("a") == 2  # the same id again: affinity (streaming input)
    assert lb.engine_inflight == [0, 0, 1]
    with pytest.raises(ValueError, match="data_parallel_rank"):
        lb.choose("b", data_parallel_rank=3)


def test_stale_counts_route_by_the_snapshot():
    lb = DPLoadBalancer(2)
    lb.on_publish([[0, 10, 0.0], [0, 0, 0.0]])  # engine 0 looked busy at the last publish
    assert [lb.choose(f"r{i}") for i in range(3)] == [1, 1, 1]
    # engine 1 now scores max(3, 3 + 0) = 3 (bumps), engine 0 still 10 from the snapshot
    assert lb.scores() == [10, 3]


def test_coordinator_publishes_100ms_after_a_change_else_every_5s():
    c = DPStatsCoordinator(2)
    assert c.next_publish_s(0.0) == 0.0  # nothing published yet: the first publish is due at once
    c.publish(0.0)
    assert c.next_publish_s(0.01) == pytest.approx(5.0)
    c.on_engine_stats(1, 3, 4, 0.2)
    assert c.next_publish_s(0.01) == pytest.approx(0.1)
    assert c.publish(0.1) == [[0, 0, 0.0], [3, 4, 0.2]]
    c.on_engine_stats(0, 1, 0, 0.0)  # a change long after the last publish goes out at once
    assert c.next_publish_s(0.7) == pytest.approx(0.7)


def test_engine_sends_counts_only_when_they_change():
    p = RequestCountsPublisher()
    assert p.maybe_publish(2, 1, 0.3) == (1, 2, 0.3)
    assert p.maybe_publish(2, 1, 0.9) is None  # kv usage alone does not trigger a send
    assert p.maybe_publish(3, 0, 0.9) == (0, 3, 0.9)


# -- property: the balancer against a reference from the rule's wording -----------------------------
class _ReferenceLB:
    """Written from many_engines.md §1.2 (the rule's wording), not from the implementation."""

    def __init__(self, n, client_index, client_count):
        self.n, self.cc = n, client_count
        self.rows = [[0, 0, 0.0] for _ in range(n)]
        self.inflight = {}
        self.per_engine = [0] * n
        self.start = n * client_index // client_count

    def pick(self, rid, pinned):
        if rid in self.inflight:
            return self.inflight[rid]
        if pinned is not None:
            e = pinned
        else:
            best, e = None, None
            for i in range(self.n):
                idx = (self.start + i) % self.n
                w, r, kv = self.rows[idx]
                s = max(self.cc * self.per_engine[idx], w + r)
                if w > 0:
                    s += w * 6.0 * max(0.0, kv - 0.5)
                if best is None or s < best:
                    best, e = s, idx
            self.rows[e][0] += self.cc
            self.start = (self.start + 1) % self.n
        self.inflight[rid] = e
        self.per_engine[e] += 1
        return e

    def finish(self, rid):
        if rid in self.inflight:
            self.per_engine[self.inflight.pop(rid)] -= 1

    def publish(self, rows):
        self.rows = [list(r) for r in rows]


_row = st.tuples(st.integers(0, 50), st.integers(0, 50), st.floats(0.0, 1.0))


@st.composite
def _lb_streams(draw):
    n = draw(st.integers(1, 6))
    cc = draw(st.integers(1, 4))
    ci = draw(st.integers(0, cc - 1))
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("pick"), st.integers(0, 40), st.one_of(st.none(), st.integers(0, n - 1))),
        st.tuples(st.just("finish"), st.integers(0, 40)),
        # a publish of any counts: stale or fresh, the balancer only sees the snapshot
        st.tuples(st.just("publish"), st.lists(_row, min_size=n, max_size=n))), max_size=80))
    return n, cc, ci, ops


@settings(max_examples=300, deadline=None)
@given(_lb_streams())
def test_balancer_matches_the_reference_on_random_stats_streams(stream):
    n, cc, ci, ops = stream
    lb, ref = DPLoadBalancer(n, ci, cc), _ReferenceLB(n, ci, cc)
    for op in ops:
        if op[0] == "pick":
            rid, pinned = f"r{op[1]}", op[2]
            assert lb.choose(rid, pinned) == ref.pick(rid, pinned)
        elif op[0] == "finish":
            lb.on_finished(f"r{op[1]}")
            ref.finish(f"r{op[1]}")
        else:
            lb.on_publish([list(r) for r in op[1]])
            ref.publish(op[1])
        assert lb.engine_inflight == ref.per_engine
        assert lb.lb_engines == ref.rows


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 9)), min_size=1, max_size=60))
def test_picks_minimise_the_score_seen(picks):
    """Whatever the stats, a scored pick's engine has the minimum score among all engines."""
    lb = DPLoadBalancer(4)
    for k, (kind, x) in enumerate(picks):
        if kind:
            lb.on_publish([[x % 3, x, 0.1 * x], [x, 0, 0.9], [0, 2 * x, 0.5], [1, 1, 0.6]])
        else:
            before = lb.scores()
            e = lb.choose(f"r{k}")
            assert before[e] == min(before)


# -- property: the coordinator's publish times against the poll loop -----------------------------------
def _reference_publish_times(arrivals, horizon):
    """`DPCoordinatorProc.process_input_socket`'s loop (coordinator.py:258-290) in ms, dense DP:
    wait_for = 100 if stats changed else 5000; poll(max(0, wait_for - elapsed)); a timeout publishes."""
    last, changed, now, i, out = -10**9, False, 0, 0, []
    while now <= horizon:
        timeout = max(0, (100 if changed else 5000) - (now - last))
        nxt = arrivals[i] if i < len(arrivals) else math.inf
        if nxt < now + timeout:  # a stats message arrives within the poll
            now, changed, i = max(now, nxt), True, i + 1
            continue
        now += timeout
        if now > horizon:
            break
        out.append(now)
        last, changed = now, False
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 12000), max_size=40))
def test_coordinator_publish_times_match_the_poll_loop(times):
    arrivals = sorted(times)
    horizon = 15000
    c = DPStatsCoordinator(1, min_interval_s=100, idle_interval_s=5000)  # ms, as the loop counts
    got, now = [], 0
    for t in [*arrivals, math.inf]:
        while c.next_publish_s(now) <= min(t, horizon):  # a publish due when stats arrive goes first
            now = c.next_publish_s(now)
            c.publish(now)
            got.append(now)
        if t > horizon:
            break
        now = max(now, t)
        c.on_engine_stats(0, 1, 0, 0.0)
    assert got == _reference_publish_times(arrivals, horizon)


def test_engine_score_formula():
    assert engine_score(0, 4, 1.0, 0, 1) == 4  # no waiting: no penalty however full the KV cache
    assert engine_score(3, 1, 0.75, 2, 3) == pytest.approx(6 + 3 * 6 * 0.25)
