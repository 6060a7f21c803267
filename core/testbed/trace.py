"""Step and request traces, the same schema for the simulator and the torch backend (docs/architecture.md).

Timing boundaries, defined once for both backends:
- a step runs from `t_start` to `t_end` (simulated or measured seconds since the run started);
- a token's time is the `t_end` of the step that sampled it (in async mode the output is processed one
  step later, but the token still belongs to the step that computed it);
- TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1);
  E2E = finish - arrival; queue = first scheduled - engine arrival; ITL = gaps between a request's tokens.

Two boundaries, like `vllm bench serve` against `vllm serve`: `arrival_s` is when the client sent the
request and `engine_arrival_s` when it reached the engine; `first_token_s` / `finish_s` are when the
engine computed the first / last token, `client_first_token_s` / `client_finish_s` when the client
received them. `ttft_s`, `tpot_s`, `e2e_s` (and `itls()`) are client-boundary figures; the engine's
own are `engine_ttft_s`, `engine_tpot_s`, `engine_e2e_s` (from the engine arrival) and
`engine_itls()`. Without a modelled front end (the offline front end, the torch backend driven
in-process) both boundaries coincide. A modelled front end (`servetwin.sim.frontend`) gives the
recorder a `DeliveryMap`: the client time at which the tokens of the step that ended at engine time t
arrive.
"""
from __future__ import annotations

import bisect
import operator
import os
import dataclasses
from dataclasses import asdict, dataclass, field
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from servetwin.core.testbed.atomic import atomic_open, atomic_write_with
from servetwin.core.engine.engine_core import StepResult
from servetwin.core.testbed.iteration import IterationDetails, context_request_ids
from servetwin.core.request import Request
from servetwin.core.sched.output import ImplicitDecodes
from servetwin.core.testbed.step_table import STEP_COLUMNS, StepTable

STEP_REQUEST_COLUMNS = ["run", "backend", "step", "request_id", "num_tokens", "num_computed_before", "phase",
                        "samples"]


@dataclass(slots=True)
class LateTokens:
    """Tokens reported after their steps were processed: the outputs of `num_tokens` consecutive
    scheduler steps from `first_step` (`SchedulerOutput.scheduler_step`), one token each.

    The other half of the `servetwin.core.sched.output.ImplicitDecodes` contract: a scheduler that
    schedules rows implicitly reports their tokens this way (the simulator's implicit decodes). A
    step that can have such tokens is one with implicit rows; the recorder keeps its end time.
    """
    request_id: str
    first_step: int
    num_tokens: int


REQUEST_COLUMNS = [
    "run", "backend", "request_id", "parent_id", "arrival_s", "first_scheduled_s", "first_token_s",
    "finish_s", "prompt_tokens", "cached_tokens", "output_tokens", "num_preemptions", "finish_reason",
    "ttft_s", "tpot_s", "e2e_s", "queue_s",
    "engine_arrival_s", "client_first_token_s", "client_finish_s", "engine_ttft_s", "engine_tpot_s",
    "engine_e2e_s", "frontend_in_s",
]


def _drop_keys(d: dict[int, int], lo: int, hi: int) -> None:
    """`d.pop(key, None)` for every key in range(lo, hi) (speed: over the dict's keys when it holds fewer - the
    steps awaiting their output, a few - than a step window has steps)."""
    if len(d) < hi - lo:
        for key in [key for key in d if lo <= key < hi]:
            del d[key]
    else:
        for key in range(lo, hi):
            d.pop(key, None)


_FLOAT_ONLY = frozenset({float})  # (`on_implicit_steps`: a sequence of floats only)


