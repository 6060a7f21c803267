"""`TraceRecorder.on_implicit_steps` (n fused decode steps recorded in one call, `StepTable.extend_interned`)
leaves the recorder exactly as n `on_implicit_step` calls do: every step row column by column (floats with ==),
the steps awaiting their output, the step ends kept for late tokens, the carried preemptions."""
import pickle
from array import array

from hypothesis import given, settings, strategies as st

from servetwin.core.engine.engine_core import StepResult
from servetwin.core.sched.output import CachedRequestData, ImplicitDecodes, SchedulerOutput
from servetwin.core.testbed.step_table import STEP_COLUMNS, StepTable
from servetwin.core.testbed.trace import DeliveryMap, TraceRecorder


def _state(rec: TraceRecorder) -> dict:
    """Everything the recorder holds, the step table by column (storage kind included)."""
    state = rec.__getstate__()
    steps = state.pop("steps")
    state["steps"] = {name: (type(col), getattr(col, "typecode", None), list(col))
                      for name in STEP_COLUMNS for col in [steps.column(name)]}
    return state


def _prefix(rec: TraceRecorder, preempted: int, pending: bool) -> None:
    """What came before the run: `preempted` preemptions carried from a step with no row; `pending`: an async
    fused step (7) whose row waits for its output."""
    if preempted:
        so = SchedulerOutput([], CachedRequestData(), {}, 0, set(), set(), step=3,
                             preempted_order=[f"r{i}" for i in range(preempted)])
        rec.on_step(StepResult(scheduled=so), 0.5, 0.5)
    if pending:
        rec.on_implicit_step(7, 6, 1.0, 1.25, ImplicitDecodes(3, 90, 40), 3, 10, 0.5, 0, 6)


_times = st.lists(st.floats(1e-6, 0.5, allow_nan=False), min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(durations=_times, k=st.integers(1, 300), sum_before=st.integers(0, 10 ** 7),
       max_before=st.integers(-3, 10 ** 5), running=st.integers(1, 400), mode=st.sampled_from(["sync", "async", "none"]),
       preempted=st.integers(0, 3), pending=st.booleans(), int_start=st.booleans(), int_usage=st.booleans(),
       data=st.data())
def test_on_implicit_steps_equals_sequential_calls(durations, k, sum_before, max_before, running, mode, preempted,
                                                   pending, int_start, int_usage, data):
    """Sync (each step processes its own batch), async (the previous one's; the first processes the pending
    step or none), free blocks / usage / shared tokens changing within the run, a run starting at SimPy's int 0
    or with an int usage (the checked row path), huge aggregates (a column turned list), n = 0."""
    n = len(durations)
    t0 = 0 if int_start else 2.0
    t_starts, t_ends, t = [], [], t0
    for d in durations:
        t_starts.append(t)
        t = t + d
        t_ends.append(t)
    free = data.draw(st.lists(st.integers(0, 10 ** 6), min_size=n, max_size=n))
    usage = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    if int_usage and n:
        usage[-1] = 1
    shared = data.draw(st.lists(st.integers(0, 10 ** 5), min_size=n, max_size=n))
    huge = data.draw(st.sampled_from([0, 0, 0, 2 ** 63]))  # a sum beyond the int64 array: the column as a list
    implicit = ImplicitDecodes(k, sum_before + huge, max_before)
    first_step, first_sched = 8, 7
    processed = {"sync": first_step, "async": 7 if pending else 5, "none": None}[mode]

    seq, bulk = TraceRecorder("run", "sim"), TraceRecorder("run", "sim")
    for rec in (seq, bulk):
        _prefix(rec, preempted, pending)
    for i in range(n):
        seq.on_implicit_step(first_step + i, first_sched + i, t_starts[i], t_ends[i],
                             ImplicitDecodes(k, implicit.sum_computed_before + i * k, max_before + i), running,
                             free[i], usage[i], shared[i],
                             processed if i == 0 else (first_step + i if mode == "sync" else first_step + i - 1))
    bulk.on_implicit_steps(first_step, first_sched, t_starts, t_ends, implicit, running, free, usage, shared,
                           processed)
    assert _state(bulk) == _state(seq)
    # and both go on alike: the next step after the run
    nxt = first_step + n
    for rec in (seq, bulk):
        rec.on_implicit_step(nxt, first_sched + n, t, t + 0.1, ImplicitDecodes(k, 5, 5), running, 1, 0.25, 0,
                             nxt if mode == "sync" else nxt - 1)
    assert _state(bulk) == _state(seq)


def _rows_with_an_odd_value(n, odd, at, column):
    """n step rows (text, float and int columns) with `odd` put in row `at % n`'s `column`."""
    rows = [[f"x{c}" if name in ("run", "backend", "annotation") else
             (float(i + c) if name in ("t_start_s", "t_end_s", "duration_s", "kv_usage") else i + c)
             for c, name in enumerate(STEP_COLUMNS)] for i in range(n)]
    if n:
        rows[at % n][STEP_COLUMNS.index(column)] = odd
    return rows


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 6), odd=st.sampled_from([None, 2.5, 2 ** 70, 7]), at=st.integers(0, 5),
       column=st.sampled_from([c for c in STEP_COLUMNS if c not in ("run", "backend", "annotation")]))
