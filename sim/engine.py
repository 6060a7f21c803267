"""The simulation loop: SimPy processes for arrivals and for the engine, in simulated time only.

The engine process drives the shared `servetwin.core.engine.engine_core.EngineCore` (its scheduler does async
scheduling itself when configured) with a `SimExecutor`: each engine step that runs a batch takes
the batch's predicted duration (`ModelRunnerOutput.timing.duration_s`); nothing reads the host
clock. Batches run back to back: the next step starts when the previous one ends, or when the next
request arrives at an idle engine.

Order of events at one simulated time t (defined here, not left to event creation order):
1. the step that ends at t completes: its outputs are processed (sync mode; in async mode the
   previous batch's outputs are processed when the next step is scheduled, also at t) and every
   workload request whose sequences have all finished fires its completion event;
2. arrivals at t: open-loop arrivals in input order; closed-loop clients whose request completed
   at t and have no think time submit their next request (in completion order);
3. the next engine step starts at t: every request submitted at or before t is added to the engine
   in submission order, then the step is scheduled.
Step 3 waits (`Simulation._settle`) until no other event is scheduled at t, so everything of steps 1-2
(including the events they cause at t) goes first.

Drivers observe a run through callbacks, not by subclassing: `on_complete(request_id, t)` when a
workload request's last sequence finishes, `on_reject(request_id, reason)` when one can never be served,
and, set on `Simulation.hooks` (`SimHooks`), `on_abort(request_id, t)` when its client gave up (`timeout_s`) and
the engine aborted it, `on_first_token(request_id, t)` when its first output token is processed,
`on_kv_transfer_params(request_id, params)` when a finished request hands its KV on.
A workload request with `keep_output_tokens` (n = 1) gets the engine's output token ids in its
`output_token_ids` when it completes (the multi-turn conversations of `servetwin.sim.conversation`
build the next turn's prompt from them); an aborted or rejected one keeps None.

Time stamps follow `servetwin.core.testbed.trace`: a token's time is the end of the step that computed it; a request
completes at the end of the step that produced its last token.

Fused steps: with implicit decodes (sim/scheduler.py), a step whose batch is the implicit members alone (no
listed row, nothing waiting or preempted; `SimScheduler.quiet_step`) is done in one call,
`_fused_step`: the scheduler's step, the duration from the cost model, the trace row and the front end's
step output, without the `SchedulerOutput`, stats and runner output of `EngineCore.step` - the same
rows, events and state (tests/sim/test_sim_fused_step.py). The requests finished since the previous step
(the step after a finish, with no member event) go to the runner as that output's `finished_req_ids` would.
In async scheduling its batch stays out of the engine's batch queue until a normal step needs it there
(`_unfuse`).

Step windows (`step_windows=True`, with fused steps; async scheduling, or sync without a front end): a run of
fused steps without member events is one SimPy event; what the step-by-step run does at each step end in
between is applied afterwards with that step's own times, or up to the current time when a request reaches
the engine first (the window then ends with the step in progress) - the same rows, events and state
(tests/sim/test_sim_step_windows.py; `_plan_window` says why).

Front end: with `frontend=` an API server (`servetwin.sim.frontend.ApiServerFrontend`, its own
process with its own CPU) sits between the arrival process and the engine: arrivals are submitted to
it, it hands each request to the engine when its ingress work is done, gets every processed step's
outputs (`on_step_output`) and fires a workload request's completion when its last chunk reached the
client (what a closed-loop client waits for). Without one (the offline front end) requests reach the
engine as they arrive and complete at the engine.
"""
from __future__ import annotations

import contextlib
import gc
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Optional

import numpy as np
import simpy

from servetwin.core.engine.engine_core import EngineCore, StepResult
from servetwin.core.engine.parallel_sampling import fan_out
from servetwin.core.outputs import ModelRunnerOutput, StepTiming
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.output import CachedRequestData, ImplicitDecodes, SchedulerOutput
from servetwin.core.sched.scheduler import UnservableRequestError
from servetwin.core.testbed.trace import TraceRecorder
from servetwin.sim.arrivals import ArrivalProcess
from servetwin.sim.fast_forward import fast_forward
from servetwin.sim.scheduler import SimScheduler
from servetwin.sim.sim_time import delay_to as _delay_to
from servetwin.sim.workload import WorkloadRequest, build_workload, rng_streams

DEFAULT_EOS_TOKEN_ID = 0  # fake tokens are >= 10, so 0 appears only where forced
MAX_IDLE_ITERATIONS = 3  # engine iterations without progress before the loop waits or gives up
# Young-generation threshold of the cyclic collector while a simulation runs (Python's default: 700).
# The loop allocates millions of short-lived containers that reference counting frees; at 700 the
# collector ran ~170 times on bench_h100_llama8b (10k requests), its full passes walking every trace
# row and request, ~10% of the loop's time; at 50,000 it runs twice. Cycles are still collected.
SIM_GC_THRESHOLD0 = 50_000
WINDOW_MAX_STEPS = 256  # steps of one step window at most (`Simulation._plan_window`)
WINDOW_FIRST_STEPS = 32  # steps a window prices first (then as many as it has, `Simulation._window_extend`)


@dataclass(slots=True)
class SimResult:
    recorder: TraceRecorder
    end_time_s: float
    num_steps: int  # engine steps that ran a batch
    completion_s: dict[str, float] = field(default_factory=dict)  # workload request -> finish
    rejected: dict[str, str] = field(default_factory=dict)  # workload request -> reason
    aborted_s: dict[str, float] = field(default_factory=dict)  # workload request -> client timeout
    unfinished: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Shortcuts:
    """Which of the exact step shortcuts a simulation takes (besides implicit decodes) and their state."""
    fast_forward: bool = False  # the decode fast-forward (servetwin.sim.fast_forward; sync, no implicit decodes)
    fused: bool = False  # the fused implicit-decode step (`Simulation._fused_step`)
    count: int = 0  # steps done fused
    # async scheduling: the last fused step's batch, not yet processed, kept out of the engine's batch
    # queue until a normal step needs it there (`Simulation._unfuse`): (step, scheduler step, its implicit
    # rows, shared KV tokens, duration, end)
    batch: Optional[tuple[int, int, ImplicitDecodes, int, float, float]] = None
    windows: bool = False  # step windows (`Simulation._plan_window`)
    window: Optional["_Window"] = None  # the window in progress
    timeouts: int = 0  # client-timeout processes not yet fired (no window while any is)
    num_windows: int = 0  # windows closed
    window_steps: int = 0  # steps inside them
    stale: int = 0  # wake-ups of windows that were cut, fired for nothing
    end_s: Optional[float] = None  # the run's last event but stale wake-ups (`Simulation._run_past_stale_wakes`)


