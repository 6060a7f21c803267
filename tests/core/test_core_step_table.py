"""StepTable (the trace's step rows by column) gives back what went in, and the same table pandas builds
from the rows as dicts; trace.json streamed is the document dumped in one go, byte for byte."""
import json
import pickle

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.testbed import perfetto
from servetwin.core.testbed.step_table import STEP_COLUMNS, StepTable
from servetwin.core.testbed.trace import RequestTrace

_FLOATS = {"t_start_s", "t_end_s", "duration_s", "kv_usage"}
_TEXT = {"run", "backend", "annotation"}


def _value(name):
    if name in _TEXT:
        return st.sampled_from(["a", "execute_context_1(10)_generation_0(0)", "b"])
    if name in _FLOATS:  # an int time (SimPy's clock starts at int 0) is a float in the table
        return st.one_of(st.floats(0, 1e4, allow_nan=False), st.just(0))
    return st.integers(0, 10 ** 6)


_row = st.fixed_dictionaries({name: _value(name) for name in STEP_COLUMNS})
# a column that holds something its array cannot (None, a float in a count column) becomes a list
_odd = st.tuples(st.sampled_from([c for c in STEP_COLUMNS if c not in _TEXT]),
                 st.sampled_from([None, 2.5, 2 ** 70]))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(_row, max_size=12), odd=st.lists(st.tuples(st.integers(0, 11), st.sampled_from(
    [c for c in STEP_COLUMNS if c not in _TEXT and c not in _FLOATS]), st.sampled_from([2 ** 70, -2 ** 70])),
    max_size=3), fast=st.lists(st.booleans(), min_size=12, max_size=12))
def test_append_interned_stores_what_append_stores(rows, odd, fast):
    """The fused steps' `append_interned` (interned text, float times) stores a row as `append` does, a count
    too large for its column's array included; mixed with `append` rows."""
    for i, name, value in odd:
        if i < len(rows):
            rows[i][name] = value
    a, b = StepTable(), StepTable()
    for row, quick in zip(rows, fast):
        values = [float(row[c]) if c in _FLOATS else row[c] for c in STEP_COLUMNS]
        a.append(values)
        if quick:
            b.append_interned([b.intern(v) if c in _TEXT else v for c, v in zip(STEP_COLUMNS, values)])
        else:
            b.append(values)
    assert list(a) == list(b)
    pd.testing.assert_frame_equal(a.to_frame(), b.to_frame(), check_exact=True)
    for name in _TEXT:  # one object per distinct text value
        assert len({id(v) for v in b.column(name)}) == len(set(b.column(name)))


_COUNTS = [c for c in STEP_COLUMNS if c not in _TEXT and c not in _FLOATS]


def _read_or_add(a, b, j, read, name, count, delta):
    """Read row j's `name` from both tables (the reference `a` flushed first) or add `delta` to its `count`."""
    a.column("step")
    if read:
        expected = a.get(j, name)
        got = b.get(j, name)
        assert got == expected and type(got) is type(expected)
    else:
        a.add(j, count, delta)
        b.add(j, count, delta)


def _assert_same_tables(a, b):
    assert list(a) == list(b)
    for name in STEP_COLUMNS:
        assert type(a.column(name)) is type(b.column(name))
    pd.testing.assert_frame_equal(a.to_frame(), b.to_frame(), check_exact=True)


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(_row, max_size=12), fast=st.lists(st.booleans(), min_size=12, max_size=12),
       ops=st.lists(st.tuples(st.integers(0, 11), st.booleans(), st.sampled_from(STEP_COLUMNS),
                              st.sampled_from(_COUNTS), st.sampled_from([1, 2 ** 70])), min_size=12, max_size=12))
def test_reads_and_adds_between_buffered_rows_are_the_flushed_tables(rows, fast, ops):
    """`get` and `add` with rows still buffered by `append_interned` (read without a flush when the row is in the
    columns already or is a buffered row's float; a count added in place, a too-large one turning its column
    into a list) give and store what they do on a table flushed before each call."""
    a, b = StepTable(), StepTable()  # a: flushed before every read and add (`column` flushes)
    for i, (row, quick, (j, read, name, count, delta)) in enumerate(zip(rows, fast, ops)):
        values = [float(row[c]) if c in _FLOATS else row[c] for c in STEP_COLUMNS]
        for table in (a, b):
            if quick:
                table.append_interned([table.intern(v) if c in _TEXT else v for c, v in zip(STEP_COLUMNS, values)])
            else:
                table.append(values)
        if j > i:
            continue
        _read_or_add(a, b, j, read, name, count, delta)
    _assert_same_tables(a, b)


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(_row, max_size=16), kinds=st.lists(st.sampled_from(["append", "interned", "window"]),
                                                        min_size=16, max_size=16),
       sizes=st.lists(st.integers(1, 4), min_size=16, max_size=16),
       ops=st.lists(st.tuples(st.integers(0, 15), st.booleans(), st.sampled_from(STEP_COLUMNS),
                              st.sampled_from(_COUNTS), st.sampled_from([1, 2 ** 70])), min_size=16, max_size=16))
