"""`trace.json` of a run in the Chrome trace-event format (open it in https://ui.perfetto.dev).

Process 1, the engine:
- track "steps": one slice per engine step, named by its annotation (`execute_context_..._generation_...`);
- track "preemptions": an instant at every step that preempted (args: how many);
- counter tracks (one "engine" counter event per step, a track per value): `engine running`, `engine
  waiting` (requests after scheduling the step), `engine KV usage %`, `engine prefill tokens`, `engine decode
  tokens` (tokens of the step).
Process 2, the requests: each request is a slice `arrival -> finish` holding its phases as child slices
(`queue`: arrival -> first scheduled, `prefill`: -> first token, `decode`: -> finish). Requests are packed
onto at most `MAX_REQUEST_TRACKS` tracks (a request takes the lowest track free at its arrival; slices on a
track never overlap, as the format needs); a request that finds every track busy is left out of this view
and counted in the process name - every request is in `requests.parquet`.
"""
from __future__ import annotations

import heapq
import itertools
import json
import math
import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

from servetwin.core.testbed.atomic import atomic_open
from servetwin.core.testbed.step_table import StepTable

MAX_REQUEST_TRACKS = 64
ENGINE_PID, REQUESTS_PID = 1, 2
STEP_TID, PREEMPT_TID = 1, 2


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def pack_tracks(spans: Iterable[tuple[float, float]], max_tracks: int = MAX_REQUEST_TRACKS) -> list[Optional[int]]:
    """Track index for each (start, end) span, in input order, or None when all `max_tracks` are busy.

    Spans are placed in start order on the lowest-numbered free track (a track is free once its last
    span ended at or before the new start), so no two spans on a track overlap."""
    spans = list(spans)
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    busy: list[tuple[float, int]] = []  # (end, track) heap
    free: list[int] = []  # free track ids, a heap
    opened = 0
    out: list[Optional[int]] = [None] * len(spans)
    for i in order:
        start, end = spans[i]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            track = heapq.heappop(free)
        elif opened < max_tracks:
            track = opened
            opened += 1
        else:
            continue
        out[i] = track
        heapq.heappush(busy, (max(end, start), track))
    return out


