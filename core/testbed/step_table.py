"""The step rows of a trace, stored by column: what `TraceRecorder.steps` holds.

A run of 100,000 requests records ~280,000 steps; as one dict per row (26 keys, boxed numbers) they
took ~700 B each, ~200 MB. Here each numeric column is a typed `array` (8 B a value) and the text
columns lists of shared strings (a step's annotation repeats: one string object per distinct value),
~220 B a row. The tables written (`to_frame`) are the same: int64 columns for the counts, float64 for
times and KV usage, object for text. A value that does not fit its column's array (None, a float in
a count column, an int beyond 2**53 in a float one) turns that column into a plain list, so nothing is
coerced but an int time (SimPy's clock starts at int 0), held as its float, and a bool count, as 0/1.
"""
from __future__ import annotations

import operator
from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

STEP_COLUMNS = [
    "run", "backend", "step", "t_start_s", "t_end_s", "duration_s", "num_reqs", "num_context_reqs",
    "num_context_tokens", "num_generation_reqs", "num_generation_tokens", "total_tokens", "annotation",
    "sum_q2", "sum_q_kv", "sum_kv", "max_kv", "num_running", "num_waiting", "num_preempted", "num_finished",
    "kv_free_blocks", "kv_usage", "prefix_queries", "prefix_hits", "shared_kv_tokens",
]
_TEXT = ("run", "backend", "annotation")
_FLOAT = ("t_start_s", "t_end_s", "duration_s", "kv_usage")
_FLOAT_VALUES = operator.itemgetter(*(STEP_COLUMNS.index(name) for name in _FLOAT))
_INDEX = {name: i for i, name in enumerate(STEP_COLUMNS)}

Column = Union[array, list]
_MAX_PENDING = 1024  # buffered rows at most (a run of fused steps that nobody reads: bounded memory)


def _new_column(name: str) -> Column:
    if name in _TEXT:
        return []
    return array("d" if name in _FLOAT else "q")