def test_buffered_window_rows_read_and_add_as_the_rows_appended_one_by_one(rows, kinds, sizes, ops):
    """`extend_interned` (a step window's rows, buffered with the `append_interned` ones until a reader needs the
    columns) mixed with `append` and `append_interned`, with reads and adds in between: the same values, column
    kinds and frame as a table given each row by `append` and flushed before every read; the returned first
    index is the row's."""
    a, b = StepTable(), StepTable()
    i = 0
    for kind, size, (j, read, name, count, delta) in zip(kinds, sizes, ops):
        batch = [[float(row[c]) if c in _FLOATS else row[c] for c in STEP_COLUMNS] for row in rows[i:i + size]]
        if not batch:
            break
        if kind == "window":
            first = b.extend_interned([list(col) for col in zip(*[[b.intern(v) if c in _TEXT else v
                                                                    for c, v in zip(STEP_COLUMNS, values)]
                                                                   for values in batch])])
        else:
            batch = batch[:1]
            first = (b.append_interned([b.intern(v) if c in _TEXT else v for c, v in zip(STEP_COLUMNS, batch[0])])
                     if kind == "interned" else b.append(batch[0]))
        for k, values in enumerate(batch):
            assert a.append(values) == first + k
        i += len(batch)
        assert len(a) == len(b) == i
        if j >= i:
            continue
        _read_or_add(a, b, j, read, name, count, delta)
    _assert_same_tables(a, b)


def _numbered_row(i: int) -> list:
    return [{"run": "a", "backend": "b", "annotation": "x"}.get(c, float(i) + 0.5 if c in _FLOATS else i * 26 + k)
            for k, c in enumerate(STEP_COLUMNS)]


@settings(max_examples=20, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["append", "interned", "window"]),
                               st.sampled_from([1, 2, 5, 300, 1000, 1023, 1024, 1025, 2100])), max_size=8))
def test_buffered_rows_past_the_buffer_bound_keep_their_indices(plan):
    """Many rows: `append_interned`'s buffer past its bound (at 1,024 rows it goes to the columns), between
    `extend_interned` batches of up to 2,100 rows: every call returns its first row's index, each row's end reads
    back at it, and the table equals one given each row by `append`."""
    a, b = StepTable(), StepTable()
    i = 0
    for kind, size in plan:
        batch = [_numbered_row(i + k) for k in range(size if kind == "window" else 1)]
        if kind == "window":
            first = b.extend_interned([list(col) for col in zip(*[[b.intern(v) if c in _TEXT else v
                                                                    for c, v in zip(STEP_COLUMNS, values)]
                                                                   for values in batch])])
        elif kind == "interned":
            first = b.append_interned([b.intern(v) if c in _TEXT else v for c, v in zip(STEP_COLUMNS, batch[0])])
        else:
            first = b.append(batch[0])
        assert first == i
        for values in batch:
            a.append(values)
        i += len(batch)
        assert len(b) == i
        assert [b.get(j, "t_end_s") for j in (first, i - 1)] == [float(first) + 0.5, float(i - 1) + 0.5]
    _assert_same_tables(a, b)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(_row, max_size=12), odd=st.lists(st.tuples(st.integers(0, 11), _odd), max_size=3))
def test_rows_round_trip_and_frame_equals_pandas_from_dicts(rows, odd):
    for i, (name, value) in odd:
        if i < len(rows):
            rows[i][name] = value
    table = StepTable.from_rows(rows)
    assert len(table) == len(rows) and list(table) == rows
    assert [table[i] for i in range(-len(rows), 0)] == rows
    expected = pd.DataFrame(rows, columns=STEP_COLUMNS)
    for name in _FLOATS:  # from dicts a column of only ints stays int64; the table keeps times as floats
        # (an int past int64, e.g. 2**70, makes both object columns: nothing to convert)
        if len(rows) and all(isinstance(r[name], int) and -2**63 <= r[name] < 2**63 for r in rows):
            expected[name] = expected[name].astype(float)
    pd.testing.assert_frame_equal(table.to_frame(), expected, check_index_type=False)
    if rows and rows[-1]["num_finished"] is not None:
        table.add(len(rows) - 1, "num_finished", 1)
        rows[-1]["num_finished"] += 1
        assert list(pickle.loads(pickle.dumps(table))) == rows


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 30), preempt=st.lists(st.integers(0, 3), min_size=30, max_size=30),
       per_write=st.sampled_from([1, 2, 7, 20_000]), tracks=st.integers(1, 4))