def _meta(pid: int, name: str, tid: Optional[int] = None) -> dict[str, Any]:
    if tid is None:
        return {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _engine_events(steps: StepTable, pid: int = ENGINE_PID, first: int = 0) -> Iterator[dict[str, Any]]:
    """The engine process's events from step row `first` on (`first` = len(steps): the closing counter alone)."""
    col = steps.column
    names = ("annotation", "t_start_s", "duration_s", "step", "total_tokens", "num_running", "num_waiting",
             "num_preempted", "kv_usage", "num_context_tokens", "num_generation_tokens")
    for annotation, t0, dur, step, tokens, running, waiting, preempted, kv, prefill, decode in itertools.islice(
            zip(*map(col, names)), first, None):
        ts = _us(t0)
        yield {"name": annotation, "ph": "X", "pid": pid, "tid": STEP_TID, "ts": ts,
               "dur": _us(max(dur, 0.0)),
               "args": {"step": step, "tokens": tokens, "running": running, "waiting": waiting,
                        "preempted": preempted}}
        yield {"name": "engine", "ph": "C", "pid": pid, "ts": ts,  # one event, one counter track per arg
               "args": {"running": running, "waiting": waiting, "KV usage %": round(100.0 * kv, 2),
                        "prefill tokens": prefill, "decode tokens": decode}}
        if preempted:
            yield {"name": f"preempted {preempted}", "ph": "i", "s": "t", "pid": pid,
                   "tid": PREEMPT_TID, "ts": ts, "args": {"step": step, "preempted": preempted}}
    if len(steps):  # counters hold their last value; end them with the run
        yield {"name": "engine", "ph": "C", "pid": pid, "ts": _us(col("t_end_s")[-1]),
               "args": {"running": 0, "waiting": 0, "KV usage %": round(100.0 * col("kv_usage")[-1], 2),
                        "prefill tokens": 0, "decode tokens": 0}}


# (speed: a cluster's trace holds ~1.5M step events; as dicts encoded by json they took ~8 s of a 16-engine
# ladder's ~60 s run) the same events as text, each formatted as `json.dumps(event, separators=(",", ":"))`
# writes it: ints by `%d` (int.__repr__), floats by `%r` or `repr` (float.__repr__, what json uses for
# finite floats; `_us_texts`). A step's two events are cut into parts: those that repeat over steps (by
# annotation; by tokens, running, waiting and preempted; by the counters' values) are formatted once each,
# the rest (the start, twice, the duration and the step) per step: `_STEP_TEXT` % (head, ts, dur, step,
# middle, ts, counters) is the two events.
_STEP_HEAD = '{"name":%s,"ph":"X","pid":%d,"tid":' + str(STEP_TID) + ',"ts":'
_STEP_TEXT = '%s%s,"dur":%s,"args":{"step":%d,%s%s%s'
_STEP_MIDDLE = ('"tokens":%d,"running":%d,"waiting":%d,"preempted":%d}},{"name":"engine","ph":"C","pid":%d,'
                '"ts":')
_STEP_COUNTERS = ',"args":{"running":%d,"waiting":%d,"KV usage %%":%r,"prefill tokens":%d,"decode tokens":%d}}'
_PREEMPT_TEXT = (',{"name":"preempted %d","ph":"i","s":"t","pid":%d,"tid":' + str(PREEMPT_TID)
                 + ',"ts":%r,"args":{"step":%d,"preempted":%d}}')
_INT_COLUMNS = ("step", "total_tokens", "num_running", "num_waiting", "num_preempted", "num_context_tokens",
                "num_generation_tokens")
_FLOAT_COLUMNS = ("t_start_s", "duration_s", "kv_usage")
_FLOAT_LIMIT = 1e290  # x 1e6 stays finite, as `_us` and the KV percentage need for `%r` to equal json's
STEPS_PER_TEXT = 4096  # steps joined into one text (a few MB): the writer's work is per text, not per step


class _Formatted(dict):
    """`make(key)` for each key, made once: `map(d.__getitem__, keys)` stays in C but for a new key."""

    __slots__ = ("make",)

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key: Any) -> str:
        text = self[key] = self.make(key)
        return text


def _engine_event_texts(steps: StepTable, pid: int) -> Optional[Iterator[str]]:
    """`_engine_events(steps, pid)` but its last event as texts, each the events of up to `STEPS_PER_TEXT`
    consecutive steps joined by ",", or None when a column is not a typed array of finite values or an
    annotation is not text (then the dicts are encoded: json spells None, bools and non-finite floats
    its own way)."""
    col = steps.column
    if not all(type(col(n)) is array for n in _INT_COLUMNS + _FLOAT_COLUMNS):
        return None
    for n in _FLOAT_COLUMNS:
        values = col(n)
        if len(values) and not (all(map(math.isfinite, values)) and max(map(abs, values)) < _FLOAT_LIMIT):
            return None
    if not set(map(type, col("annotation"))) <= {str}:  # (exact types, in one C loop)
        return None
    return _step_texts(steps, pid)


_FIXED_LIMIT_S = 1e6  # |t| below it: t * 1e6 has <= 12 integer digits, `_us(t)` <= 15 significant ones


def _us_texts(values: Sequence[float]) -> list[str]:
    """`[repr(_us(v)) for v in values]` (finite values), in C loops where every |v| < `_FIXED_LIMIT_S`.

    Why '%.3f' gives the same text there: `round(x, 3)` is the float nearest to x correctly rounded to 3
    decimals, the decimal D that '%.3f' % x prints (both by dtoa). D has <= 15 significant digits, and
    distinct decimals of <= 15 digits are distinct floats (DBL_DIG), so the shortest text that reads back
    as round(x, 3) - its repr - is D's digits: D without trailing zeros, "N.0" when none is left after
    the point (repr's fixed notation: |round(x, 3)| is 0 or >= 0.001, and < 1e16)."""
    if not values or max(map(abs, values)) >= _FIXED_LIMIT_S:
        return [repr(_us(v)) for v in values]
    texts = list(map(str.rstrip, map("%.3f".__mod__, map(operator.mul, itertools.repeat(1e6), values)),
                     itertools.repeat("0")))
    for i in itertools.compress(itertools.count(), map(str.endswith, texts, itertools.repeat("."))):
        texts[i] += "0"
    return texts