class StepTable:
    """Step rows (STEP_COLUMNS) by column. Rows go in with `append` (values in STEP_COLUMNS order) or
    `append_row` (a mapping); `row(i)` / iteration give them back as dicts, `to_frame()` as a table."""

    __slots__ = ("_columns", "_strings", "_appends", "_pending")

    def __init__(self) -> None:
        self._columns: dict[str, Column] = {name: _new_column(name) for name in STEP_COLUMNS}
        self._strings: dict[str, str] = {}  # one object per distinct text value
        # rows from `append_interned` not yet in the columns (each reader flushes them first: one extend per
        # column for many rows instead of 26 appends per row)
        self._pending: list[Sequence[Any]] = []
        self._bind()

    def _bind(self) -> None:
        self._appends = [col.append for col in self._columns.values()]  # (the per-step hot path)

    def __getstate__(self) -> tuple:
        self._flush()
        return self._columns, self._strings

    def __setstate__(self, state: tuple) -> None:
        self._columns, self._strings = state
        self._pending = []
        self._bind()

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> "StepTable":
        table = cls()
        for row in rows:
            table.append_row(row)
        return table

    def __len__(self) -> int:
        return len(self._columns["step"]) + len(self._pending)

    def append(self, values: Sequence[Any]) -> int:
        """Add one row (values in STEP_COLUMNS order); returns its index."""
        self._flush()
        n = len(self)
        a, b, c, d = _FLOAT_VALUES(values)
        if type(a) is float and type(b) is float and type(c) is float and type(d) is float:  # (else: checked)
            self._append_unchecked(n, values)
        else:
            self._append_checked(values)
        strings = self._strings
        for name in _TEXT:  # a text value repeated over steps is held once
            col = self._columns[name]
            value = col[n]
            if type(value) is str:
                col[n] = strings.setdefault(value, value)
        return n

    def intern(self, text: str) -> str:
        """The table's one object for this text value (what `append` stores for it)."""
        return self._strings.setdefault(text, text)

    def append_interned(self, values: Sequence[Any]) -> int:
        """`append` of a row whose text values come from `intern` and whose four float values are
        floats (the simulator's fused decode steps: one row per step, the per-value checks skipped).
        The row is stored as `append` stores it (buffered: it reaches the columns when anything reads
        the table; the table keeps `values`, which must not change)."""
        pending = self._pending
        n = len(self._columns["step"]) + len(pending)
        pending.append(values)
        if len(pending) >= _MAX_PENDING:
            self._flush()
        return n

    def _flush(self) -> None:
        """The buffered rows into the columns, as `_append_unchecked` of each would store them."""
        rows = self._pending
        if not rows:
            return
        self._pending = []
        self._extend(list(zip(*rows)))

    def extend_interned(self, columns: Sequence[Sequence[Any]]) -> int:
        """Several rows at once, given by column (one sequence per STEP_COLUMNS name, all of one length),
        with `append_interned`'s conditions on every row; the rows are stored as `append_interned` of each
        would store them (they go to the columns at once, after the rows buffered before them). Returns the first
        new row's index."""
        # (speed: a step window's rows go to the columns column by column, each column's values converted while
        # they are still in the CPU's caches: the 16-instance ladder's first 6,573 requests spent ~7% less in
        # `on_implicit_steps` and `append_interned` than with the window's rows buffered as row tuples, transposed
        # back at a later flush; the rows are stored as `_extend` of them with the rows buffered before would
        # store them)
        self._flush()
        n = len(self._columns["step"])
        self._extend(columns)
        return n

    def _extend(self, columns: Sequence[Sequence[Any]]) -> None:
        """Rows given by column into the columns as they are; row by row (`_append_unchecked`) only when an
        array refuses a value."""
        n = len(self._columns["step"])
        try:
            for col, values in zip(self._columns.values(), columns):
                if type(col) is array:  # (fromlist: faster than extend; all or nothing)
                    col.fromlist(values if type(values) is list else list(values))
                else:
                    col.extend(values)
        except (TypeError, OverflowError):  # a value a count column's array cannot hold: row by row
            self._truncate(n)
            for i, values in enumerate(zip(*columns)):
                self._append_unchecked(n + i, values)

    def _append_unchecked(self, n: int, values: Sequence[Any]) -> None:
        """Row `n` into the columns as they are; checked value by value only when an array refuses one."""
        try:
            for append, value in zip(self._appends, values):
                append(value)
        except (TypeError, OverflowError):  # a value a count column's array cannot hold
            self._truncate(n)
            self._append_checked(values)

    def _append_checked(self, values: Sequence[Any]) -> None:
        """`append`, each value checked: a column whose array cannot hold it exactly becomes a list."""
        for name, value in zip(STEP_COLUMNS, values):
            col = self._columns[name]
            if not isinstance(col, list) and not _fits(col, value):
                col = self._columns[name] = list(col)
            col.append(value)
        self._bind()

    def append_row(self, row: Mapping[str, Any]) -> int:
        return self.append([row[name] for name in STEP_COLUMNS])

    def extend_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            self.append_row(row)

    def _truncate(self, n: int) -> None:
        """The columns cut to their first `n` rows (the buffered rows are not in them)."""
        for col in self._columns.values():
            del col[n:]

    def get(self, i: int, name: str) -> Any:
        # (speed: the trace reads each processed step's end; the buffered rows are flushed only when the row
        # read is one of them and not in a float column - `append_interned` rows hold floats there, which the
        # column stores as they are; a row already in the columns is what a flush leaves it)
        pending = self._pending
        if pending:
            n = len(self._columns["step"])
            if 0 <= i < n:
                return self._columns[name][i]
            if i >= n and name in _FLOAT:
                return pending[i - n][_INDEX[name]]
            self._flush()
        return self._columns[name][i]

    def add(self, i: int, name: str, delta: int) -> None:
        """Row `i`'s `name` += `delta` (a count learnt after the row was recorded)."""
        n = len(self._columns["step"])
        if not 0 <= i < n:  # (speed: a row in the columns changes in place, as after
            # a flush of the buffered rows behind it, which go to the column as it is then)
            pending = self._pending
            j = i - n
            col = self._columns[name]
            if 0 <= j < len(pending) and type(col) is array and col.typecode == "q":
                # (speed: a buffered row - a finish's count on its step's row, most often one of a step
                # window's - changes in the buffer, replaced by a copy, when its int value and the new one fit
                # the column's array: what the flush and the change in the column would store; else as before)
                row = pending[j]
                c = _INDEX[name]
                old = row[c]
                if type(old) is int and _fits(col, old + delta):
                    pending[j] = (*row[:c], old + delta, *row[c + 1:])
                    return
            self._flush()
        col = self._columns[name]
        value = col[i] + delta
        if not isinstance(col, list) and not _fits(col, value):
            self._flush()  # (the buffered rows go in before the column becomes a list, as they always did)
            col = self._columns[name]
            if not isinstance(col, list):
                col = self._columns[name] = list(col)
                self._bind()
        col[i] = value

    def column(self, name: str) -> Column:
        """Every row's `name`, in row order (the table's own storage: read, do not modify)."""
        self._flush()
        return self._columns[name]

    def row(self, i: int) -> dict[str, Any]:
        self._flush()
        return {name: col[i] for name, col in self._columns.items()}

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"step row {i} of {len(self)}")
        return self.row(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._flush()
        names = list(self._columns)
        for values in zip(*self._columns.values()):
            yield dict(zip(names, values))

    def to_frame(self, columns: Sequence[str] = STEP_COLUMNS) -> Any:
        """The rows as a pandas DataFrame with STEP_COLUMNS (what `pd.DataFrame(rows)` gave from dicts);
        `columns`: that table's columns of these names alone (in STEP_COLUMNS order)."""
        import numpy as np  # noqa: PLC0415  (lazy, like pandas)
        import pandas as pd  # noqa: PLC0415

        self._flush()
        names = [name for name in STEP_COLUMNS if name in columns]
        if len(names) != len(set(columns)):
            raise KeyError(f"StepTable.to_frame: no step column {sorted(set(columns) - set(names))}")
        if not len(self):  # (no rows: every column of the empty table is object, as from no dicts)
            return pd.DataFrame([], columns=names)
        data = {}
        for name in names:
            col = self._columns[name]
            if type(col) is list:
                data[name] = col
            else:  # a copy out of the array's buffer (the array may still grow)
                data[name] = np.frombuffer(col, dtype=np.float64 if col.typecode == "d" else np.int64).copy()
        return pd.DataFrame(data, columns=names)


def _fits(col: array, value: Any) -> bool:
    """Whether `value` is stored in `col` exactly (an int in an int column, a number in a float one)."""
    if col.typecode == "d":
        return type(value) in (float, int) and (type(value) is float or abs(value) < 2 ** 53)
    return type(value) is int and -(2 ** 63) <= value < 2 ** 63


__all__ = ["StepTable", "STEP_COLUMNS"]