def test_extend_interned_stores_what_append_stores(n, odd, at, column):
    """`StepTable.extend_interned` stores rows as `append_interned` of each row does, a value no array of its
    column holds included (that column becomes a list; the rows before it are kept once)."""
    rows = _rows_with_an_odd_value(n, odd, at, column)
    a, b = StepTable(), StepTable()
    rows = [[b.intern(v) if type(v) is str else v for v in row] for row in rows]
    a.append([1.0 if name in ("t_start_s", "t_end_s", "duration_s", "kv_usage") else 1 if name not in
              ("run", "backend", "annotation") else "y" for name in STEP_COLUMNS])
    b.append(list(a.row(0).values()))
    for row in rows:
        a.append_interned([a.intern(v) if type(v) is str else v for v in row])
    assert b.extend_interned([list(col) for col in zip(*rows)] if rows else [[] for _ in STEP_COLUMNS]) == 1
    assert list(b) == list(a)
    assert [type(b.column(c)) for c in STEP_COLUMNS] == [type(a.column(c)) for c in STEP_COLUMNS]
    assert all(not isinstance(b.column(c), array) or b.column(c).typecode == a.column(c).typecode
               for c in STEP_COLUMNS)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 6), odd=st.sampled_from([None, 2.5, 2 ** 70, 7]), at=st.integers(0, 5),
       column=st.sampled_from([c for c in STEP_COLUMNS if c not in ("run", "backend", "annotation")]),
       buffered=st.integers(0, 6))
def test_extend_interned_after_buffered_rows_stores_what_append_interned_stores(n, odd, at, column, buffered):
    """`extend_interned` after rows `append_interned` still buffers (both go to the columns in one extend) stores
    every row as `append_interned` of each does, a value no array of its column holds included - among the
    buffered rows or the new ones."""
    rows = _rows_with_an_odd_value(n, odd, at, column)
    a, b = StepTable(), StepTable()
    for row in rows:
        a.append_interned([a.intern(v) if type(v) is str else v for v in row])
    first, rest = rows[:buffered], [[b.intern(v) if type(v) is str else v for v in row] for row in rows[buffered:]]
    for row in first:
        b.append_interned([b.intern(v) if type(v) is str else v for v in row])
    start = b.extend_interned([list(col) for col in zip(*rest)] if rest else [[] for _ in STEP_COLUMNS])
    assert start == len(first)
    assert list(b) == list(a)
    assert [type(b.column(c)) for c in STEP_COLUMNS] == [type(a.column(c)) for c in STEP_COLUMNS]


_ROW_VALUES = {"t_start_s": 1.5, "t_end_s": 2.5, "duration_s": 1.0, "kv_usage": 0.25}


def _fused_row(i: int, odd) -> list:
    row = [f"t{c % 2}" if name in ("run", "backend", "annotation") else _ROW_VALUES.get(name, i + c)
           for c, name in enumerate(STEP_COLUMNS)]
    if odd is not None:
        row[STEP_COLUMNS.index(odd[0])] = odd[1]
    return row


_op = st.one_of(
    st.tuples(st.just("interned"), st.one_of(st.none(), st.tuples(st.sampled_from(["step", "sum_kv", "num_reqs"]),
                                                                  st.sampled_from([2 ** 64, 2.5, None])))),
    st.tuples(st.just("append"), st.none()), st.tuples(st.just("many"), st.integers(0, 1500)),
    st.tuples(st.sampled_from(["get", "add", "len", "column"]), st.integers(0, 10 ** 4)))


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(_op, max_size=30))
def test_buffered_rows_read_as_appended(ops):
    """`append_interned` buffers its rows (flushed into the columns by any read, or past 1,024 rows): every read
    - `get`, `add`, `len`, `column`, iteration, `to_frame`, pickling - sees what a table that stored each row at
    once (`_append_unchecked` row by row: the checked path for an odd value) holds, mixed with `append`."""
    buffered, direct = StepTable(), StepTable()
    i = 0
    for kind, arg in ops:
        if kind in ("interned", "append", "many"):
            rows = [_fused_row(i + j, arg if kind == "interned" else None)
                    for j in range(arg if kind == "many" else 1)]
            i += len(rows)
            for row in rows:
                if kind == "append":
                    buffered.append(row)
                else:
                    buffered.append_interned(tuple(buffered.intern(v) if type(v) is str else v for v in row))
                direct.append(row)
                assert len(buffered) == len(direct)
        elif kind == "len":
            assert len(buffered) == len(direct)
        elif len(direct):
            r = arg % len(direct)
            if kind == "get":
                assert buffered.get(r, "sum_kv") == direct.get(r, "sum_kv")
            elif kind == "add":
                buffered.add(r, "num_finished", 1)
                direct.add(r, "num_finished", 1)
            else:
                assert list(buffered.column("step")) == list(direct.column("step"))
    assert list(buffered) == list(direct)
    assert pickle.loads(pickle.dumps(buffered)).to_frame().equals(direct.to_frame())
    assert [type(buffered.column(c)) for c in STEP_COLUMNS] == [type(direct.column(c)) for c in STEP_COLUMNS]