def _step_texts(steps: StepTable, pid: int) -> Iterator[str]:
    """The texts of `_engine_event_texts`, `STEPS_PER_TEXT` steps each: every step's two events formatted
    by one `%` in `map` (no Python frame per step); a step that preempted gets its instant after its two
    events, as `_engine_events` yields them."""
    col = steps.column
    encode = json.JSONEncoder(separators=(",", ":")).encode
    heads = {a: _STEP_HEAD % (encode(a), pid) for a in set(col("annotation"))}
    middles = _Formatted(lambda k: _STEP_MIDDLE % (*k, pid))
    counters = _Formatted(lambda k: _STEP_COUNTERS % (k[0], k[1], round(100.0 * k[2], 2), k[3], k[4]))
    annotation, t_start, duration, step = col("annotation"), col("t_start_s"), col("duration_s"), col("step")
    tokens, running, waiting, preempted = (col("total_tokens"), col("num_running"), col("num_waiting"),
                                           col("num_preempted"))
    kv, prefill, decode = col("kv_usage"), col("num_context_tokens"), col("num_generation_tokens")
    for a in range(0, len(steps), STEPS_PER_TEXT):
        b = min(a + STEPS_PER_TEXT, len(steps))
        ts = _us_texts(t_start[a:b])
        block = list(map(_STEP_TEXT.__mod__, zip(
            map(heads.__getitem__, annotation[a:b]), ts,
            _us_texts(list(map(max, duration[a:b], itertools.repeat(0.0)))), step[a:b],
            map(middles.__getitem__, zip(tokens[a:b], running[a:b], waiting[a:b], preempted[a:b])), ts,
            map(counters.__getitem__, zip(running[a:b], waiting[a:b], kv[a:b], prefill[a:b], decode[a:b])))))
        for i in itertools.compress(itertools.count(), preempted[a:b]):  # (rare)
            block[i] += _PREEMPT_TEXT % (preempted[a + i], pid, _us(t_start[a + i]), step[a + i], preempted[a + i])
        yield ",".join(block)


def _engine_stream(steps: StepTable, pid: int = ENGINE_PID) -> Iterator[Any]:
    """The engine's events for a streamed write: texts where `_engine_event_texts` can, else dicts."""
    texts = _engine_event_texts(steps, pid)
    if texts is None:
        return _engine_events(steps, pid)
    last = list(_engine_events(steps, pid, first=len(steps))) if len(steps) else []  # the closing counter
    return itertools.chain(texts, last)


def _end_of(t: Any) -> float:
    ends = [x for x in (t.finish_s, t.first_token_s, t.first_scheduled_s) if x is not None]
    return max(ends) if ends else t.arrival_s


def _request_events(requests: list[Any], max_tracks: int, pid: int = REQUESTS_PID,
                    first_tid: int = 1) -> tuple[Iterator[dict[str, Any]], int, int]:
    """(the requests' events, made as they are read; tracks used; requests left out)."""
    tracks = pack_tracks(((t.arrival_s, _end_of(t)) for t in requests), max_tracks)
    return (_request_slices(requests, tracks, pid, first_tid), len({x for x in tracks if x is not None}),
            sum(1 for x in tracks if x is None))