class DeliveryMap:
    """Engine step end -> client receipt of that step's tokens (filled in step order by a front end).

    `split_first_chunk`: the first token reaches the client as two SSE events written back to back -
    the chat endpoint's role chunk (which `vllm bench serve` takes as the first token) and then the
    token's content - so the client's ITL list of every request starts with a gap of ~0."""

    def __init__(self, split_first_chunk: bool = False) -> None:
        self.split_first_chunk = split_first_chunk
        # step ends in the order added (non-decreasing: `add` raises otherwise) and their client times (speed: no
        # dict by end besides them - its inserts were ~0.8% of the 16-instance ladder's loop; `client_time`
        # bisects, ~2 lookups a request)
        self._ends: list[float] = []
        self._clients: list[float] = []

    def add(self, t_engine: float, t_client: float) -> None:
        ends = self._ends
        if ends and t_engine < ends[-1]:
            raise ValueError(f"DeliveryMap: step end {t_engine} added after {ends[-1]}")
        ends.append(t_engine)
        self._clients.append(t_client)

    def add_many(self, t_engines: Sequence[float], t_clients: Sequence[float]) -> None:
        """`add` of each pair in turn (speed: a step window's outputs at once, `ApiServerFrontend.on_step_outputs_at`;
        pair by pair, raising as `add` does, only when a step end would come before the one added before it)."""
        ends = self._ends
        if not t_engines:
            return
        if (ends and t_engines[0] < ends[-1]) or any(map(operator.lt, t_engines[1:], t_engines)):
            for t_engine, t_client in zip(t_engines, t_clients):
                self.add(t_engine, t_client)
            return
        ends += t_engines
        self._clients += t_clients

    def __len__(self) -> int:
        return len(self._ends)

    def client_time(self, t_engine: Optional[float]) -> Optional[float]:
        """When the client got the tokens computed at `t_engine` (None: never delivered)."""
        if t_engine is None:
            return None
        ends = self._ends
        i = bisect.bisect_right(ends, t_engine) - 1  # an exact end: the latest delivery added for it
        if i >= 0 and ends[i] == t_engine:
            return self._clients[i]
        tol = 1e-9 * max(1.0, abs(t_engine))
        i = bisect.bisect_left(ends, t_engine - tol)
        if i < len(ends) and abs(ends[i] - t_engine) <= tol:
            return self._clients[i]
        return None

    def client_times(self, t_engine):
        """`client_time` of every value of a float array at once (nan where it returns None)."""
        import numpy as np  # noqa: PLC0415  (lazy, like pandas in TraceRecorder.frames())

        t = np.asarray(t_engine, dtype=float)
        ends = np.asarray(self._ends, dtype=float)
        clients = np.asarray(self._clients, dtype=float)
        out = np.full(t.shape, np.nan)
        if not ends.size or not t.size:
            return out
        # an exact end: the dict's value, i.e. the latest delivery added for it
        last = np.searchsorted(ends, t, side="right") - 1
        exact = (last >= 0) & (ends[np.maximum(last, 0)] == t)
        out[exact] = clients[last[exact]]
        # otherwise the first end within the relative tolerance, as the bisect above finds it (only for
        # the values without an exact end: token times are step ends, so nearly all have one)
        rest = np.flatnonzero(~exact)
        if rest.size:
            tr = t[rest]
            tol = 1e-9 * np.maximum(1.0, np.abs(tr))
            i = np.searchsorted(ends, tr - tol, side="left")
            idx = np.minimum(i, ends.size - 1)
            near = (i < ends.size) & (np.abs(ends[idx] - tr) <= tol)
            out[rest[near]] = clients[idx[near]]
        return out

    @property
    def last_client_time(self) -> Optional[float]:
        return max(self._clients) if self._clients else None


@dataclass(slots=True)
class RequestTrace:
    request_id: str
    parent_id: Optional[str]
    arrival_s: float
    prompt_tokens: int
    first_scheduled_s: Optional[float] = None
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    cached_tokens: int = 0
    output_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: Optional[str] = None
    token_times: list[float] = field(default_factory=list)
    engine_arrival_s: Optional[float] = None  # None: the same as arrival_s (no front end in between)

    def _latencies(self, start: float, first: Optional[float], finish: Optional[float]
                   ) -> tuple[Optional[float], Optional[float], Optional[float]]:
        ttft = None if first is None else first - start
        e2e = tpot = None
        if finish is not None:
            e2e = finish - start
            if self.output_tokens > 1 and first is not None:
                tpot = (finish - first) / (self.output_tokens - 1)
        return ttft, tpot, e2e

    def row(self, run: str, backend: str, delivery: Optional[DeliveryMap] = None) -> dict[str, Any]:
        engine_in = self.arrival_s if self.engine_arrival_s is None else self.engine_arrival_s
        c_first, c_finish = self.first_token_s, self.finish_s
        if delivery is not None:
            c_first = delivery.client_time(self.first_token_s)
            if self.finish_reason != "abort":  # an abort is not a step's output
                c_finish = delivery.client_time(self.finish_s)
        ttft, tpot, e2e = self._latencies(self.arrival_s, c_first, c_finish)
        e_ttft, e_tpot, e_e2e = self._latencies(engine_in, self.first_token_s, self.finish_s)
        queue = None if self.first_scheduled_s is None else self.first_scheduled_s - engine_in
        return {"run": run, "backend": backend, "request_id": self.request_id, "parent_id": self.parent_id,
                "arrival_s": self.arrival_s, "first_scheduled_s": self.first_scheduled_s,
                "first_token_s": self.first_token_s, "finish_s": self.finish_s,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "output_tokens": self.output_tokens, "num_preemptions": self.num_preemptions,
                "finish_reason": self.finish_reason, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
                "queue_s": queue, "engine_arrival_s": engine_in, "client_first_token_s": c_first,
                "client_finish_s": c_finish, "engine_ttft_s": e_ttft, "engine_tpot_s": e_tpot,
                "engine_e2e_s": e_e2e, "frontend_in_s": engine_in - self.arrival_s}

    def itls(self, delivery: Optional[DeliveryMap] = None) -> list[float]:
        t = self.token_times
        if delivery is None:
            return [b - a for a, b in zip(t, t[1:])]
        t = [x for x in map(delivery.client_time, t) if x is not None]
        # tokens delivered together travel in one chunk: one ITL per chunk, as the client records it
        t = [x for i, x in enumerate(t) if i == 0 or x != t[i - 1]]
        gaps = [b - a for a, b in zip(t, t[1:])]
        return [0.0] + gaps if delivery.split_first_chunk and t else gaps