def test_streamed_trace_is_the_document_dumped(tmp_path_factory, n, preempt, per_write, tracks):
    rows = []
    for i in range(n):
        row = dict.fromkeys(STEP_COLUMNS, 0)
        row.update(run="r", backend="sim", annotation=f"a{i % 3}", step=i, t_start_s=0.1 * i, t_end_s=0.1 * i + 0.07,
                   duration_s=0.07, num_preempted=preempt[i], kv_usage=0.01 * i, num_running=i)
        rows.append(row)
    reqs = [RequestTrace(f"q{i}", None, 0.05 * i, 8, 0.05 * i + 0.01, 0.05 * i + 0.02 if i % 4 else None,
                         0.05 * i + 0.3 if i % 3 else None) for i in range(n)]
    table = StepTable.from_rows(rows)
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    saved, perfetto.EVENTS_PER_WRITE = perfetto.EVENTS_PER_WRITE, per_write
    try:
        perfetto.write_chrome_trace(str(path), "r", "sim", table, reqs, tracks)
    finally:
        perfetto.EVENTS_PER_WRITE = saved
    doc = perfetto.chrome_trace("r", "sim", table, reqs, tracks)
    assert path.read_text() == json.dumps(doc, separators=(",", ":"))


# the engine's step events are written as text (`perfetto._engine_event_texts`, a speed path): whatever the
# rows hold - odd values that turn a column into a list, non-finite or huge floats, negative durations, text
# that json escapes - the file is still `json.dumps` of the dict document, byte for byte
_wide_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-1e4, 1e4), st.just(0))
_wide_row = st.fixed_dictionaries({
    name: (st.sampled_from(["a", 'q"\\\n', "é→", "execute_context_1(10)_generation_0(0)"]) if name in _TEXT
           else _wide_float if name in _FLOATS else st.integers(0, 2 ** 62)) for name in STEP_COLUMNS})


_odd_count = st.tuples(st.sampled_from([c for c in STEP_COLUMNS if c not in _TEXT | _FLOATS]),
                       st.sampled_from([None, 2.5, 2 ** 70, True]))  # (a float column holds a float: the trace reads it)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(_wide_row, max_size=12), odd=st.lists(st.tuples(st.integers(0, 11), _odd_count), max_size=2),
       preempted=st.lists(st.integers(0, 3), min_size=12, max_size=12),
       per_text=st.integers(1, 13))  # steps per text (`perfetto.STEPS_PER_TEXT`): a preemption anywhere in one
def test_streamed_step_events_as_text_are_json_dumps(tmp_path_factory, rows, odd, preempted, per_text):
    for i, row in enumerate(rows):
        row["num_preempted"] = preempted[i]
    for i, (name, value) in odd:
        if i < len(rows):
            rows[i][name] = value
    table = StepTable.from_rows(rows)
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    saved, perfetto.STEPS_PER_TEXT = perfetto.STEPS_PER_TEXT, per_text
    try:
        perfetto.write_chrome_trace(str(path), "r", "sim", table, [], 2)
    finally:
        perfetto.STEPS_PER_TEXT = saved
    doc = perfetto.chrome_trace("r", "sim", table, [], 2)
    assert path.read_text() == json.dumps(doc, separators=(",", ":"))


@settings(max_examples=20, deadline=None)
@given(rows=st.lists(_row, min_size=1, max_size=8), n=st.integers(1, 3))
def test_cluster_trace_with_text_step_events_equals_the_dict_encoding(tmp_path_factory, rows, n):
    engines = [(f"e{k}", StepTable.from_rows(rows[k:]), []) for k in range(n)]
    folder = tmp_path_factory.mktemp("cluster")
    perfetto.write_cluster_trace(str(folder / "fast.json"), "r", engines, [(0.5, "q1", "e0")])
    saved, perfetto._engine_event_texts = perfetto._engine_event_texts, lambda steps, pid: None  # all dicts
    try:
        perfetto.write_cluster_trace(str(folder / "dicts.json"), "r", engines, [(0.5, "q1", "e0")])
    finally:
        perfetto._engine_event_texts = saved
    assert (folder / "fast.json").read_text() == (folder / "dicts.json").read_text()
    assert any(type(e) is str for e in perfetto._engine_stream(engines[0][1], 1))  # the text path ran


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(_row, max_size=8), odd=st.lists(_odd, max_size=2),
       columns=st.lists(st.sampled_from(STEP_COLUMNS), min_size=1, unique=True))
def test_a_frame_of_some_columns_is_those_columns_of_the_whole_frame(rows, odd, columns):
    """`to_frame(columns)`: the whole table's columns of those names, in STEP_COLUMNS order (what a reader of a
    few columns builds instead of the whole table); an unknown name raises."""
    table = StepTable()
    for k, row in enumerate(rows):
        if odd and k == 0:
            row = {**row, odd[0][0]: odd[0][1]}
        table.append_row(row)
    whole, part = table.to_frame(), table.to_frame(columns)
    assert part.columns.tolist() == [c for c in STEP_COLUMNS if c in columns]
    pd.testing.assert_frame_equal(part, whole[part.columns.tolist()], check_exact=True)
    with pytest.raises(KeyError):
        table.to_frame(columns + ["no_such_column"])
