"""The wall-clock engine loop for measured backends (torch, or any executor): no simpy, no torch here.

`run_realtime` drives an `EngineCore` like vLLM's engine loop drives its core: requests whose arrival
time has come are added between steps, each step is timed with `time.perf_counter()` (seconds since
the run started), and the `TraceRecorder` gets every arrival and step, so measured and simulated runs
write the same tables with the same metric boundaries (`servetwin.core.testbed.trace`).

- offline: every request is added at t = 0, then the engine steps until it is done.
- online: a request is added once the wall time since the start reaches its `arrival_s` (requests
  are taken in `arrival_s` order, ties in input order); an idle engine sleeps until the next arrival.
  A request that arrives while a step runs joins before the next step (it waits, as in vLLM); its
  recorded arrival is its `arrival_s`, so the wait counts in its queue time and TTFT.

Requests get `SamplingParams(max_tokens, ignore_eos=True, temperature=0)`, so output lengths match
the simulator's (a request with a forced EOS position `eos_at` uses it as max_tokens). `n > 1` fans
out into `servetwin.core.engine.parallel_sampling` children; greedy sampling forbids n > 1 (as in vLLM), so those use
temperature 1 with `seed` (child i gets seed + i: reproducible, and the children differ).
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Optional, Sequence

from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.parallel_sampling import fan_out
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.scheduler import UnservableRequestError
from servetwin.core.testbed.trace import TraceRecorder

MAX_IDLE_STEPS = 3  # engine steps without progress (nothing scheduled, nothing finished) before giving up


class RealtimeStall(RuntimeError):
    """The engine holds requests but schedules nothing and no more requests will arrive."""


def _make_requests(wreq: Any, seed: Optional[int]) -> list[Request]:
    n = int(getattr(wreq, "n", 1) or 1)
    eos_at = getattr(wreq, "eos_at", None)
    max_tokens = int(eos_at) if eos_at is not None else int(wreq.max_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if n == 1 else 1.0, n=n,
                            seed=seed)
    return [Request(cid, list(wreq.prompt_token_ids), p, arrival_time=float(wreq.arrival_s),
                    priority=int(getattr(wreq, "priority", 0) or 0),
                    parent_id=wreq.request_id if n > 1 else None)
            for cid, p in fan_out(wreq.request_id, params)]


def run_realtime(engine: EngineCore, requests: Sequence[Any], recorder: TraceRecorder, offline: bool,
                 progress: Any = None, *, seed: Optional[int] = 0,
                 rejected: Optional[dict[str, str]] = None,
                 on_complete: Optional[Callable[[str, float], None]] = None,
                 outputs: Optional[dict[str, list[int]]] = None,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> float:
    """Run `requests` through `engine` in wall-clock time; returns the wall time of the run (s).

    `progress`: an object with `update(n)` (e.g. tqdm), told about every completed workload request.
    `rejected`: filled with request_id -> reason for requests that can never be served.
    `on_complete(request_id, t)`: called when all of a workload request's sequences finished.
    `outputs`: filled with request_id -> the output token ids (the report shows real models' answers).
    KeyboardInterrupt propagates; the recorder then holds everything up to the interrupted step.
    """
    order = sorted(range(len(requests)), key=lambda i: (0.0 if offline else float(requests[i].arrival_s), i))
    pending = [requests[i] for i in order]
    remaining: dict[str, int] = {}  # workload request -> unfinished sequences
    parent_of: dict[str, str] = {}
    t0 = clock()
    nxt = 0
    idle = 0
    seq = itertools.count()

    def admit(now: float) -> None:
        nonlocal nxt
        while nxt < len(pending) and (offline or float(pending[nxt].arrival_s) <= now):
            wreq = pending[nxt]
            nxt += 1
            arrival = 0.0 if offline else float(wreq.arrival_s)
            reqs = _make_requests(wreq, seed)
            try:
                for req in reqs:
                    engine.scheduler.check_servable(req)
            except UnservableRequestError as exc:
                if rejected is not None:
                    rejected[wreq.request_id] = str(exc)
                if progress is not None:
                    progress.update(1)
                continue
            remaining[wreq.request_id] = len(reqs)
            for req in reqs:
                # distinct stamps in submission order, as servetwin.sim.engine gives them (vLLM's wall-clock
                # stamps never tie; the priority policy breaks ties by arrival time)
                req.arrival_time = arrival + next(seq) * 1e-9
                engine.add_request(req)
                recorder.on_arrival(req, arrival)
                parent_of[req.request_id] = wreq.request_id

    while True:
        now = clock() - t0
        admit(now)
        if not engine.has_work() or idle >= MAX_IDLE_STEPS:
            if nxt >= len(pending):
                if engine.has_work():
                    raise RealtimeStall(f"realtime run stalled at t={now:.3f}s: the engine holds requests "
                                        "but schedules nothing and no more requests will arrive")
                break
            wait = float(pending[nxt].arrival_s) - (clock() - t0)
            if wait > 0:
                sleep(wait)
            idle = 0
            continue
        t_start = clock() - t0
        result = engine.step()
        t_end = clock() - t0
        recorder.on_step(result, t_start, t_end)
        so = result.scheduled
        progressed = (so is not None and so.total_num_scheduled_tokens > 0) or bool(result.outputs)
        idle = 0 if progressed else idle + 1
        # a token's time is the end of the step that computed it (servetwin.core.testbed.trace); in async mode the
        # processed batch ran in the previous step, whose end the recorder already knows
        for out in result.outputs:
            if outputs is not None:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is None:
                continue
            parent = parent_of.pop(out.request_id, None)
            if parent is None:
                continue
            remaining[parent] -= 1
            if remaining[parent] == 0:
                del remaining[parent]
                if on_complete is not None:
                    on_complete(parent, t_end)
                if progress is not None:
                    progress.update(1)
    return clock() - t0


__all__ = ["run_realtime", "RealtimeStall"]