@dataclass(slots=True)
class _Window:
    """A step window: steps 1..stop of the engine's fused implicit-decode steps as one SimPy event. Step i
    runs [ends[i - 1], ends[i]) for durations[i]; step 1 was taken at ends[0] as a fused step; the
    actions at ends[i] (0 < i < stop) - step i + 1 scheduled, step i's outputs to the front end - are
    applied later, with their own times (`applied`: the last one applied)."""
    ends: list[float]
    durations: list[float]
    applied: int
    stop: int
    wake: simpy.Event
    # the steps' batch (`SimScheduler.quiet_run`): step i's aggregates are ImplicitDecodes(num_reqs,
    # sum_offset + num_reqs x q, max_offset + q) at its scheduler step q = step 1's + i - 1; its shared KV
    num_reqs: int
    sum_offset: int
    max_offset: int
    shared: int
    q: int  # step 2's scheduler step
    limit: int  # its last step that may be priced (`SimScheduler.quiet_run`'s; `stop` once cut)
    # the steps scheduled (`Simulation._window_schedule`: up to step scheduled + 1, possibly ahead of
    # `applied` for a scrape, `Simulation.catch_up`) and the KV pool's free blocks and usage after each
    scheduled: int = 0
    next_event: Optional[int] = None  # the scheduler step of the next member event (None: none), as scheduled
    free: list[int] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    # the last step whose outputs the front end has (`Simulation._window_give`: at its arrivals and wake-ups, ahead
    # of `applied`; never behind it in async scheduling, the only one with a front end)
    given: int = 0


@dataclass(slots=True)
class SimHooks:
    """Callbacks a driver (a cluster, the P/D path) sets on a `Simulation` after building it; None: nobody listens."""
    # (request id, t) when its client gave up (`timeout_s`) and the engine aborted it
    on_abort: Optional[Callable[[str, float], None]] = None
    # (request, kv_transfer_params) when a finished request's output carries a KV connector's hand-off (a P/D
    # producer's; sim/pd_cluster.py passes it to the decode instance)
    on_kv_transfer_params: Optional[Callable[[str, dict], None]] = None
    # (workload request id, t) when a workload request's first output token is processed (a router that
    # releases a load charge at the first token: llm-d's inflight-load-producer)
    on_first_token: Optional[Callable[[str, float], None]] = None


@dataclass(slots=True)
class _Pending:
    request: WorkloadRequest
    done: simpy.Event
    remaining: int = 0
    t_engine: float = 0.0  # when it reached the engine
    child: Optional[Request] = None  # the engine's request, kept when its output tokens are wanted
    got_token: bool = False  # an output token of it was processed (`SimHooks.on_first_token`)


def _num_samples(result: StepResult) -> int:
    """Requests that sampled a token in the scheduled step: the outputs a front end streams for it
    (implicit decode rows each sample one; counted here, at execution, because in async mode a
    materialised member's last implicit token is applied explicitly one step later)."""
    mro, so = result.model_output, result.scheduled
    explicit = sum(1 for toks in mro.sampled_token_ids if toks) if mro is not None else 0
    return explicit + (so.implicit_decodes.num_reqs if so.implicit_decodes is not None else 0)


# (speed: a workload's requests differ in few sampling settings - their output lengths - and nothing changes a
# request's SamplingParams once it is made (vLLM's engine shares one object between the children of an n > 1
# request as well): one object per setting instead of building and validating it per request)
_WORKLOAD_PARAMS: dict[tuple[int, int, Optional[int]], SamplingParams] = {}
_WORKLOAD_PARAMS_MAX = 1 << 14


def workload_sampling_params(max_tokens: int, n: int, eos_token_id: Optional[int]) -> SamplingParams:
    """A workload request's SamplingParams: `max_tokens`, `n`, and, with `eos_token_id`, the EOS that forces its
    end (None: it ignores EOS); the same object for the same settings."""
    key = (max_tokens, n, eos_token_id)
    params = _WORKLOAD_PARAMS.get(key)
    if params is None:
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=eos_token_id is None)
        if eos_token_id is not None:
            params.update_from_generation_config(eos_token_id)
        if len(_WORKLOAD_PARAMS) < _WORKLOAD_PARAMS_MAX:
            _WORKLOAD_PARAMS[key] = params
    return params


