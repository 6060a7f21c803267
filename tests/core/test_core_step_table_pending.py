"""StepTable's buffered rows: `get` and `add` on a row still in the buffer (no flush) give and store what they
give and store once the row is in the columns - the normal steps' rows join the fused steps' buffer."""
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.testbed.step_table import STEP_COLUMNS, StepTable

_FLOATS = {"t_start_s", "t_end_s", "duration_s", "kv_usage"}
_TEXT = {"run", "backend", "annotation"}
_COUNTS = [c for c in STEP_COLUMNS if c not in _FLOATS and c not in _TEXT]


def _value(name):
    if name in _TEXT:
        return st.sampled_from(["a", "execute_context_1(10)_generation_0(0)"])
    if name in _FLOATS:
        return st.floats(0, 1e4, allow_nan=False)
    return st.integers(0, 10 ** 6)


# now and then a count its column's array cannot hold (too large, None, a float) or a bool
_odd = st.lists(st.tuples(st.sampled_from(_COUNTS), st.sampled_from([2 ** 70, True, None, 2.5])), max_size=1)
_row = st.builds(lambda row, odd: {**row, **dict(odd)},
                 st.fixed_dictionaries({name: _value(name) for name in STEP_COLUMNS}), _odd)
_query = st.one_of(  # a row from the end (-1: the last), a column, and for `add` a delta
    st.tuples(st.just("get"), st.integers(-4, 1)),  # (every column)
    st.tuples(st.just("add"), st.integers(-4, 1), st.sampled_from(_COUNTS + ["t_end_s"]),
              st.sampled_from([1, 1, 3, 2 ** 64, True])),
    st.tuples(st.just("flush")))
# each step: a row (through append_interned or append), then reads and updates of the last rows
_step = st.tuples(_row, st.booleans(), st.lists(_query, max_size=3))


def _append(table: StepTable, row: dict, interned: bool) -> int:
    values = [row[c] for c in STEP_COLUMNS]
    if interned:
        return table.append_interned(tuple(table.intern(v) if c in _TEXT else v
                                           for c, v in zip(STEP_COLUMNS, values)))
    return table.append(values)


def _query_result(table: StepTable, query, flush_first: bool):
    """`get` / `add` on `table`; `flush_first`: the rows flushed into the columns before (the reference)."""
    if flush_first:
        table.column("step")  # (a read flushes the buffer)
    i = len(table) + query[1]  # (past the end: an IndexError, or a negative index)
    try:
        if query[0] == "get":
            return [(type(v), v) for v in (table.get(i, name) for name in STEP_COLUMNS)]
        return table.add(i, query[2], query[3])
    except (IndexError, TypeError) as exc:
        return type(exc)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(_step, max_size=12))
def test_buffered_get_and_add_equal_flushed_ones(steps):
    fast, ref = StepTable(), StepTable()
    for row, interned, queries in steps:
        assert _append(fast, row, interned) == _append(ref, row, interned)
        for query in queries:
            if query[0] == "flush":
                fast.column("step")
                continue
            assert _query_result(fast, query, False) == _query_result(ref, query, True), query
    assert list(fast) == list(ref)
    assert [type(fast.column(c)) for c in STEP_COLUMNS] == [type(ref.column(c)) for c in STEP_COLUMNS]
    assert [list(fast.column(c)) for c in STEP_COLUMNS] == [list(ref.column(c)) for c in STEP_COLUMNS]