# RequestTrace's fields but its token times (request_id first): a packed recorder's pickled columns
_TRACE_FIELDS = tuple(f.name for f in dataclasses.fields(RequestTrace) if f.name != "token_times")


_NO_CONTEXT: frozenset[str] = frozenset()  # `_record_scheduled`'s context rows of a step that has none


def _has_gap(step_ends: list[Optional[float]]) -> bool:
    """Whether a step's end is missing (None) among `step_ends`, numbers otherwise. (speed: `sum`'s C loop adds
    floats without a comparison each and meets a None as a TypeError: ~6x faster than `None in step_ends`, which
    compares every float with None; `on_late_tokens` checks the steps of every implicit token of a request.)"""
    try:
        sum(step_ends)
    except TypeError:
        return True
    return False


class TraceRecorder:
    """Collects step rows, per-request step rows and request lifetimes while an engine runs."""

    def __init__(self, run: str, backend: str, record_step_requests: bool = True) -> None:
        self.run = run
        self.backend = backend
        self.record_step_requests = record_step_requests
        self.steps = StepTable()  # one row per step that scheduled tokens (STEP_COLUMNS), by column
        self.step_requests: list[tuple] = []
        self.requests: dict[str, RequestTrace] = {}
        self._step_rows: dict[int, int] = {}  # step -> its row's index, until its output is processed
        self._carried_preemptions = 0  # made in steps that scheduled nothing (no row of their own)
        # batch size -> on_implicit_step's details, their annotation, the run and the backend (interned)
        self._implicit_details: dict[int, tuple[IterationDetails, tuple[str, str, str]]] = {}
        self._t_end_by_step: list[Optional[float]] = []  # [scheduler step] -> t_end, for steps with implicit rows
        self.delivery: Optional[DeliveryMap] = None  # set by a modelled front end (set_delivery)
        self._packed_token_times: Optional[tuple] = None  # (values, index or None, lengths): `packed()`

    def on_arrival(self, request: Request, arrival_s: float, engine_arrival_s: Optional[float] = None) -> None:
        """`arrival_s`: the client sent the request; `engine_arrival_s`: it reached the engine (None:
        at once)."""
        self.requests[request.request_id] = RequestTrace(
            request.request_id, request.parent_id, arrival_s, request.num_prompt_tokens,
            engine_arrival_s=engine_arrival_s)

    def set_delivery(self, delivery: Optional[DeliveryMap]) -> None:
        """Client receipt times of each step's tokens (a modelled front end's); None: the engine's."""
        self.delivery = delivery

    def on_step(self, result: StepResult, t_start: float, t_end: float) -> None:
        so = result.scheduled
        if so is not None:
            self._record_scheduled(result, t_start, t_end)
        if result.processed is not None:
            self._record_processed(result)

    def _record_scheduled(self, result: StepResult, t_start: float, t_end: float) -> None:
        so, stats = result.scheduled, result.stats
        for rid in so.preempted_order:
            trace = self.requests.get(rid)
            if trace is not None:
                trace.num_preemptions += 1
        if so.total_num_scheduled_tokens == 0:
            # nothing ran, so no row; a preemption made while scheduling it (async scheduling can
            # preempt and then find nothing runnable) is carried to the next row
            self._carried_preemptions += len(so.preempted_order)
            return
        before = so.num_computed_before
        nst = so.num_scheduled_tokens
        # (speed: with no new request and every listed one past its prompt - most normal steps, listing one
        # decode row or none - there is no context row: `context_request_ids`' set is not built)
        ctx = (context_request_ids(so) if so.scheduled_new_reqs or 0 in so.scheduled_cached_reqs.num_output_tokens
               else _NO_CONTEXT)
        n_ctx = t_ctx = sum_q2 = sum_q_kv = sum_kv = max_kv = 0
        for rid, q in nst.items():  # one pass (hot): batch composition and the attention sums
            kv = before[rid] + q
            if rid in ctx:
                n_ctx += 1
                t_ctx += q
            sum_q2 += q * q
            sum_q_kv += q * kv
            sum_kv += kv
            if kv > max_kv:
                max_kv = kv
        num_reqs = len(nst)
        implicit = so.implicit_decodes
        if implicit is not None:  # unlisted decode rows (ImplicitDecodes): q = 1 after s tokens
            num_reqs += implicit.num_reqs
            sum_q2 += implicit.num_reqs
            kv_implicit = implicit.sum_computed_before + implicit.num_reqs
            sum_q_kv += kv_implicit
            sum_kv += kv_implicit
            max_kv = max(max_kv, implicit.max_computed_before + 1)
            ends, step = self._t_end_by_step, so.scheduler_step  # for their LateTokens
            if len(ends) <= step:
                ends.extend([None] * (step + 1 - len(ends)))
            ends[step] = t_end
        num_gen_tokens = so.total_num_scheduled_tokens - t_ctx
        texts: Optional[tuple[str, str, str]] = None
        if n_ctx == 0 and num_gen_tokens == num_reqs:
            # (speed: a decode batch - most normal steps of a cluster run - takes the details and interned texts
            # cached per batch size for the implicit rows' steps: the same values)
            details, texts = self._implicit_row_texts(num_reqs)
        else:
            details = IterationDetails(n_ctx, t_ctx, num_reqs - n_ctx, num_gen_tokens)
        if self.record_step_requests:
            mro = result.model_output
            sampling = ({rid for rid, toks in zip(mro.req_ids, mro.sampled_token_ids) if toks}
                        if mro is not None else set())
            self.step_requests.extend(
                (self.run, self.backend, so.step, rid, q, before[rid], "context" if rid in ctx else "generation",
                 rid in sampling) for rid, q in nst.items())
        for new in so.scheduled_new_reqs:  # only a new request can be scheduled for the first time
            trace = self.requests.get(new.req_id)
            if trace is not None:
                if trace.first_scheduled_s is None:
                    trace.first_scheduled_s = t_start
                if trace.num_preemptions == 0:
                    trace.cached_tokens = new.num_computed_tokens
        pcs = stats.prefix_cache_stats
        kv_usage = stats.kv_cache_usage
        interned = None
        if type(t_start) is float and type(t_end) is float and type(kv_usage) is float:
            # (speed: the row without `StepTable.append`'s per-value checks and its flush of the rows
            # buffered so far - the fused steps' - so that they reach the columns in larger batches;
            # the same stored row: its text values interned, its four float values floats)
            if texts is None:
                intern = self.steps.intern
                texts = (intern(details.annotation), intern(self.run), intern(self.backend))
            interned = texts
        self._step_rows[so.step] = self._append_row(
            so.step, t_start, t_end, num_reqs, details, so.total_num_scheduled_tokens, sum_q2, sum_q_kv, sum_kv,
            max_kv, stats.num_running_reqs, stats.num_waiting_reqs, len(so.preempted_order), stats.num_free_blocks,
            kv_usage, pcs.queries + pcs.preempted_queries, pcs.hits + pcs.preempted_hits,
            so.shared_kv_tokens, interned)

    def _append_row(self, step: int, t_start: float, t_end: float, num_reqs: int, details: IterationDetails,
                    total_tokens: int, sum_q2: int, sum_q_kv: int, sum_kv: int, max_kv: int, num_running: int,
                    num_waiting: int, num_preempted: int, num_free_blocks: int, kv_usage: float,
                    prefix_queries: int, prefix_hits: int, shared_kv_tokens: int,
                    interned: Optional[tuple[str, str, str]] = None) -> int:
        """Add a scheduled step's row (it takes the preemptions carried from steps with no row); its index.
        `interned`: the details' annotation, the run and the backend as `StepTable.intern` gave them, with
        float times (the row goes in without per-value checks)."""
        num_preempted += self._carried_preemptions
        self._carried_preemptions = 0
        if interned is not None:
            annotation, run, backend = interned
            append = self.steps.append_interned
        else:
            annotation, run, backend = details.annotation, self.run, self.backend
            append = self.steps.append
        # STEP_COLUMNS' order; num_finished is counted when the step's output is processed
        return append((
            run, backend, step, t_start, t_end, t_end - t_start, num_reqs,
            details.num_ctx_requests, details.num_ctx_tokens, details.num_generation_requests,
            details.num_generation_tokens, total_tokens, annotation,
            sum_q2, sum_q_kv, sum_kv, max_kv, num_running, num_waiting,
            num_preempted, 0, num_free_blocks, kv_usage, prefix_queries, prefix_hits, shared_kv_tokens))

    def on_implicit_step(self, step: int, scheduler_step: int, t_start: float, t_end: float,
                         implicit: ImplicitDecodes, num_running: int, num_free_blocks: int, kv_usage: float,
                         shared_kv_tokens: int, processed_step: Optional[int]) -> None:
        """`on_step` of a step whose batch is its implicit decode rows alone (no listed row, no one
        waiting, preempted or looked up in the prefix cache) and whose processed batch, if any
        (`processed_step`), has no output: the simulator's fused decode step (servetwin.sim.engine)."""
        k = implicit.num_reqs
        cached = self._implicit_details.get(k)
        if cached is None:
            cached = self._implicit_row_texts(k)
        details = cached[0]
        kv = implicit.sum_computed_before + k
        ends = self._t_end_by_step  # for their LateTokens
        if len(ends) <= scheduler_step:
            ends.extend([None] * (scheduler_step + 1 - len(ends)))
        ends[scheduler_step] = t_end
        max_kv = implicit.max_computed_before + 1
        index = self._append_row(step, t_start, t_end, k, details, k, k, kv, kv, max_kv if max_kv > 0 else 0,
                                 num_running, 0, 0, num_free_blocks, kv_usage, 0, 0, shared_kv_tokens,
                                 cached[1] if type(t_start) is float and type(kv_usage) is float else None)
        if processed_step != step:
            self._step_rows[step] = index
        if processed_step is not None:
            self._step_rows.pop(processed_step, None)

    def on_implicit_steps(self, first_step: int, first_scheduler_step: int, t_starts: Sequence[float],
                          t_ends: Sequence[float], implicit: ImplicitDecodes, num_running: int,
                          num_free_blocks: Sequence[int], kv_usage: Sequence[float],
                          shared_kv_tokens: Sequence[int], processed_step: Optional[int]) -> None:
        """`on_implicit_step` of n = len(t_starts) consecutive fused decode steps of the same rows, in one
        call: step i is engine step `first_step` + i and scheduler step `first_scheduler_step` + i, runs
        from t_starts[i] to t_ends[i], its aggregates are `implicit`'s grown by i steps (each row one
        token longer: `sum_computed_before` + i * `num_reqs`, `max_computed_before` + i), with
        `num_running` requests and the i-th free blocks, KV usage and shared tokens. The first step
        processes `processed_step`; the others process their own batch if the first did (sync
        scheduling), else the previous step's (async). The rows and state are those of the n calls
        (tests/core/test_core_trace_bulk.py)."""
        n = len(t_starts)
        if n == 0:
            return
        k = implicit.num_reqs
        if not (set(map(type, t_starts)) == _FLOAT_ONLY and set(map(type, kv_usage)) == _FLOAT_ONLY):
            # (speed: the types collected in C, not a generator per value; n > 0 here, so {float}: all floats)
            for i in range(n):  # (values the row checks: n single steps)
                self.on_implicit_step(
                    first_step + i, first_scheduler_step + i, t_starts[i], t_ends[i],
                    ImplicitDecodes(k, implicit.sum_computed_before + i * k, implicit.max_computed_before + i),
                    num_running, num_free_blocks[i], kv_usage[i], shared_kv_tokens[i],
                    processed_step if i == 0 else first_step + (i if processed_step == first_step else i - 1))
            return
        annotation, run, backend = self._implicit_row_texts(k)[1]
        last_sched = first_scheduler_step + n - 1
        ends = self._t_end_by_step  # for their LateTokens
        if len(ends) <= last_sched:
            ends.extend([None] * (last_sched + 1 - len(ends)))
        ends[first_scheduler_step:last_sched + 1] = t_ends
        kv0 = implicit.sum_computed_before + k
        max0 = implicit.max_computed_before + 1
        ks, zeros = [k] * n, [0] * n
        preempted = zeros
        if self._carried_preemptions:
            preempted = [self._carried_preemptions] + zeros[1:]
            self._carried_preemptions = 0
        kvs = list(range(kv0, kv0 + n * k, k)) if k else [kv0] * n
        # (on_implicit_step's max(0, ...): none of them below 0 in most runs)
        max_kvs = list(range(max0, max0 + n)) if max0 >= 0 else [m if m > 0 else 0 for m in range(max0, max0 + n)]
        first_row = self.steps.extend_interned((
            [run] * n, [backend] * n, list(range(first_step, first_step + n)), t_starts, t_ends,
            list(map(operator.sub, t_ends, t_starts)), ks, zeros, zeros, ks, ks, ks, [annotation] * n,
            ks, kvs, kvs, max_kvs, [num_running] * n, zeros, preempted, zeros, num_free_blocks, kv_usage, zeros, zeros,
            shared_kv_tokens))
        rows = self._step_rows
        last = first_step + n - 1
        if processed_step == first_step:  # sync: every step processes its own batch
            _drop_keys(rows, first_step, last + 1)
            return
        _drop_keys(rows, first_step, last)  # async: each row waits for the next step (set, then popped)
        rows[last] = first_row + n - 1
        if processed_step is not None:
            rows.pop(processed_step, None)

    def _implicit_row_texts(self, k: int) -> tuple[IterationDetails, tuple[str, str, str]]:
        """The details of a batch of `k` implicit rows, their annotation, the run and the backend (interned)."""
        cached = self._implicit_details.get(k)
        if cached is None:
            details = IterationDetails(0, 0, k, k)
            intern = self.steps.intern
            cached = self._implicit_details[k] = (details, (intern(details.annotation), intern(self.run),
                                                            intern(self.backend)))
        return cached

    def _record_processed(self, result: StepResult) -> None:
        row = self._step_rows.pop(result.processed.step, None)
        t_token = self.steps.get(row, "t_end_s") if row is not None else None
        requests = self.requests
        for out in result.outputs:
            trace = requests.get(out.request_id)
            if trace is None:
                continue
            num_new = len(out.new_token_ids)
            if num_new and t_token is not None:
                if trace.first_token_s is None:
                    trace.first_token_s = t_token
                if num_new == 1:
                    trace.token_times.append(t_token)
                else:
                    trace.token_times.extend([t_token] * num_new)
                trace.output_tokens += num_new
            if out.finish_reason is not None:
                trace.finish_reason = str(out.finish_reason)
                trace.finish_s = t_token
                if row is not None:
                    self.steps.add(row, "num_finished", 1)

    def add_steps(self, rows: list[dict[str, Any]], step_requests: list[tuple],
                  token_times: dict[str, list[float]]) -> None:
        """Step rows built outside `on_step` (the simulator's decode fast-forward builds k rows in one
        go): `rows` follow STEP_COLUMNS, `step_requests` STEP_REQUEST_COLUMNS (left out unless
        `record_step_requests`), `token_times` are the tokens the rows produced, per request. The
        first row takes the preemptions carried from steps that scheduled nothing."""
        if rows:
            rows[0]["num_preempted"] += self._carried_preemptions
            self._carried_preemptions = 0
        self.steps.extend_rows(rows)
        if self.record_step_requests:
            self.step_requests.extend(step_requests)
        for rid, times in token_times.items():
            trace = self.requests.get(rid)
            if trace is not None:
                trace.token_times.extend(times)
                trace.output_tokens += len(times)

    def on_late_tokens(self, late: list[LateTokens]) -> None:
        """Tokens of implicit rows, reported after their steps (see `LateTokens`): each token's time
        is its step's end, as for any other token."""
        t_end = self._t_end_by_step
        for f in late:
            trace = self.requests.get(f.request_id)
            if trace is None:
                continue
            times = t_end[f.first_step:f.first_step + f.num_tokens]
            if len(times) != f.num_tokens or _has_gap(times):
                raise RuntimeError(f"trace: implicit tokens of {f.request_id!r} in steps with no recorded end")
            trace.token_times.extend(times)
            trace.output_tokens += f.num_tokens

    def on_abort(self, request_id: str, t: float) -> None:
        trace = self.requests.get(request_id)
        if trace is not None and trace.finish_reason is None:
            trace.finish_reason = "abort"
            trace.finish_s = t

    # -- output ------------------------------------------------------------------------------
    def request_rows(self) -> list[dict[str, Any]]:
        return [t.row(self.run, self.backend, self.delivery) for t in self.requests.values()]

    def _request_columns(self) -> dict[str, list]:
        """`request_rows()` by column (what pandas builds the same table from without ~1 KB of dict per row)."""
        columns: dict[str, list] = {name: [] for name in REQUEST_COLUMNS}
        appends = [(name, columns[name].append) for name in REQUEST_COLUMNS]
        for t in self.requests.values():
            row = t.row(self.run, self.backend, self.delivery)
            for name, append in appends:
                append(row[name])
        return columns

    def itls(self) -> list[float]:
        """Inter-token latencies at the client boundary."""
        return self.itl_array().tolist()

    def engine_itls(self) -> list[float]:
        """Inter-token latencies at the engine (step ends)."""
        return self.engine_itl_array().tolist()

    def itl_array(self):
        """`itls()` as a float64 numpy array, in the same order (requests in arrival order, each one's gaps
        in token order), vectorised over the token times of `ITL_CHUNK_TOKENS` at a time (a 10,000-request
        run has ~2M of them; a Python loop over them took seconds, one pass over 100,000 requests' ~20M
        held ~1 GB of temporaries)."""
        if self.delivery is None:
            return self.engine_itl_array()
        return _gather((self._client_gaps(client, seg) for client, seg in self._client_time_chunks()),
                       self._num_tokens())

    def _client_time_chunks(self):
        """`_token_time_chunks` with each token's client receipt time instead of its engine time. Token times
        packed as indexes among the distinct step ends: each end's client time is looked up once (~30k
        lookups instead of ~2M per run), then gathered by index - the same values."""
        packed = self._packed_token_times
        if packed is not None and packed[1] is not None:
            values, index, lengths = packed
            by_end = self.delivery.client_times(values)
            for start, stop, seg in _chunk_segments(lengths):
                yield by_end[index[start:stop]], seg
            return
        for times, seg in self._token_time_chunks():
            yield self.delivery.client_times(times), seg

    def _client_gaps(self, client, seg):
        """The client-side gaps of one chunk (`client`: each token's receipt time, `seg`: its request)."""
        import numpy as np  # noqa: PLC0415  (lazy, like pandas in frames())

        ok = ~np.isnan(client)  # never delivered (RequestTrace.itls drops them)
        if not ok.all():  # (a copy: only when some are dropped)
            client, seg = client[ok], seg[ok]
        first = np.ones(client.size, dtype=bool)
        first[1:] = seg[1:] != seg[:-1]
        # tokens delivered together travel in one chunk: one ITL per chunk, as the client records it
        keep = first.copy()
        keep[1:] |= client[1:] != client[:-1]
        client, first = client[keep], first[keep]
        gaps = np.empty(client.size)
        gaps[1:] = client[1:] - client[:-1]
        if self.delivery.split_first_chunk:  # the role chunk, then the first token: a gap of ~0 first
            gaps[first] = 0.0
            return gaps
        return gaps[~first]

    def engine_itl_array(self):
        """`engine_itls()` as a numpy array (the gaps of every request's token times, vectorised)."""
        return _gather((_engine_gaps(times, seg) for times, seg in self._token_time_chunks()), self._num_tokens())

    def itl_arrays(self):
        """(`itl_array()`, `engine_itl_array()`), the same arrays (one array twice without a delivery map).
        (speed: one pass over the token times for both: gathering ~8.5M of them from their lists took ~0.35 s
        a pass for the 16-engine routing ladder; a packed recorder, whose times need no gathering, gets the
        two calls.)"""
        if self.delivery is None:
            engine = self.engine_itl_array()
            return engine, engine
        packed = self._packed_token_times
        if packed is not None and packed[1] is not None:
            return self.itl_array(), self.engine_itl_array()
        capacity = self._num_tokens()
        client, engine = _Gathered(capacity), _Gathered(capacity)
        for times, seg in self._token_time_chunks():
            client.add(self._client_gaps(self.delivery.client_times(times), seg))
            engine.add(_engine_gaps(times, seg))
        return client.result(), engine.result()

    def _num_tokens(self) -> int:
        if self._packed_token_times is not None:
            return int(self._packed_token_times[2].sum())
        return sum(len(t.token_times) for t in self.requests.values())

    def _token_time_chunks(self):
        """(token times, the request's index for each) as numpy arrays, for consecutive runs of whole
        requests of about `ITL_CHUNK_TOKENS` tokens (every gap lies within one request: the chunks' gaps
        concatenated are the gaps of all)."""
        import numpy as np  # noqa: PLC0415

        if self._packed_token_times is not None:
            values, index, lengths = self._packed_token_times
            for start, stop, seg in _chunk_segments(lengths):
                yield (values[start:stop] if index is None else values[index[start:stop]]), seg
            return
        lists = [t.token_times for t in self.requests.values()]
        lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        for a, b, start, stop in _request_spans(lengths):
            yield _flat(lists[a:b], stop - start), np.repeat(np.arange(b - a, dtype=np.int32), lengths[a:b])

    def packed(self) -> "TraceRecorder":
        """A copy of a finished recording to hand to another process: every request's token times in one
        numpy array, and pickled (`__getstate__`) with its requests as one list per field and without
        their token lists - a few buffers instead of ~1M float objects and 10,000 dataclasses (22 MB
        and ~0.5 s of pickling for 10,000 requests before). A token's time is a step's end: each is kept
        as the index (4 bytes) of its value among the distinct step ends, unless some token time is not
        one (then as the float itself). Its tables, trace and inter-token latencies equal this
        recorder's; it records nothing more (it shares this one's request objects)."""
        import copy  # noqa: PLC0415

        import numpy as np  # noqa: PLC0415

        lists = [t.token_times for t in self.requests.values()]
        lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        try:
            values = np.unique(np.array(self.steps.column("t_end_s"), dtype=float))
        except TypeError:  # (a step end that is no number)
            values = np.zeros(0)
        index = np.empty(int(lengths.sum()), dtype=np.uint32)
        for a, b, start, stop in _request_spans(lengths):
            times = _flat(lists[a:b], stop - start)
            i = np.minimum(np.searchsorted(values, times), max(values.size - 1, 0))
            if times.size and not (values.size and np.array_equal(values[i], times)):  # a time is no step end
                values, index = _flat(lists, index.size), None
                break
            index[start:stop] = i
        twin = copy.copy(self)
        twin._packed_token_times = (values, index, lengths)
        return twin

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._packed_token_times is not None:  # token times travel packed: the requests as columns
            state["_t_end_by_step"] = []  # (only for recording implicit rows' tokens)
            state["_implicit_details"] = {}  # (a cache for recording; a compiled build's IterationDetails, frozen,
            # would not unpickle)
            traces = list(state.pop("requests").values())
            state["_request_columns"] = {name: [getattr(t, name) for t in traces] for name in _TRACE_FIELDS}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        columns = state.pop("_request_columns", None)
        self.__dict__.update(state)
        if columns is not None:
            names = list(columns)
            self.requests = {values[0]: RequestTrace(**dict(zip(names, values))) for values in zip(*columns.values())}

    def frames(self, steps_columns: Sequence[str] = STEP_COLUMNS) -> dict[str, Any]:
        """The three tables; `steps_columns`: the steps table with these columns alone (a reader of a few)."""
        import pandas as pd  # noqa: PLC0415  (lazy: pandas is only needed to write tables)

        return {
            "steps": self.steps.to_frame(steps_columns),
            "step_requests": pd.DataFrame(self.step_requests, columns=STEP_REQUEST_COLUMNS),
            "requests": pd.DataFrame(self._request_columns(), columns=REQUEST_COLUMNS),
        }

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (open in Perfetto): `servetwin.core.testbed.perfetto`."""
        from servetwin.core.testbed.perfetto import chrome_trace  # noqa: PLC0415

        return chrome_trace(self.run, self.backend, self.steps, list(self.requests.values()))

    def write(self, out_dir: str, frames: Optional[dict[str, Any]] = None, trace: bool = True) -> dict[str, str]:
        """Write the three tables (Parquet) and, unless `trace` is false, trace.json; `frames` are this
        recorder's `frames()` when the caller already built them (building them is the costly part)."""
        os.makedirs(out_dir, exist_ok=True)
        paths = {}
        for name, df in (frames if frames is not None else self.frames()).items():
            path = os.path.join(out_dir, f"{name}.parquet")
            atomic_write_with(path, lambda tmp, df=df: _write_parquet(df, tmp))
            paths[name] = path
        if trace:
            path = os.path.join(out_dir, "trace.json")
            self.write_trace(path)
            paths["trace"] = path
        return paths

    def write_trace(self, path: str) -> str:
        """trace.json, streamed (`perfetto.write_chrome_trace`): the same bytes as `chrome_trace()` dumped."""
        from servetwin.core.testbed.perfetto import write_chrome_trace  # noqa: PLC0415

        write_chrome_trace(path, self.run, self.backend, self.steps, list(self.requests.values()))
        return path


