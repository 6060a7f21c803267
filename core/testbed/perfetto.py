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
import json
from typing import Any, Iterable, Optional

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


def _engine_events(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = []
    add = ev.append
    for row in steps:
        ts = _us(row["t_start_s"])
        add({"name": row["annotation"], "ph": "X", "pid": ENGINE_PID, "tid": STEP_TID, "ts": ts,
             "dur": _us(max(row["duration_s"], 0.0)),
             "args": {"step": row["step"], "tokens": row["total_tokens"], "running": row["num_running"],
                      "waiting": row["num_waiting"], "preempted": row["num_preempted"]}})
        add({"name": "engine", "ph": "C", "pid": ENGINE_PID, "ts": ts,  # one event, one counter track per arg
             "args": {"running": row["num_running"], "waiting": row["num_waiting"],
                      "KV usage %": round(100.0 * row["kv_usage"], 2), "prefill tokens": row["num_context_tokens"],
                      "decode tokens": row["num_generation_tokens"]}})
        if row["num_preempted"]:
            add({"name": f"preempted {row['num_preempted']}", "ph": "i", "s": "t", "pid": ENGINE_PID,
                 "tid": PREEMPT_TID, "ts": ts, "args": {"step": row["step"], "preempted": row["num_preempted"]}})
    if steps:  # counters hold their last value; end them with the run
        last = steps[-1]
        ev.append({"name": "engine", "ph": "C", "pid": ENGINE_PID, "ts": _us(last["t_end_s"]),
                   "args": {"running": 0, "waiting": 0, "KV usage %": round(100.0 * last["kv_usage"], 2),
                            "prefill tokens": 0, "decode tokens": 0}})
    return ev


def _request_events(requests: list[Any], max_tracks: int) -> tuple[list[dict[str, Any]], int, int]:
    def end_of(t) -> float:
        ends = [x for x in (t.finish_s, t.first_token_s, t.first_scheduled_s) if x is not None]
        return max(ends) if ends else t.arrival_s

    tracks = pack_tracks(((t.arrival_s, end_of(t)) for t in requests), max_tracks)
    ev: list[dict[str, Any]] = []
    used: set[int] = set()
    for t, track in zip(requests, tracks):
        if track is None:
            continue
        used.add(track)
        tid = track + 1
        end = end_of(t)
        ev.append({"name": t.request_id, "ph": "X", "pid": REQUESTS_PID, "tid": tid, "ts": _us(t.arrival_s),
                   "dur": _us(end - t.arrival_s),
                   "args": {"prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                            "output_tokens": t.output_tokens, "preemptions": t.num_preemptions,
                            "finish_reason": t.finish_reason,
                            "ttft_s": None if t.first_token_s is None else t.first_token_s - t.arrival_s}})
        bounds = [("queue", t.arrival_s, t.first_scheduled_s), ("prefill", t.first_scheduled_s, t.first_token_s),
                  ("decode", t.first_token_s, t.finish_s)]
        for name, a, b in bounds:
            if a is not None and b is not None and b > a:
                ev.append({"name": name, "ph": "X", "pid": REQUESTS_PID, "tid": tid, "ts": _us(a), "dur": _us(b - a)})
    return ev, len(used), sum(1 for x in tracks if x is None)


def chrome_trace(run: str, backend: str, steps: list[dict[str, Any]], requests: list[Any],
                 max_tracks: int = MAX_REQUEST_TRACKS) -> dict[str, Any]:
    """The trace-event document of one backend's run (`steps`: TraceRecorder step rows, `requests`: its
    RequestTrace objects)."""
    req_events, num_tracks, left_out = _request_events(requests, max_tracks)
    shown = f"{len(requests) - left_out:,} of {len(requests):,} on {num_tracks} tracks" if left_out else \
        f"{len(requests):,} on {num_tracks} tracks"
    events = [_meta(ENGINE_PID, f"{run} engine ({backend})"), _meta(ENGINE_PID, "steps", STEP_TID),
              _meta(ENGINE_PID, "preemptions", PREEMPT_TID),
              _meta(REQUESTS_PID, f"{run} requests ({shown}; all in requests.parquet)")]
    events += [_meta(REQUESTS_PID, f"requests {i + 1}", i + 1) for i in range(num_tracks)]
    events += _engine_events(steps)
    events += req_events
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run": run, "backend": backend, "requests": len(requests),
                          "requests_left_out": left_out, "request_tracks": num_tracks}}


def write_chrome_trace(path: str, doc: dict[str, Any]) -> None:
    # one dumps + one write: json.dump streams thousands of small chunks through the file object
    text = json.dumps(doc, separators=(",", ":"))
    with open(path, "w") as f:
        f.write(text)
