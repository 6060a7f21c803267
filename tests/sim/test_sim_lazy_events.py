"""`LazyDecodes`' event bookkeeping read fast: `in_place_run` (the members' first terminal event, from a heap),
`next_event_step` (min over the event steps) and `visit_due` (`due` after `peek_due`, without its list) give
what their definitions over every member and event bucket give."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.sim.lazy_decode import LazyDecodes


class _Source:
    def lazy_eligible(self, request: Request) -> bool:
        return True

    def lazy_tokens(self, request_id: str, n: int) -> list[int]:
        return [7] * n


def _request(i: int) -> Request:
    r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=500), arrival_time=0.0)
    r.num_computed_tokens = 3
    return r


def _decodes() -> LazyDecodes:
    return LazyDecodes(_Source(), block_size=4, max_model_len=4096, async_scheduling=True, caching=True)


# ops: (kind, request, a, b): join r with event step + a, terminal step + a + b; materialise r; advance r's
# event to step + a (at its event step only: as the scheduler does); move to the next step (`due` or
# `peek_due` + `visit_due`, both tables alike)
_op = st.tuples(st.sampled_from(["join", "leave", "advance", "step", "skip"]), st.integers(0, 5), st.integers(1, 6),
                st.integers(0, 8))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=60), limit=st.integers(1, 20))
def test_event_reads_equal_their_definitions(ops, limit):
    a, b = _decodes(), _decodes()  # a: `due`; b: `peek_due` + `visit_due`
    requests = {i: (_request(i), _request(i)) for i in range(6)}
    step = 0
    for kind, i, x, y in ops:
        for lazy, r in zip((a, b), requests[i]):
            m = lazy.members.get(r.request_id)
            if kind == "join" and m is None:
                lazy.join(r, step, step + x, step + x + y)
            elif kind == "leave" and m is not None:
                lazy.materialise(m, step, step - 1)
            elif kind == "advance" and m is not None and m.event == step and m.event < m.terminal:
                lazy.advance(m, step, 1000, 0)
        if kind == "step":
            got_a = [m.request.request_id for m in a.due(step)]
            got_b = [m.request.request_id for m in b.peek_due(step)]
            b.visit_due(step)
            assert got_a == got_b
            assert (sorted(a._events), a._due_from) == (sorted(b._events), b._due_from)
            step += 1
        elif kind == "skip" and a.quiet_run(step, x) == x == b.quiet_run(step, x):
            a.skip_quiet(step, x)
            b.skip_quiet(step, x)
            step += x
        for lazy in (a, b):
            start = lazy._due_from
            steps = [k for k in lazy._events if start is None or k >= start]
            assert lazy.next_event_step() == (min(steps) if steps else None)
            lazy.flushed.clear()
            lazy.pending_update.clear()
            if lazy.members_only() and lazy._due_from == step:
                expected = min([limit] + [m.terminal - step for m in lazy.members.values()])
                assert lazy.in_place_run(step, limit) == max(0, expected)