def _request_slices(requests: list[Any], tracks: list[Optional[int]], pid: int = REQUESTS_PID,
                    first_tid: int = 1) -> Iterator[dict[str, Any]]:
    for t, track in zip(requests, tracks):
        if track is None:
            continue
        tid = track + first_tid
        end = _end_of(t)
        yield {"name": t.request_id, "ph": "X", "pid": pid, "tid": tid, "ts": _us(t.arrival_s),
               "dur": _us(end - t.arrival_s),
               "args": {"prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                        "output_tokens": t.output_tokens, "preemptions": t.num_preemptions,
                        "finish_reason": t.finish_reason,
                        "ttft_s": None if t.first_token_s is None else t.first_token_s - t.arrival_s}}
        bounds = [("queue", t.arrival_s, t.first_scheduled_s), ("prefill", t.first_scheduled_s, t.first_token_s),
                  ("decode", t.first_token_s, t.finish_s)]
        for name, a, b in bounds:
            if a is not None and b is not None and b > a:
                yield {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": _us(a), "dur": _us(b - a)}


def _document(run: str, backend: str, steps: StepTable, requests: list[Any], max_tracks: int,
              encoded: bool = False) -> tuple[list[dict[str, Any]], Iterator[Any], dict[str, Any]]:
    """(the events before the steps', an iterator over every step's, everything after "traceEvents");
    `encoded`: the engine's events as `_engine_stream` gives them (texts where it can)."""
    req_events, num_tracks, left_out = _request_events(requests, max_tracks)
    shown = f"{len(requests) - left_out:,} of {len(requests):,} on {num_tracks} tracks" if left_out else \
        f"{len(requests):,} on {num_tracks} tracks"
    head = [_meta(ENGINE_PID, f"{run} engine ({backend})"), _meta(ENGINE_PID, "steps", STEP_TID),
            _meta(ENGINE_PID, "preemptions", PREEMPT_TID),
            _meta(REQUESTS_PID, f"{run} requests ({shown}; all in requests.parquet)")]
    head += [_meta(REQUESTS_PID, f"requests {i + 1}", i + 1) for i in range(num_tracks)]
    tail = {"displayTimeUnit": "ms",
            "otherData": {"run": run, "backend": backend, "requests": len(requests),
                          "requests_left_out": left_out, "request_tracks": num_tracks}}
    engine = _engine_stream(steps) if encoded else _engine_events(steps)
    return head, itertools.chain(engine, req_events), tail


def chrome_trace(run: str, backend: str, steps: StepTable, requests: list[Any],
                 max_tracks: int = MAX_REQUEST_TRACKS) -> dict[str, Any]:
    """The trace-event document of one backend's run (`steps`: a TraceRecorder's step table, `requests`:
    its RequestTrace objects)."""
    head, events, tail = _document(run, backend, steps, requests, max_tracks)
    return {"traceEvents": head + list(events), **tail}


EVENTS_PER_WRITE = 20_000
CLUSTER_REQUEST_TRACKS = 16  # request tracks per instance in a cluster's trace


def _write_streamed(path: str, head: list[dict[str, Any]], events: Iterator[Any], tail: dict[str, Any]) -> None:
    """`{"traceEvents": head + events, **tail}` as `json.dumps(..., separators=(",", ":"))` writes it;
    `events`: dicts, and texts (one or more events encoded already, joined by ",") written as they come."""
    encode = json.JSONEncoder(separators=(",", ":")).encode
    with atomic_open(path) as f:
        # a list's encoding is "[" + its items' encodings joined by "," + "]": one encoder call per
        # `EVENTS_PER_WRITE` dicts (or fewer, up to the next text)
        f.write('{"traceEvents":' + encode(head)[:-1])  # (`head` is never empty)

        def put(text: str) -> None:
            # (speed: the "," written on its own, not prefixed to the text: a copy of each text (a few MB,
            # ~250 MB for the routing ladder) cost ~0.2 s of the trace.json child's ~2 s, measured)
            f.write(",")
            f.write(text)

        dicts: list[dict[str, Any]] = []
        for event in events:
            if type(event) is str:
                if dicts:
                    put(encode(dicts)[1:-1])
                    dicts = []
                put(event)
            else:
                dicts.append(event)
                if len(dicts) == EVENTS_PER_WRITE:
                    put(encode(dicts)[1:-1])
                    dicts = []
        if dicts:
            put(encode(dicts)[1:-1])
        f.write("]," + encode(tail)[1:])


def write_cluster_trace(path: str, run: str, engines: list[tuple[str, StepTable, list[Any]]],
                        decisions: Iterable[tuple[float, str, str]] = (),
                        max_tracks: int = CLUSTER_REQUEST_TRACKS,
                        transfers: Sequence[tuple[str, str, str, float, float]] = ()) -> None:
    """A cluster's trace.json: one process per engine (`engines`: (label, its step table, its
    RequestTrace objects)) holding the engine's tracks (steps, preemptions, counters) and its requests on
    up to `max_tracks` tracks; then a "router" process with an instant per decision ((t, request id, pick));
    then, for P/D, a "kv transfers" process with a slice per KV read ((request id, from engine, to engine,
    start, end)) and a flow arrow from the source engine's steps track to the destination's."""
    head: list[dict[str, Any]] = []
    streams = []
    for i, (label, steps, requests) in enumerate(engines):
        pid = i + 1
        req_events, num_tracks, left_out = _request_events(requests, max_tracks, pid, first_tid=PREEMPT_TID + 1)
        shown = f"{len(requests) - left_out:,} of {len(requests):,} requests shown" if left_out else \
            f"{len(requests):,} requests"
        head += [_meta(pid, f"{label} ({shown})"), _meta(pid, "steps", STEP_TID), _meta(pid, "preemptions", PREEMPT_TID)]
        head += [_meta(pid, f"requests {k + 1}", PREEMPT_TID + 1 + k) for k in range(num_tracks)]
        streams += [_engine_stream(steps, pid), req_events]
    router_pid = len(engines) + 1
    head += [_meta(router_pid, "router"), _meta(router_pid, "decisions", 1)]
    routed = ({"name": f"{rid} -> {pick}", "ph": "i", "s": "t", "pid": router_pid, "tid": 1, "ts": _us(t)}
              for t, rid, pick in decisions)
    kv_pid = router_pid + 1
    if transfers:
        head += [_meta(kv_pid, "kv transfers"), _meta(kv_pid, "reads", 1)]
    tail = {"displayTimeUnit": "ms", "otherData": {"run": run, "backend": "sim", "engines": len(engines)}}
    pids = {label: i + 1 for i, (label, _, _) in enumerate(engines)}
    _write_streamed(path, head, itertools.chain(*streams, routed, _transfer_events(transfers, pids, kv_pid)), tail)


def _transfer_events(transfers: Iterable[tuple[str, str, str, float, float]], pids: dict[str, int],
                     kv_pid: int) -> Iterator[dict[str, Any]]:
    for n, (rid, source, dest, start, end) in enumerate(transfers):
        yield {"name": f"{rid}: {source} -> {dest}", "ph": "X", "pid": kv_pid, "tid": 1, "ts": _us(start),
               "dur": _us(end) - _us(start), "args": {"request_id": rid}}
        if source in pids and dest in pids:  # the arrow: bound to the steps running at either end
            yield {"name": "kv", "cat": "kv", "ph": "s", "id": n, "pid": pids[source], "tid": STEP_TID, "ts": _us(start)}
            yield {"name": "kv", "cat": "kv", "ph": "f", "bp": "e", "id": n, "pid": pids[dest], "tid": STEP_TID,
                   "ts": _us(end)}


def write_chrome_trace(path: str, run: str, backend: str, steps: StepTable, requests: list[Any],
                       max_tracks: int = MAX_REQUEST_TRACKS) -> None:
    """`chrome_trace(...)` written as `json.dumps(doc, separators=(",", ":"))` writes it, byte for byte,
    streamed: the events are encoded `EVENTS_PER_WRITE` at a time, never all held at once (a 100,000-
    request run has ~1M of them: ~1 GB as dicts, ~150 MB as one string). Renamed into place complete."""
    head, events, tail = _document(run, backend, steps, requests, max_tracks, encoded=True)
    _write_streamed(path, head, events, tail)