class Simulation:
    def __init__(self, engine: EngineCore, requests: Sequence[WorkloadRequest],
                 arrival: ArrivalProcess, *, rng: Optional[np.random.Generator] = None,
                 run: str = "sim", eos_token_id: int = DEFAULT_EOS_TOKEN_ID,
                 max_time_s: Optional[float] = None, record_step_requests: bool = True,
                 fast_forward: bool = True, lazy_decode: bool = True, fused_steps: bool = True,
                 step_windows: bool = True, frontend: Any = None,
                 on_complete: Optional[Callable[[str, float], None]] = None,
                 on_reject: Optional[Callable[[str, str], None]] = None,
                 env: Optional[simpy.Environment] = None, settler: Optional["Settler"] = None) -> None:
        # `env`: a shared environment (a cluster runs many engines in one, `servetwin.sim.cluster`), whose
        # engines settle one at a time through a shared `settler`
        self.env = simpy.Environment() if env is None else env
        self.settler = settler
        self.engine = engine
        self.requests = list(requests)
        self.arrival = arrival
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.max_time_s = max_time_s
        self.recorder = TraceRecorder(run, "sim", record_step_requests=record_step_requests)
        # Implicit steady decodes (sim/scheduler.py): exact, and they make the per-request step rows
        # implicit, so only without `step_requests`; they replace the (sync-only) decode fast-forward.
        ex = engine.executor
        # pipeline parallelism: each batch booked on the stages (sim/pipeline.py); the shortcuts assume
        # one batch at a time, so they are off
        self.pipeline = getattr(ex, "pipeline", None)
        if self.pipeline is not None:
            lazy_decode = fast_forward = False
        # (both handle full-attention and sliding-window KV cache groups, a window's frees replayed at
        # their step; not chunked local attention: `SimScheduler.lazy_decode_supported`)
        # speculative decoding: both off (their steady decode rows sample one token each, no drafts)
        drafting = bool(getattr(engine.scheduler, "num_spec_tokens", 0))
        # a KV connector: both off too (its worker side prices every step's transfers, sim/kv_transfer.py)
        plain = not drafting and getattr(engine.scheduler, "connector", None) is None
        self.lazy_decode = bool(lazy_decode and plain and not record_step_requests
                                and isinstance(engine.scheduler, SimScheduler)
                                and hasattr(ex, "lazy_tokens") and getattr(ex, "token_rule", None) == "request"
                                and engine.scheduler.lazy_decode_supported())
        if self.lazy_decode:
            engine.scheduler.enable_lazy_decode(ex)
        # fused implicit-decode steps (`_fused_step`): with implicit decodes, one batch at a time, no KV worker
        self._shortcuts = _Shortcuts(
            fast_forward=fast_forward and not self.lazy_decode and plain,
            fused=(fused_steps and self.lazy_decode and self.pipeline is None
                   and getattr(ex, "kv_worker", None) is None and hasattr(ex, "implicit_decode_duration")))
        self.eos_token_id = eos_token_id
        self.on_complete = on_complete
        self.on_reject = on_reject
        self.hooks = SimHooks()  # the callbacks a driver sets after construction
        self._inbox: list[_Pending] = []
        self._aborts: list[_Pending] = []  # client timeouts, applied at the next step start
        self._seq = -1
        self._by_child: dict[str, _Pending] = {}
        self._wake: Optional[simpy.Event] = None
        self._arrivals_done = False
        self._t_end: dict[int, float] = {}
        self._pipeline_end: dict[int, float] = {}  # step -> when its batch leaves the last stage
        # called with this simulation at each step boundary, before and after the step (vLLM's engine
        # publishes its request counts there for the DP coordinator, core.py:1621-1645); None: nobody listens
        self.on_step_boundary: Optional[Callable[["Simulation"], None]] = None
        self.result = SimResult(self.recorder, 0.0, 0)
        # the API-server front end (None: offline); `frontend` is a servetwin.sim.frontend.FrontendConfig
        # (`FrontendConfig.resolved(device_type)` picks the hardware's default coefficients)
        self.frontend = None
        self._in_frontend = 0  # requests submitted to the front end, not yet at the engine
        self._num_samples: dict[int, int] = {}  # step -> requests that sampled a token in it
        if frontend is not None and frontend.type == "api_server":
            from servetwin.sim.frontend import ApiServerFrontend  # noqa: PLC0415

            self.frontend = ApiServerFrontend(self.env, frontend.spec(), frontend.endpoint, self._from_frontend,
                                              frontend.api_server_count, frontend.ingress)
        # step windows (`_plan_window`): with fused steps, in a run to its end (no `max_time_s`), in async
        # scheduling, or in sync scheduling without a front end (ties, `_plan_window`)
        self._shortcuts.windows = (step_windows and self._shortcuts.fused and max_time_s is None
                                   and (engine.batch_queue_size > 1 or self.frontend is None))
        if self._shortcuts.windows and self.frontend is not None:
            self.frontend.before_wake = self._outputs_before_now

    @property
    def fast_forward(self) -> bool:
        """Whether steady decode steps are fast-forwarded (servetwin.sim.fast_forward)."""
        return self._shortcuts.fast_forward

    @property
    def num_fused_steps(self) -> int:
        """Engine steps done by the fused implicit-decode step."""
        return self._shortcuts.count

    @property
    def window_stats(self) -> tuple[int, int]:
        """(step windows, steps inside them)."""
        return self._shortcuts.num_windows, self._shortcuts.window_steps

    # -- submission ------------------------------------------------------------------------------
    def submit(self, request: WorkloadRequest, done: Optional[simpy.Event] = None) -> simpy.Event:
        """Hand a request to the engine (added at the next step start); fires when it completes."""
        self._window_cut()
        pending = _Pending(request, self.env.event() if done is None else done, t_engine=self.env.now)
        self._inbox.append(pending)
        self._poke()
        return pending.done

    def accept(self, request: WorkloadRequest) -> simpy.Event:
        """A request from the client side: through the front end when one is modelled, else straight to
        the engine (what the arrival process does; a cluster's router calls it per instance)."""
        return self.submit(request) if self.frontend is None else self._to_frontend(request)

    def wake(self) -> None:
        """Something outside the engine changed what it can do (a remote read of its KV ended): an idle engine
        loop runs again."""
        self._window_cut()
        self._poke()

    def close_arrivals(self) -> None:
        """No more requests will be accepted: the engine process ends once its work is done."""
        self._arrivals_done = True
        self._poke()

    def _to_frontend(self, request: WorkloadRequest) -> simpy.Event:
        # the front end's CPU: the outputs of the steps that ended before now first; a window goes on (the
        # engine's steps stay the same until the request reaches it, `submit`) while its outputs may be given
        # later, else it ends with the step in progress (its outputs from then on at their own times)
        self._outputs_before_now()
        self._in_frontend += 1
        done = self.frontend.submit(request)
        window = self._shortcuts.window
        if window is not None and not self.frontend.outputs_deferrable(window.ends[window.stop]):
            self._window_cut()
        return done

    def _outputs_before_now(self) -> None:
        """The front end's CPU is read now (a request reaches it, one of its wake-ups fires): the outputs of the
        window's steps that ended before now handed over first (`ApiServerFrontend.outputs_at`)."""
        # (speed: the outputs alone, `_window_give`; the engine's part of those steps - scheduled, their trace rows -
        # is left to the window's close or cut, in fewer and larger calls: nothing reads it before then - the front
        # end reads neither, a scrape brings the scheduler up to its time itself, `catch_up`, and the trace rows are
        # the same rows in the same order; the ladder's first 6,573 requests: 19,675 -> 10,814 calls of
        # `_window_schedule` and `on_implicit_steps`, ~5% less CPU in the loop, measured under load)
        window = self._shortcuts.window
        if window is not None:
            self._window_give(window, bisect_left(window.ends, self.env.now, window.given + 1, window.stop) - 1)

    def _from_frontend(self, request: WorkloadRequest, done: simpy.Event) -> None:
        self._in_frontend -= 1
        self.submit(request, done)

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _admit(self) -> None:
        inbox, self._inbox = self._inbox, []
        for pending in inbox:
            wreq = pending.request
            params = workload_sampling_params(wreq.max_tokens, wreq.n,
                                              None if wreq.eos_at is None else self._forcing_eos_id())
            children = fan_out(wreq.request_id, params)
            # distinct arrival stamps in submission order (vLLM's wall-clock stamps never tie; the
            # priority policy breaks ties by arrival time)
            reqs = [Request(cid, wreq.prompt_token_ids, p, arrival_time=wreq.arrival_s + self._next_seq() * 1e-9,
                            priority=wreq.priority,
                            parent_id=wreq.request_id if wreq.n > 1 else None)
                    for cid, p in children]
            try:
                for req in reqs:
                    self.engine.scheduler.check_servable(req)
            except UnservableRequestError as exc:
                self.result.rejected[wreq.request_id] = str(exc)
                pending.done.succeed()
                if self.on_reject is not None:
                    self.on_reject(wreq.request_id, str(exc))
                continue
            pending.remaining = len(reqs)
            if wreq.keep_output_tokens:
                if len(reqs) != 1:
                    raise ValueError(f"workload: {wreq.request_id}: keep_output_tokens needs n = 1, got n = {wreq.n}")
                pending.child = reqs[0]
            for req in reqs:
                if wreq.kv_transfer_params is not None:  # the connector marks its copy done
                    req.kv_transfer_params = dict(wreq.kv_transfer_params)
                if wreq.eos_at is not None:
                    self.engine.executor.set_output_length(req.request_id, wreq.eos_at)
                self.engine.add_request(req)
                self.recorder.on_arrival(req, wreq.arrival_s,
                                         pending.t_engine if self.frontend is not None else None)
                self._by_child[req.request_id] = pending
            if wreq.timeout_s is not None:
                self._shortcuts.timeouts += 1
                self.env.process(self._client_timeout(pending, wreq.arrival_s + wreq.timeout_s))

    def _client_timeout(self, pending: _Pending, deadline: float) -> Generator[simpy.Event, Any, None]:
        """The client gives up at `deadline`; the abort reaches the engine at its next step start (as
        vLLM's engine core reads an ABORT from its input queue between steps)."""
        yield self.env.timeout(max(0.0, deadline - self.env.now))
        self._shortcuts.timeouts -= 1
        if not pending.done.triggered:
            self._aborts.append(pending)
            self._poke()

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        now = float(self.env.now)
        for pending in aborts:
            if pending.done.triggered or pending.request.request_id in self.result.completion_s:
                continue  # it completed in the meantime (at the engine: its last chunk is on its way to the client)
            wreq = pending.request
            ids = [cid for cid, p in self._by_child.items() if p is pending]
            for cid in ids:  # one abort per id, in child order (no set-order dependence)
                self.engine.abort_requests([cid])
                del self._by_child[cid]
                self.recorder.on_abort(cid, now)
            self.result.aborted_s[wreq.request_id] = now
            pending.done.succeed()
            if self.hooks.on_abort is not None:
                self.hooks.on_abort(wreq.request_id, now)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _forcing_eos_id(self) -> int:
        ex = self.engine.executor
        if not hasattr(ex, "set_output_length"):
            raise ValueError("workload: requests with a forced EOS (finish: eos) need the SimExecutor")
        if ex.eos_token_id is None:
            ex.eos_token_id = self.eos_token_id
        return ex.eos_token_id

    # -- processes -------------------------------------------------------------------------------
    def _arrivals(self) -> Generator[simpy.Event, Any, None]:
        submit = self.submit if self.frontend is None else self._to_frontend
        yield from self.arrival.process(self.env, self.requests, submit, self.rng)
        self.close_arrivals()

    def _all_submitted(self) -> bool:
        return self._arrivals_done and not self._in_frontend

    def _complete(self, result: StepResult, t: float) -> None:
        on_first_token = self.hooks.on_first_token
        if on_first_token is not None:
            self._first_tokens(result, t, on_first_token)
        done, num_finished = [], 0
        for out in result.outputs:
            if out.finish_reason is None:
                continue
            num_finished += 1
            if out.kv_transfer_params is not None and self.hooks.on_kv_transfer_params is not None:
                self.hooks.on_kv_transfer_params(out.request_id, out.kv_transfer_params)
            pending = self._by_child.pop(out.request_id, None)
            if pending is None:
                continue
            pending.remaining -= 1
            if pending.remaining == 0:
                self.result.completion_s[pending.request.request_id] = t
                if pending.child is not None:  # every token is in the request once it finished
                    pending.request.output_token_ids = list(pending.child.output_token_ids)
                done.append(pending.done)
                if self.on_complete is not None:
                    self.on_complete(pending.request.request_id, t)
        if self.frontend is None:
            for event in done:
                event.succeed()
            return
        num_outputs = self._num_samples.pop(result.processed.step, 0) if result.processed is not None else 0
        self.frontend.on_step_output(t, num_outputs, num_finished, done)

    def _first_tokens(self, result: StepResult, t: float, on_first_token: Callable[[str, float], None]) -> None:
        """`hooks.on_first_token` for each workload request whose first output token this step's output carries
        (implicit decode steps never do: their members had their first token in a listed row)."""
        for out in result.outputs:
            if not out.new_token_ids:
                continue
            pending = self._by_child.get(out.request_id)
            if pending is not None and not pending.got_token:
                pending.got_token = True
                on_first_token(pending.request.request_id, t)

    def _settle(self) -> Generator[simpy.Event, Any, None]:
        """Return once no other event is scheduled at the current time (public SimPy API only)."""
        if self.settler is not None:
            yield self.settler.wait()
            return
        env = self.env
        while env.peek() <= env.now:
            yield env.timeout(0)

    def _engine(self) -> Generator[simpy.Event, Any, None]:
        env, engine = self.env, self.engine
        # (speed: looked up once, not per step; the executor's worker side is set when it is built)
        worker = getattr(engine.executor, "kv_worker", None)
        shortcuts = self._shortcuts
        idle = 0
        while True:
            if not self._inbox and not self._aborts and (not engine.has_work() or idle >= MAX_IDLE_ITERATIONS):
                # a KV transfer still running: the engine waits for it (or a new request), it is not stalled
                transfer_due = self._transfer_due() if engine.has_work() else None
                if self._all_submitted() and transfer_due is None:
                    if engine.has_work():
                        raise RuntimeError(
                            f"simulation stalled at t={env.now:.6f}s: the engine holds requests but "
                            "schedules nothing and no more requests will arrive")
                    return
                self._wake = env.event()
                if transfer_due is None:
                    yield self._wake
                else:
                    yield env.any_of([self._wake, env.timeout(max(0.0, transfer_due - env.now))])
                idle = 0
            # (speed, per step: the settling generator only when another event is due now, and the
            # abort and admission passes only with something to apply; each would do nothing otherwise)
            # (a cluster's settler: only when another event is due now or another engine waits to
            # settle; else its wait would be a zero-delay event processed next, changing nothing)
            if env.peek() <= env.now or (self.settler is not None and self.settler.has_waiting()):
                yield from self._settle()
            if self._aborts:  # (the last fused batch first: it keeps the engine busy, `has_work`, below)
                self._unfuse()
                self._apply_aborts()
            if self._inbox:
                self._admit()
            if self.on_step_boundary is not None:
                self.on_step_boundary(self)
            if not engine.has_work():
                continue
            if shortcuts.fast_forward:
                durations = fast_forward(engine, self.recorder, env.now, env.peek())
                if durations:
                    self.result.num_steps += len(durations)
                    num_running = len(engine.scheduler.running)
                    for d in durations:
                        yield env.timeout(d)
                        if self.frontend is not None:  # every running request got one token
                            self.frontend.on_step_output(env.now, num_running, 0, [])
                    continue
            if shortcuts.fused:
                fused = self._fused_step(shortcuts, env.now)
                if fused is not None:
                    idle = 0
                    if fused[0] > 0:  # (a batch priced 0 s: no event, as for a normal step)
                        window = self._plan_window(env.now, fused[0]) if shortcuts.windows else None
                        if window is None:
                            yield env.timeout(fused[0])
                        else:
                            yield window.wake
                            self._window_close(window)
                            fused = (fused[0], fused[1], env.now)  # (sync: the last step's batch ends now)
                    if fused[1]:  # sync: the step's own batch, processed at its end
                        self._fused_complete(fused[1], fused[2])
                    if self.on_step_boundary is not None:
                        self.on_step_boundary(self)
                    continue
            t0 = env.now
            if worker is not None:  # a step waiting for KV transfers ends by the next other event
                worker.clock_s = env.now  # (transfers run on while the engine is idle)
                worker.horizon_s = env.peek() - env.now
            result, duration = self.step_engine()
            progressed, t_done = self.record_step(result, t0, duration)
            idle = 0 if progressed else idle + 1
            if duration > 0:
                yield env.timeout(duration)
            if t_done > t0:
                self._complete(result, t_done)
            if self.on_step_boundary is not None:
                self.on_step_boundary(self)

    # -- the fused implicit-decode step -----------------------------------------------------------
    def _fused_step(self, state: _Shortcuts, t0: float) -> Optional[tuple[float, int, float]]:
        """An engine step whose batch is the implicit decode rows alone and whose processed batch has no
        output (`SimScheduler.quiet_step` says when; most steps of a cluster's engines, which hold a few
        requests each) done in one go: the scheduler's step, the duration from the cost model
        (`SimExecutor.implicit_decode_duration`), the trace row (`TraceRecorder.on_implicit_step`) and
        the front end's step output, without the `SchedulerOutput`, stats and runner output of
        `EngineCore.step` - the same state, rows and events as `step_engine` + `record_step`
        (tests/sim/test_sim_fused_step.py). Returns (duration, the samples of its own batch to
        complete at its end - sync scheduling - else 0, that end), or None: not such a step, nothing
        changed."""
        engine = self.engine
        sched = engine.scheduler
        queue = engine.batch_queue
        in_flight = engine.batch_queue_size > 1  # async: the step processes the previous batch
        fused = state.batch
        if in_flight:
            if fused is not None:
                prev_step, prev_end = fused[0], fused[5]
            elif len(queue) == 1 and not queue[0][0].num_scheduled_tokens:
                prev_step = queue[0][0].step
                prev_end = self._t_end[prev_step]
            else:
                return None
            if prev_end > t0:
                return None
        elif queue:
            return None
        step, sched_step = engine.step_counter, sched.current_step
        implicit = sched.quiet_step()
        if implicit is None:
            return None
        finished = sched.take_quiet_finished()
        if finished:  # (the step after a finish: the runner forgets them, as from its `finished_req_ids`)
            engine.executor.forget_requests(finished)
        kv = sched.kv_cache_manager
        shared = sched.shared_kv_tokens()
        duration = engine.executor.implicit_decode_duration(implicit, shared)
        if duration is None:
            raise RuntimeError("implicit decodes: the executor cannot price a fused step it said it could")
        t_end = t0 + duration
        engine.step_counter += 1
        self.result.num_steps += 1
        state.count += 1
        if not in_flight:  # sync: the step processes its own batch
            sched.last_updated_step = sched_step
            prev_step = step
        elif fused is not None:
            prev_samples = fused[2].num_reqs
            sched.last_updated_step = fused[1]
        else:  # a listed batch without rows: its update applies nothing (no member has a pending output)
            pso, pmro = queue.pop()
            if sched.update_from_output(pso, pmro):
                raise AssertionError("implicit decodes: a batch without rows had outputs")
            self._t_end.pop(prev_step)
            prev_samples = self._num_samples.pop(prev_step, 0)
        self.recorder.on_implicit_step(step, sched_step, t0, t_end, implicit, len(sched.running),
                                       kv.num_free_blocks, kv.usage, shared, prev_step)
        if not in_flight:
            return duration, implicit.num_reqs, t_end
        state.batch = (step, sched_step, implicit, shared, duration, t_end)
        self._fused_complete(prev_samples, prev_end)
        return duration, 0, t_end

    def _fused_complete(self, num_samples: int, t: float) -> None:
        """A fused step's processed batch completes at `t`: no request finished, `num_samples` got a token."""
        if self.frontend is not None:
            self.frontend.on_step_output(t, num_samples, 0, [])

    def _unfuse(self) -> None:
        """The last fused step's batch into the engine's batch queue, as `EngineCore.step` left it there."""
        state = self._shortcuts
        fused = state.batch
        if fused is None:
            return
        state.batch = None
        step, sched_step, implicit, shared, duration, t_end = fused
        so = SchedulerOutput([], CachedRequestData(), {}, implicit.num_reqs, set(), set(), step=step,
                             scheduler_step=sched_step, shared_kv_tokens=shared, implicit_decodes=implicit)
        self.engine.batch_queue.appendleft((so, ModelRunnerOutput([], {}, [], timing=StepTiming(duration_s=duration))))
        self._t_end[step] = t_end
        if self.frontend is not None:
            self._num_samples[step] = implicit.num_reqs

    # -- step windows -----------------------------------------------------------------------------
    # A run of fused steps whose members stay implicit - no member event, or only KV events done in place
    # (a new block, a full block registered, a sliding window's drop) - (async scheduling: each step
    # processes the previous one's batch) is one SimPy event: `_plan_window` prices the steps ahead
    # (`WINDOW_FIRST_STEPS`, then more at the planned end while still quiet, `_window_extend`) and waits for
    # the last one's end; what the step-by-step run does at each step end in between - the next step
    # scheduled (`_fused_step`; its members' KV events done in place, `SimScheduler._in_place_step`),
    # the previous batch's outputs to the front end - is applied later with that step's own times, by
    # `_window_close` at the window's end, or by `_window_cut` when something reaches this engine before
    # (a request, a wake-up): the actions before the current time are applied, and the engine wakes at
    # the end of the step in progress, as the step-by-step run. A cluster's scrape of the KV usage first
    # schedules the steps before its time (`catch_up`: their KV events). A request reaching the front end,
    # or a wake-up of the front end (its CPU's next job done: an ingress in service), first hands it the
    # outputs of the steps that ended before (`_outputs_before_now`: the outputs alone, `_window_give`; the steps'
    # scheduling and trace rows wait for the close or cut); the window goes on.
    # Exact (tests/sim/test_sim_step_windows.py) because, inside a window:
    # - the steps are certain to be quiet (`SimScheduler.quiet_run`: before every member's terminal event,
    #   every allocation within the free blocks, no block shared by several requests dropped), so their
    #   batch - rows, sum and max of C - and their shared KV tokens are known ahead: the durations are;
    #   the commit runs the steps and raises if one was not quiet after all;
    # - nothing else reads or changes what the deferred actions change: the scheduler's waiting/running
    #   counts stay (no admission, no finish); its KV usage, which a scrape reads, is brought up to the
    #   scrape's time (`catch_up`); the front end reads the outputs only at its own events - an arrival, a
    #   wake-up - each of which first has the outputs received before it handed over, at their own times
    #   with the wake-ups between them at theirs (`ApiServerFrontend.outputs_at`, `outputs_deferrable`: no
    #   output completing a request waits there, an ingress done reaches the engine after the event that
    #   hands over its outputs); no step-boundary hook, KV worker, client timeout or abort is pending;
    # - the times are the step-by-step run's floats: ends[i] = ends[i - 1] + durations[i], as SimPy's
    #   `now + delay`, and each timeout lands on exactly its end (`_delay_to`);
    # - ties: a cut at exactly a step end (a request reaching the engine at the time a step ends) is
    #   ordered by SimPy's event ids in the step-by-step run; here it does not matter: the step-by-step
    #   engine schedules the next step after everything else at that time (it settles first, `_settle`),
    #   which is what the cut leaves to the woken engine, and it hands the step's outputs to the front end
    #   then too in async scheduling (in sync scheduling it does so before settling, at a time that depends
    #   on the event ids: so no windows in sync scheduling with a front end). A scrape at exactly a step
    #   end reads the KV usage before the next step's KV events, as the settling engine lets it. Other
    #   events at a step end (other engines, the arrival process) do not touch this engine's state.
    def _plan_window(self, t0: float, d1: float) -> Optional[_Window]:
        """After a fused step at `t0` of `d1` seconds: a window of it and the quiet steps after it, or None
        (the engine waits for that step alone)."""
        state = self._shortcuts
        frontend = self.frontend
        if (self._inbox or self._aborts or state.timeouts or self.on_step_boundary is not None
                or (frontend is not None and not frontend.outputs_deferrable(t0))):
            return None
        in_flight = state.batch is not None  # async: each step processes the previous one's batch
        engine = self.engine
        sched = engine.scheduler
        run = sched.quiet_run(WINDOW_MAX_STEPS - 1)
        if run is None:
            return None
        n, k, sum_offset, max_offset = run
        q = sched.current_step  # the scheduler step of the window's step 2
        if in_flight and (state.batch[:2] != (engine.step_counter - 1, q - 1) or state.batch[2].num_reqs != k):
            raise AssertionError("step window: step 1 is not the last fused step")
        shared = sched.shared_kv_tokens()  # (`quiet_run`: it stays)
        window = _Window([t0, t0 + d1], [0.0, d1], 0, 1, self.env.event(), k, sum_offset, max_offset, shared, q,
                         limit=1 + n, next_event=sched.lazy.next_event_step())
        if not self._window_extend(window, t0):
            return None
        state.window = window
        return window

    def _window_extend(self, window: _Window, now: float) -> bool:
        """Price the window's next steps up to its limit (`quiet_run`'s), at most as many as it has (at least
        `WINDOW_FIRST_STEPS`: most windows are cut by an arrival within a few dozen steps, so pricing all
        that are quiet would be mostly wasted), and wait for the last one's end from `now`, the end of its
        step `stop`; False (nothing changed): no step to add - the window ends with step `stop`."""
        stop = window.stop
        m = min(window.limit - stop, max(WINDOW_FIRST_STEPS, stop))
        if m <= 0:
            return False
        k = window.num_reqs
        q = window.q + stop - 1  # the scheduler step of step stop + 1
        priced = self.engine.executor.implicit_decode_durations(
            ImplicitDecodes(k, window.sum_offset + k * q, window.max_offset + q), window.shared, m)
        if priced is None:
            return False
        ends, durations = window.ends, window.durations
        del ends[stop + 1:], durations[stop + 1:]  # (steps priced before whose end no delay landed on)
        if priced and min(priced) > 0:
            # (speed: the ends in one pass - accumulate's running sum is the loop's `t += d`, the same floats)
            sums = accumulate(priced, initial=ends[stop])
            next(sums)
            ends += sums
            durations += priced
        else:
            t = ends[stop]
            for d in priced:
                if not d > 0:  # (a step priced 0 s takes no event: left to the step-by-step path)
                    window.limit = len(ends) - 1
                    break
                t += d
                ends.append(t)
                durations.append(d)
        end = len(ends) - 1
        delay = None
        while end > stop:
            delay = _delay_to(now, ends[end])
            if delay is not None:
                break
            end -= 1
        frontend = self.frontend
        if delay is None or (frontend is not None and not frontend.outputs_deferrable(ends[end])):
            return False
        window.stop = end
        self.env.timeout(delay).callbacks.append(lambda _e, w=window, i=end: self._window_due(w, i))
        return True

    def _window_due(self, window: _Window, stop: int) -> None:
        """A window's wake-up at the end of its step `stop` (stale when the window was cut before): the window
        goes on if more steps are quiet (`_window_extend`), else the engine wakes."""
        if window.stop == stop and self._shortcuts.window is window:
            if not self._window_extend(window, self.env.now):
                window.wake.succeed()
        else:
            self._shortcuts.stale += 1

    def _window_schedule(self, window: _Window, upto: int) -> None:
        """The scheduler's part of the actions at the ends of the window's steps scheduled+1 .. upto: steps
        scheduled+2 .. upto+1 scheduled (`SimScheduler.quiet_steps`: member KV events done in place), the KV
        pool's free blocks and usage after each kept for their trace rows."""
        n = upto - window.scheduled
        if n <= 0:
            return
        window.scheduled = upto
        sched = self.engine.scheduler
        in_flight = self._shortcuts.batch is not None  # async: each step processes the previous one's batch
        free, usage = sched.quiet_steps(n, 1 + in_flight)
        window.free += free
        window.usage += usage
        lazy = sched.lazy
        window.next_event = lazy.next_event_step()
        if (len(lazy.members), lazy.sum_offset, sched.shared_kv_tokens()) \
                != (window.num_reqs, window.sum_offset, window.shared):
            raise AssertionError("step window: the steps' batch or shared KV changed, against `quiet_run`")
        sched.last_updated_step = sched.current_step - 1 - in_flight

    def _window_apply(self, window: _Window, upto: int) -> None:
        """The actions at the ends of the window's steps applied+1 .. upto, with their own times: what
        `_fused_step` does at each (step i's batch processed, its outputs handed to the front end - async
        scheduling - and step i + 1 scheduled), for the steps `SimScheduler.quiet_run` found quiet."""
        first = window.applied + 1
        n = upto + 1 - first
        if n <= 0:
            return
        self._window_schedule(window, upto)
        window.applied = upto
        state, engine = self._shortcuts, self.engine
        sched = engine.scheduler
        step, q = engine.step_counter, window.q + first - 1  # step i + 1's (i = first)
        in_flight = state.batch is not None  # async: each step processes the previous one's batch, else its own
        engine.step_counter += n
        self.result.num_steps += n
        state.count += n
        k, sum_offset, max_offset, shared = window.num_reqs, window.sum_offset, window.max_offset, window.shared
        ends = window.ends
        starts = ends[first:upto + 1]  # (step i + 1 starts when step i ends: its batch's outputs go out then)
        self.recorder.on_implicit_steps(step, q, starts, ends[first + 1:upto + 2],
                                        ImplicitDecodes(k, sum_offset + k * q, max_offset + q), len(sched.running),
                                        window.free[first - 1:upto], window.usage[first - 1:upto], [shared] * n,
                                        step - in_flight)
        if not in_flight:
            return  # (sync: no front end, `_plan_window`)
        last_q = q + n - 1
        state.batch = (step + n - 1, last_q, ImplicitDecodes(k, sum_offset + k * last_q, max_offset + last_q), shared,
                       window.durations[upto + 1], ends[upto + 1])
        self._window_give(window, upto)

    def _window_give(self, window: _Window, upto: int) -> None:
        """The front end's part of the actions at the ends of the window's steps given+1 .. upto (async scheduling):
        step i's batch's outputs received at its end, ends[i] (`ApiServerFrontend.outputs_at`)."""
        first = window.given + 1
        if upto < first:
            return
        window.given = upto
        if self.frontend is not None and self._shortcuts.batch is not None:  # (sync: no front end, `_plan_window`)
            starts = window.ends[first:upto + 1]
            self.frontend.outputs_at(starts, starts, window.num_reqs)

    def _window_close(self, window: _Window) -> None:
        """The engine woke at the end of the window's last step: the actions before it applied."""
        self._window_apply(window, window.stop - 1)
        state = self._shortcuts
        state.window = None
        state.num_windows += 1
        state.window_steps += window.stop

    def _window_apply_before(self, window: _Window, now: float) -> int:
        """The actions of the window's steps that ended before `now` applied; returns the step in progress."""
        i = bisect_left(window.ends, now, window.applied + 1, window.stop)
        self._window_apply(window, i - 1)
        return i

    def catch_up(self) -> None:
        """Bring the scheduler's state up to now for an outside reader (a cluster's scrape of the KV usage):
        the steps a window scheduled before now scheduled (their member KV events done; the window goes
        on, its trace rows and outputs still to come). A step that ends exactly now is not: the
        step-by-step engine settles before its next step."""
        window = self._shortcuts.window
        if window is None:
            return
        upto = bisect_left(window.ends, self.env.now, window.scheduled + 1, window.stop) - 1
        # (steps up to scheduler step q + upto - 1 to schedule: none with a member event, nothing to read)
        if window.next_event is not None and window.q + upto - 1 >= window.next_event:
            self._window_schedule(window, upto)

    def _window_cut(self) -> None:
        """Something reaches this engine now: a window in progress ends with the step in progress (the
        actions of the steps that ended before now applied; the engine wakes at that step's end)."""
        window = self._shortcuts.window
        if window is None:
            return
        now = self.env.now
        i = self._window_apply_before(window, now)
        ends = window.ends
        if i >= window.stop:
            window.limit = window.stop  # (not extended at its end)
            return  # the last step is in progress: the window's own wake-up
        window.stop = window.limit = i
        if ends[i] == now:  # (the engine settles before its next step: after this event, as step by step)
            window.wake.succeed()
            return
        delay = _delay_to(now, ends[i])
        if delay is None:
            raise AssertionError(f"step window: no delay from {now!r} lands on {ends[i]!r}")
        self.env.timeout(delay).callbacks.append(lambda _e, w=window, j=i: self._window_due(w, j))

    def _transfer_due(self) -> Optional[float]:
        """When the engine's next KV transfer in flight ends (None: none is)."""
        worker = getattr(self.engine.executor, "kv_worker", None)
        return worker.next_done_s() if worker is not None and worker.has_in_flight() else None

    # -- one step, in parts (the engine process above; a lockstep DP group drives several engines) --
    def step_engine(self) -> tuple[StepResult, float]:
        """One engine step at the current time: (its result, its batch's predicted duration; 0 if none ran)."""
        self._unfuse()
        result = self.engine.step()
        if self.lazy_decode:  # tokens of implicit steps applied this step: before the step's own
            late = self.engine.scheduler.take_late_tokens()
            if late:
                self.recorder.on_late_tokens(late)
        if self.pipeline is not None:
            return result, self._pipeline_wait(result)
        if result.scheduled is None or result.model_output is None:
            return result, 0.0
        timing = result.model_output.timing
        return result, timing.duration_s if timing is not None else 0.0

    def _pipeline_wait(self, result: StepResult) -> float:
        """Pipeline parallelism: the scheduled batch is booked on the stages (it ends when its last stage
        is done); the engine waits only when it processed a batch, until that batch ended (vLLM's
        `step_with_batch_queue` returns at once after launching one while the queue has room)."""
        now = self.env.now
        so = result.scheduled
        if so is not None and so.total_num_scheduled_tokens > 0 and result.model_output is not None:
            self._pipeline_end[so.step] = self.pipeline.launch(now, result.model_output.timing,
                                                               so.total_num_scheduled_tokens)
        elif so is not None:
            self._pipeline_end[so.step] = now
        if result.processed is None:
            return 0.0
        return max(0.0, self._pipeline_end.pop(result.processed.step) - now)

    def record_step(self, result: StepResult, t0: float, duration: float) -> tuple[bool, float]:
        """Book the step as running [t0, t0 + duration): (whether it progressed, when the batch whose outputs
        it processed ended). Those outputs complete now when that batch ended by t0 (async scheduling: the
        previous batch), else the caller completes them at that time (`complete_step`)."""
        so = result.scheduled
        t_end = t0 + duration  # the scheduled batch's end (pipeline: when it leaves the last stage)
        if so is not None:
            if self.pipeline is not None:
                t_end = self._pipeline_end.get(so.step, t0)
            self._t_end[so.step] = t_end
            if self.frontend is not None:
                self._num_samples[so.step] = _num_samples(result)
            if so.total_num_scheduled_tokens > 0:
                self.result.num_steps += 1
        self.recorder.on_step(result, t0, t_end)
        mro = result.model_output
        progressed = ((so is not None and so.total_num_scheduled_tokens > 0) or bool(result.outputs)
                      or (mro is not None and mro.kv_connector_output is not None))  # a transfer finished
        t_done = self._t_end.pop(result.processed.step) if result.processed is not None else t0
        if t_done <= t0:
            self._complete(result, t_done)  # async: the previous batch, finished at t0
        return progressed, t_done

    def complete_step(self, result: StepResult, t: float) -> None:
        """The step's finished requests complete at `t` (after `record_step` said its batch ends then)."""
        self._complete(result, t)

    def take_inputs(self) -> None:
        """Between steps: the client aborts, then the requests submitted so far reach the engine."""
        self._apply_aborts()
        self._admit()

    def has_inputs(self) -> bool:
        return bool(self._inbox or self._aborts)

    def all_submitted(self) -> bool:
        return self._all_submitted()

    def set_wake(self, event: Optional[simpy.Event]) -> None:
        """The event a new submission (or the end of arrivals) triggers (a lockstep group waits on one)."""
        self._wake = event

    def run(self) -> SimResult:
        self.env.process(self._arrivals())
        engine = self.env.process(self._engine())
        with rare_young_collections():
            if self.max_time_s is not None:
                self.env.run(until=self.max_time_s)
            elif self._shortcuts.windows:
                try:
                    self._run_past_stale_wakes(engine)
                except KeyboardInterrupt:  # (the caller reads the trace so far: the window's steps ended by now)
                    if self._shortcuts.window is not None:
                        self._window_apply_before(self._shortcuts.window, self.env.now)
                    raise
            else:
                self.env.run()
        return self.finish()

    def _run_past_stale_wakes(self, engine: simpy.Process) -> None:
        """`env.run()`, keeping the time of the last event but the stale wake-ups of cut windows (the run's
        end, which a wake-up due after everything else would otherwise move)."""
        env, state = self.env, self._shortcuts
        env.run(until=engine)
        last = env.now
        while (t := env.peek()) != math.inf:
            stale = state.stale
            env.step()
            if state.stale == stale:
                last = t
        state.end_s = last

    def start_engine(self) -> simpy.Process:
        """The engine's process alone (a cluster starts each engine's and routes the arrivals itself)."""
        return self.env.process(self._engine())

    def finish(self) -> SimResult:
        """The result once the environment stopped: outputs still in the front end, late tokens, the
        requests that did not finish."""
        end = self._shortcuts.end_s
        if self._shortcuts.window is not None:  # (a run stopped from outside: the steps ended by now)
            self._window_apply_before(self._shortcuts.window, self.env.now)
        self.result.end_time_s = float(self.env.now if end is None else end)
        if self.frontend is not None:  # outputs still in the front end when the engine stopped
            self.frontend.finish(self.max_time_s)
            self.recorder.set_delivery(self.frontend.deliveries)
            last = self.frontend.deliveries.last_client_time
            if last is not None and (self.max_time_s is None or last <= self.max_time_s):
                self.result.end_time_s = max(self.result.end_time_s, float(last))
        if self.lazy_decode:  # tokens of requests still running when the run was cut
            self.recorder.on_late_tokens(self.engine.scheduler.flush_lazy())
        done = set(self.result.completion_s) | set(self.result.rejected) | set(self.result.aborted_s)
        self.result.unfinished = [r.request_id for r in self.requests if r.request_id not in done]
        return self.result


