"""The recorder's vectorised inter-token latencies equal the per-request definition (RequestTrace.itls)."""
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.testbed import trace
from servetwin.core.testbed.step_table import STEP_COLUMNS
from servetwin.core.testbed.trace import DeliveryMap, RequestTrace, TraceRecorder

# step ends on a coarse grid so that requests share ends, repeat a token time, and miss deliveries
ends_st = st.lists(st.integers(0, 40), min_size=0, max_size=30).map(lambda xs: sorted(x * 0.25 for x in xs))
times_st = st.lists(st.lists(st.integers(0, 45).map(lambda x: x * 0.25), max_size=12).map(sorted), max_size=8)


def _recorder(token_times, delivery):
    rec = TraceRecorder("r", "sim", record_step_requests=False)
    for i, times in enumerate(token_times):
        rec.requests[f"r{i}"] = RequestTrace(f"r{i}", None, 0.0, 4, token_times=list(times))
    rec.set_delivery(delivery)
    return rec


def _loop(rec, delivery):
    out = []
    for t in rec.requests.values():
        out.extend(t.itls(delivery))
    return out


@settings(max_examples=150, deadline=None)
@given(token_times=times_st, ends=ends_st, lag=st.floats(0, 2), split=st.booleans(),
       jitter=st.sampled_from([0.0, 1e-12, 3e-10, 1e-6]), chunk=st.sampled_from([1, 3, 10, 1 << 20]))
def test_vectorised_itls_equal_the_per_request_definition(token_times, ends, lag, split, jitter, chunk):
    """(`chunk`: token times per vectorised pass; whole requests go in a pass, so 1 is one request each)"""
    saved, trace.ITL_CHUNK_TOKENS = trace.ITL_CHUNK_TOKENS, chunk
    try:
        _check_itls(token_times, ends, lag, split, jitter)
    finally:
        trace.ITL_CHUNK_TOKENS = saved


def _check_itls(token_times, ends, lag, split, jitter):
    delivery = DeliveryMap(split_first_chunk=split)
    shifted = sorted(e + jitter * (k % 2) for k, e in enumerate(ends))  # ends a hair off the token times
    for k, e in enumerate(shifted):  # client times rise with the end; a duplicated end keeps the latest
        delivery.add(e, e + lag + 0.01 * k)
    rec = _recorder(token_times, delivery)
    assert rec.itls() == _loop(rec, delivery)
    assert rec.engine_itls() == _loop(rec, None)
    _check_both(rec)
    plain = _recorder(token_times, None)
    assert plain.itls() == plain.engine_itls() == _loop(plain, None)
    _check_both(plain)
    # what the output process gets: one array of token times, the requests pickled as columns; token
    # times kept as indexes among the step ends when every one is a step's end (floats otherwise)
    twin = pickle.loads(pickle.dumps(rec.packed()))
    assert twin.itls() == rec.itls() and twin.engine_itls() == rec.engine_itls()
    for t_end in sorted({x for ts in token_times for x in ts} | set(shifted)):
        row = dict.fromkeys(STEP_COLUMNS, 0)
        row.update(run="r", backend="sim", annotation="", t_end_s=t_end)
        rec.steps.append_row(row)
    indexed = pickle.loads(pickle.dumps(rec.packed()))
    assert indexed._packed_token_times[1] is not None  # (the floats themselves: `twin` above)
    assert indexed.itls() == rec.itls() and indexed.engine_itls() == rec.engine_itls()
    _check_both(twin)
    _check_both(indexed)
    assert all(not t.token_times for t in twin.requests.values()) and rec.request_rows() == twin.request_rows()
    assert list(twin.requests) == list(rec.requests)
    times = [x for ts in token_times for x in ts]
    assert [None if v != v else v for v in delivery.client_times(times).tolist()] == \
        [delivery.client_time(t) for t in times]


def _check_both(rec):
    """`itl_arrays()` (one pass for both) is (`itl_array()`, `engine_itl_array()`): the same floats, in order."""
    client, engine = rec.itl_arrays()
    assert client.dtype == engine.dtype == rec.itl_array().dtype
    assert client.tolist() == rec.itl_array().tolist()
    assert engine.tolist() == rec.engine_itl_array().tolist()
