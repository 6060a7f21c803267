"""trace.json (Perfetto): request slices packed onto bounded tracks, counter tracks, phase slices."""
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.testbed.perfetto import (_FIXED_LIMIT_S, MAX_REQUEST_TRACKS, _us, _us_texts, chrome_trace,
                                             pack_tracks)
from servetwin.core.testbed.step_table import STEP_COLUMNS, StepTable
from servetwin.core.testbed.trace import RequestTrace


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 20)), max_size=60), st.integers(1, 8))
def test_packed_spans_never_overlap_on_a_track_and_use_at_most_max_tracks(raw, max_tracks):
    spans = [(a, a + d) for a, d in raw]
    tracks = pack_tracks(spans, max_tracks)
    by_track: dict[int, list] = {}
    for span, t in zip(spans, tracks):
        if t is not None:
            assert 0 <= t < max_tracks
            by_track.setdefault(t, []).append(span)
    for placed in by_track.values():
        placed.sort()
        assert all(b[0] >= a[1] for a, b in zip(placed, placed[1:]))
    # a span is left out only when every track is busy at its start
    for span, t in zip(spans, tracks):
        if t is None:
            busy = {tt for s2, tt in zip(spans, tracks) if tt is not None and s2[0] <= span[0] < s2[1]}
            assert len(busy) == max_tracks


def test_sequential_requests_share_one_track():
    assert pack_tracks([(0, 1), (1, 2), (2, 3)]) == [0, 0, 0]
    assert pack_tracks([(0, 5), (1, 2), (3, 4)]) == [0, 1, 1]


def _req(i, arrival, sched, first, finish):
    t = RequestTrace(f"r{i}", None, arrival, 10, sched, first, finish)
    t.output_tokens = 3
    return t


def _step(i, t0, t1, preempted=0):
    row = dict.fromkeys(STEP_COLUMNS, 0)
    row.update({"run": "r", "backend": "sim", "annotation": "execute_context_1(10)_generation_0(0)", "t_start_s": t0,
                "t_end_s": t1, "duration_s": t1 - t0, "step": i, "total_tokens": 10, "num_running": 1,
                "num_waiting": 2, "num_preempted": preempted, "kv_usage": 0.5, "num_context_tokens": 10})
    return row


def test_trace_has_counters_preemptions_and_bounded_request_tracks():
    reqs = [_req(i, 0.0, 0.1, 0.2, 1.0) for i in range(MAX_REQUEST_TRACKS + 10)]  # all overlap
    doc = chrome_trace("r", "sim", StepTable.from_rows([_step(0, 0.0, 0.1), _step(1, 0.1, 0.2, preempted=2)]), reqs)
    json.dumps(doc)
    ev = doc["traceEvents"]
    counters = [e for e in ev if e["ph"] == "C"]
    assert {"running", "waiting", "KV usage %", "prefill tokens", "decode tokens"} <= set(counters[0]["args"])
    assert len(counters) == 3  # one per step plus the closing zero
    assert [e["args"]["preempted"] for e in ev if e["ph"] == "i"] == [2]
    req_slices = [e for e in ev if e["ph"] == "X" and e["pid"] == 2 and e["name"].startswith("r")]
    assert len(req_slices) == MAX_REQUEST_TRACKS
    assert len({e["tid"] for e in req_slices}) == MAX_REQUEST_TRACKS
    assert doc["otherData"]["requests_left_out"] == 10
    phases = [e["name"] for e in ev if e["ph"] == "X" and e["pid"] == 2 and e["tid"] == 1]
    assert phases == ["r0", "queue", "prefill", "decode"]
    names = [e["args"]["name"] for e in ev if e["name"] == "process_name"]
    assert any("64 of 74" in n for n in names)


# `_us_texts` (trace.json's step times as text, '%.3f' without trailing zeros where every value is below
# `_FIXED_LIMIT_S`) is `repr(_us(v))`: json's spelling of the rounded microseconds, for any finite value
_times = st.one_of(st.floats(-2 * _FIXED_LIMIT_S, 2 * _FIXED_LIMIT_S, allow_nan=False),
                   st.floats(-1e-3, 1e-3),  # rounds to 0.0, -0.0, +-0.001 ...
                   st.integers(-2 * 10 ** 9, 2 * 10 ** 9).map(lambda k: k / 2e9),  # halfway cases of the 3rd decimal
                   st.integers(-10 ** 6, 10 ** 6).map(float),  # whole seconds: "N.0" microseconds
                   st.sampled_from([0.0, -0.0, _FIXED_LIMIT_S, -_FIXED_LIMIT_S, 999_999.9999995, 1e-9, 5e-10]),
                   st.floats(-1e280, 1e280, allow_nan=False))


@settings(max_examples=500, deadline=None)
@given(st.lists(_times, max_size=8))
def test_step_times_as_text_are_the_repr_of_the_rounded_microseconds(values):
    assert _us_texts(values) == [repr(_us(v)) for v in values]