@settings(max_examples=150, deadline=None)
@given(before=st.lists(st.floats(0.0, 10.0), max_size=3), times=st.lists(st.tuples(st.floats(0.0, 10.0),
       st.floats(0.0, 20.0)), max_size=30), ordered=st.booleans())
def test_delivery_map_add_many_equals_add(before, times, ordered):
    """`DeliveryMap.add_many` (a step window's deliveries at once) leaves the map as `add` of each pair in turn -
    step ends out of order included: the same ValueError, the pairs before it added."""
    if ordered:
        times = sorted(times)
    maps = [DeliveryMap(), DeliveryMap()]
    for m in maps:
        for t in sorted(before):
            m.add(t, t + 1.0)
    errors = []
    try:
        for t_engine, t_client in times:
            maps[0].add(t_engine, t_client)
    except ValueError as e:
        errors.append(str(e))
    try:
        maps[1].add_many([t for t, _ in times], [c for _, c in times])
    except ValueError as e:
        errors.append(str(e))
    assert len(errors) in (0, 2) and len(set(errors)) <= 1
    probes = [t for t, _ in times] + [t + 1e-12 for t, _ in times] + before
    assert [(m._ends, m._clients, [m.client_time(t) for t in probes]) for m in maps][0] \
        == [(m._ends, m._clients, [m.client_time(t) for t in probes]) for m in maps][1]


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e6, 1e6 + 1e-4]), st.floats(0.0, 1e7)),
                      max_size=20),
       probes=st.lists(st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e6, 1e6 + 1e-4, 0, 1, 3.0, None]),
                                 st.floats(0.0, 1e7)), max_size=10))
def test_delivery_map_client_time_is_the_latest_delivery_of_an_end(pairs, probes):
    """`client_time` of an end added (several times: the latest one's client time, as a dict by end gave it - the
    map keeps no such dict now) or of a time within 1e-9 (relative) of one (the first such end's); None otherwise."""
    m = DeliveryMap()
    pairs.sort(key=lambda p: p[0])
    for t_engine, t_client in pairs:
        m.add(t_engine, t_client)
    by_end = dict(pairs)
    for t in probes + [t for t, _ in pairs]:
        if t is None:
            expected = None
        elif t in by_end:
            expected = by_end[t]
        else:
            near = [c for e, c in pairs if abs(e - t) <= 1e-9 * max(1.0, abs(t))]
            expected = near[0] if near else None
        assert m.client_time(t) == expected


@settings(max_examples=200, deadline=None)
@given(recorded=st.lists(st.booleans(), max_size=25), ends=st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=25,
                                                                     max_size=25),
       late=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 12)), min_size=1, max_size=4))
def test_late_tokens_take_their_steps_ends_or_name_a_step_with_none(recorded, ends, late):
    """`on_late_tokens`: each token gets its step's end; a range with a step that kept no end (None: no
    implicit rows) or past the last one raises, as the check `None in times` decided (its faster form)."""
    import pytest  # noqa: PLC0415

    from servetwin.core.request import Request  # noqa: PLC0415
    from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415
    from servetwin.core.testbed.trace import LateTokens  # noqa: PLC0415
    rec = TraceRecorder(run="r", backend="sim")
    rec.on_arrival(Request("a", [1, 2], SamplingParams(max_tokens=5), arrival_time=0.0), 0.0)
    kept: list = []
    for step, has_rows in enumerate(recorded):
        if has_rows:  # a step with implicit rows keeps its end for their late tokens
            rec.on_implicit_step(step, step, ends[step] - 0.0, ends[step], ImplicitDecodes(1, 5, 5), 1, 1, 0.5, 0,
                                 None)
        kept.append(ends[step] if has_rows else None)
    while kept and kept[-1] is None:  # (the list ends at the last step with an end)
        kept.pop()
    want = list(rec.requests["a"].token_times)
    for first, n in late:
        times = kept[first:first + n]
        if len(times) != n or None in times:
            with pytest.raises(RuntimeError, match="no recorded end"):
                rec.on_late_tokens([LateTokens("a", first, n)])
            return
        rec.on_late_tokens([LateTokens("a", first, n)])
        want += times
        assert rec.requests["a"].token_times == want and rec.requests["a"].output_tokens == len(want)