class Settler:
    """Many engines in one environment: each waits (`wait()`) until no other event is scheduled at the
    current time, one engine at a time in the order they asked. (Engines settling by themselves would each
    keep a zero-delay timeout in the queue and wait for each other forever.) A released engine's own events at
    that time are processed before the next one is released."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self._waiting: deque[simpy.Event] = deque()
        self._releaser: Optional[simpy.Process] = None
        self._wakeup: Optional[simpy.Event] = None

    def has_waiting(self) -> bool:
        """Whether an engine waits to be released."""
        return bool(self._waiting)

    def wait(self) -> simpy.Event:
        env = self.env
        if not self._waiting and env.peek() > env.now:  # nothing else at this time: settled already
            return env.timeout(0)
        event = env.event()
        self._waiting.append(event)
        if self._releaser is None:
            self._releaser = env.process(self._release())
        elif self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        return event

    def _release(self) -> Generator[simpy.Event, Any, None]:
        """One process for the whole run, parked between releases: a process that ended would leave its own
        termination event at the current time, which a released engine would take for another event there
        (its KV transfer wait and fast-forward horizons, `env.peek()`, would shrink to 0)."""
        env = self.env
        while True:
            while self._waiting:
                while env.peek() <= env.now:
                    yield env.timeout(0)
                self._waiting.popleft().succeed()
            self._wakeup = env.event()
            yield self._wakeup
            self._wakeup = None


@contextlib.contextmanager
def rare_young_collections() -> Iterator[None]:
    """`SIM_GC_THRESHOLD0` as the collector's young threshold for the block, the caller's after it."""
    thresholds = gc.get_threshold()
    if thresholds[0]:  # (0: the caller turned the collector off)
        gc.set_threshold(max(thresholds[0], SIM_GC_THRESHOLD0), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def simulate(engine: EngineCore, requests: Sequence[WorkloadRequest], arrival: ArrivalProcess,
             **kwargs: Any) -> SimResult:
    """Run `requests` through `engine` (an `EngineCore` over a `SimExecutor`) in simulated time."""
    return Simulation(engine, requests, arrival, **kwargs).run()


def simulate_workload(engine_args: Any, workload: Mapping[str, Any], run: str = "sim",
                      **kwargs: Any) -> SimResult:
    """Build the engine from `servetwin.core.engine.engine_args.EngineArgs` (backend "sim") and run a workload config."""
    from servetwin.core.engine.engine_args import EngineArgs  # noqa: PLC0415
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415

    args = engine_args if isinstance(engine_args, EngineArgs) else EngineArgs.from_kwargs(**engine_args)
    if args.backend != "sim":
        raise ValueError(f"backend: simulate_workload needs backend 'sim', got {args.backend!r}")
    engine, info = create_engine_core(args)
    spec, requests = build_workload(workload, vocab_size=info.vocab_size)
    return simulate(engine, requests, spec.arrival, rng=rng_streams(spec.seed)["runtime"], run=run,
                    **kwargs)