ITL_CHUNK_TOKENS = 1 << 20  # token times per vectorised pass of the ITL arrays (8 MB of float64)


def _request_spans(lengths) -> Any:
    """(first request, end request, first token, end token) of consecutive runs of whole requests with
    about `ITL_CHUNK_TOKENS` tokens (at least one request each); `lengths`: tokens per request."""
    import numpy as np  # noqa: PLC0415

    ends = np.cumsum(lengths)
    a = 0
    while a < len(lengths):
        start = int(ends[a - 1]) if a else 0
        b = max(a + 1, int(np.searchsorted(ends, start + ITL_CHUNK_TOKENS, side="right")))
        yield a, b, start, int(ends[b - 1])
        a = b


def _chunk_segments(lengths: Any) -> Iterator[tuple[int, int, Any]]:
    """(first token, end token, each token's request index in the chunk) per `_request_spans` chunk."""
    import numpy as np  # noqa: PLC0415

    for a, b, start, stop in _request_spans(lengths):
        yield start, stop, np.repeat(np.arange(b - a, dtype=np.int32), lengths[a:b])


def _flat(lists: list, count: int) -> Any:
    """The float lists concatenated, as a numpy array of `count` values."""
    import itertools  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    return np.fromiter(itertools.chain.from_iterable(lists), dtype=float, count=count)


def _gather(parts: Iterator[Any], capacity: int) -> Any:
    """The arrays of `parts` (each a chunk's gaps) one after the other in one float64 array (`_Gathered`)."""
    out = _Gathered(capacity)
    for part in parts:
        out.add(part)
    return out.result()


class _Gathered:
    """Arrays added one after the other into one float64 array, filled in place: never the chunks and
    their concatenation at once. `capacity`: the token times, a bound on the gaps (pages of it never
    written are never resident)."""

    __slots__ = ("out", "n")

    def __init__(self, capacity: int) -> None:
        import numpy as np  # noqa: PLC0415

        self.out = np.empty(capacity)
        self.n = 0

    def add(self, part: Any) -> None:
        self.out[self.n:self.n + part.size] = part  # (a bound exceeded: numpy raises, nothing is lost silently)
        self.n += part.size

    def result(self) -> Any:
        out, self.out = self.out, None
        out.resize(self.n, refcheck=False)  # in place (no view of `out` exists)
        return out


def _engine_gaps(times, seg):
    """The gaps between consecutive token times of each request (`seg`: each time's request)."""
    import numpy as np  # noqa: PLC0415

    if times.size < 2:
        return np.zeros(0)
    gaps = times[1:] - times[:-1]  # the same subtraction as b - a per request
    return gaps[seg[1:] == seg[:-1]]  # not from one request's last token to the next one's first


def _write_parquet(df: Any, path: str) -> None:
    """`df.to_parquet(path, index=False)` converted on one thread: the tables are small, and pyarrow's
    thread pool waited ~1 s for CPUs busy with the figure writers on a 2-core machine."""
    import pyarrow as pa  # noqa: PLC0415  (lazy, like pandas)
    import pyarrow.parquet as pq  # noqa: PLC0415

    pq.write_table(pa.Table.from_pandas(df, preserve_index=False, nthreads=1), path)


__all__ = ["TraceRecorder", "RequestTrace", "DeliveryMap", "LateTokens", "STEP_COLUMNS", "STEP_REQUEST_COLUMNS",
           "REQUEST_COLUMNS", "asdict"]
