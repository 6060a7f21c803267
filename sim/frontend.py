"""The API-server front end as what it is: its own process, with one CPU shared by all its work.

vLLM's `vllm serve` runs the OpenAI-compatible server (uvicorn, FastAPI, the chat template, the
tokenizer, the output processor) in one Python process around one asyncio event loop, apart from the
EngineCore process. Every request in flight is a task on that loop, so the work of all of them
shares one CPU: under load, requests queue in the front end before the engine ever sees them, and
output chunks wait for the CPU behind other requests' parsing. This module models that process:

- ingress (per request, on the front-end CPU): HTTP parse and request validation (`c_req_s`), the
  chat template for the chat endpoint (`c_chat_s`), tokenisation in proportion to the prompt
  (`c_prompt_token_s`), building and encoding the engine request and its ZMQ send (`c_hop_s` +
  `c_hop_token_s` per prompt token); then `latency_in_s` (off the CPU: socket and IPC hops) before
  the request reaches the engine;
- output (per engine step that produced tokens, on the front-end CPU): receiving and decoding the
  step's outputs message (`c_step_s`), per output token its processing and detokenisation
  (`c_token_out_s`), per request the SSE chunk write (`c_chunk_s`), per finished request the final
  chunk, usage and `[DONE]` (`c_finish_s`); then `latency_out_s` (off the CPU) until the client
  reads the chunk. When the front end falls behind, the steps waiting for the output handler are
  handled as one batch whose tokens go out together, one chunk per request: every message and token
  is still processed, but each request writes one chunk per batch. This is vLLM's coalescing (v0.11-
  v0.13, `RequestOutputCollector.put` in vllm/v1/engine/output_processor.py): the output handler
  puts each step's `RequestOutput` into the request's one-slot collector, and in DELTA (streaming)
  mode an output its streaming task has not taken yet is merged with the new one (`RequestOutput.add`,
  tokens and text appended), so a chunk carries every token produced since that request's last chunk.
  An idle front end thus writes one chunk per token (`--stream-interval`, v0.12+, default 1, would
  hold chunks back on purpose; the modelled runs leave it at 1). On the chat
  endpoint the first token goes out as two events, the role chunk (the client's first token) and its
  content, so the client's ITLs of each request start with a ~0 gap (as `vllm bench serve` counts).

The CPU is shared by weighted processor sharing (the fluid limit of an event loop's round robin over
ready tasks): an ingress job is one task (weight 1); a step's output job stands for the output
handler plus one streaming task per request in it (weight = requests in the step). One output
handler processes the engine's step messages in order, so step k's output job starts when step k has
ended and step k-1's output job is done. A burst of N equal requests therefore leaves the front end
together after about N x ingress (what vLLM's server does under `--request-rate inf`), and a busy
front end delays output chunks.

`ingress: in_order` serves the ingress jobs of each API server one at a time, in arrival order (each
still sharing the CPU, weight 1, with the output path): vLLM 0.33 renders chat templates and tokenises
in the renderer's thread pool (vllm/renderers/base.py, `_SwappableExecutor(renderer_num_workers)`,
default 1 worker: vllm/config/model.py), so a burst reaches the engine one request after another
instead of all together. `shared` (the default, what the coefficients were fitted with) is the
processor sharing above. Which one a version shows is in docs/frontend_model.md.

`FrontendSpec` is data (coefficients + provenance), loaded like a hardware spec: a preset name, a
YAML file, or a mapping with an optional `base: <preset>`. The presets are in
`servetwin.sim.frontend_presets`; how they were obtained is in docs/frontend_model.md.

`api_server_count: N` (vLLM's `vllm serve --api-server-count N`): N API-server processes, each with
its own CPU, share the listening socket, so connections - requests - are spread over them (round robin
here); the engine core sends each step's outputs to every server as its own message, holding that
server's requests only. A request's ingress runs on its server's CPU; a step's output work is split
evenly over the N servers (requests are spread evenly, so each handles 1/N of the tokens, chunks and
finished requests, plus its own message) and the step's tokens reach the clients when the last of the
N parts is done. One output sequence is kept for all N (steps in order, as each server's handler keeps
them): a symmetric-load model, exact for N = 1.

The offline front end (`frontend: {type: offline}`, vLLM's `LLM.generate`) has no HTTP path and no
per-request front-end cost in the loop: the simulation hands requests to the engine directly.
"""
from __future__ import annotations

import copy
import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import simpy

from servetwin.core.config_error import ConfigError
from servetwin.core.testbed.trace import DeliveryMap
from servetwin.sim.frontend_presets import FRONTEND_PRESETS
from servetwin.sim.sim_time import call_at
from servetwin.sim.validate import check_keys, check_mapping, non_negative, one_of

FRONTEND_TYPES = ("api_server", "offline")
ENDPOINTS = ("chat", "completions")
INGRESS_MODES = ("shared", "in_order")
_EPS = 1e-12


@dataclass(slots=True)
class FrontendCoefficients:
    """Seconds per unit of work on the front-end CPU (`c_*`) or off it (`latency_*`)."""
    c_req_s: float = 0.0           # per request: HTTP parse, validation, request objects
    c_chat_s: float = 0.0          # per chat request: message parsing + chat template rendering
    c_prompt_token_s: float = 0.0  # per prompt token: tokenisation
    c_hop_s: float = 0.0           # per request: engine request built, msgspec-encoded, sent over ZMQ
    c_hop_token_s: float = 0.0     # per prompt token of that message
    c_step_s: float = 0.0          # per engine outputs message: ZMQ receive + msgspec decode
    c_token_out_s: float = 0.0     # per output token: output processing + detokenisation
    c_chunk_s: float = 0.0         # per request per chunk sent: SSE serialisation + write
    c_finish_s: float = 0.0        # per finished request: final chunk, usage, [DONE], response close
    latency_in_s: float = 0.0      # client -> engine, not on the front-end CPU
    latency_out_s: float = 0.0     # engine step end -> client, not on the front-end CPU

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, non_negative(getattr(self, f.name), f"frontend.coefficients.{f.name}"))

    def ingress_work(self, prompt_tokens: int, chat: bool) -> float:
        return (self.c_req_s + (self.c_chat_s if chat else 0.0) + self.c_hop_s
                + (self.c_prompt_token_s + self.c_hop_token_s) * prompt_tokens)

    def output_work(self, num_messages: int, num_tokens: float, num_chunks: float, num_finished: float) -> float:
        """CPU seconds of one output message (counts are a server's share: fractional with several servers)."""
        return (self.c_step_s * num_messages + self.c_token_out_s * num_tokens + self.c_chunk_s * num_chunks
                + self.c_finish_s * num_finished)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


COEFFICIENT_FIELDS = tuple(f.name for f in fields(FrontendCoefficients))


@dataclass(slots=True)
class FrontendSpec:
    name: str
    coefficients: FrontendCoefficients = field(default_factory=FrontendCoefficients)
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "coefficients": self.coefficients.to_dict(),
                "provenance": copy.deepcopy(self.provenance)}


def frontend_spec_from_dict(cfg: Mapping[str, Any], path: str = "frontend.coefficients") -> FrontendSpec:
    """A `FrontendSpec` from `{name, coefficients, provenance}` (optionally `base: <preset>`)."""
    cfg = check_mapping(cfg, path)
    check_keys(cfg, ("name", "coefficients", "provenance", "base"), path)
    merged: dict[str, Any] = {"name": "custom", "coefficients": {}, "provenance": {}}
    if "base" in cfg:
        merged = copy.deepcopy(FRONTEND_PRESETS[one_of(cfg["base"], FRONTEND_PRESETS, f"{path}.base")])
    coeffs = dict(merged.get("coefficients", {}))
    given = check_mapping(cfg.get("coefficients", {}), f"{path}.coefficients")
    check_keys(given, COEFFICIENT_FIELDS, f"{path}.coefficients")
    coeffs.update(given)
    name = cfg.get("name", merged["name"])
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.name", f"must be a non-empty string, got {name!r}")
    values = {k: non_negative(v, f"{path}.coefficients.{k}") for k, v in coeffs.items()}
    provenance = check_mapping(cfg.get("provenance", merged.get("provenance", {})), f"{path}.provenance")
    return FrontendSpec(name, FrontendCoefficients(**values), copy.deepcopy(dict(provenance)))


def load_frontend_spec(name_or_path: Any, path: str = "frontend.coefficients") -> FrontendSpec:
    """A preset name (`vllm`, `servetwin`), a YAML file path, a mapping, or a `FrontendSpec`."""
    if isinstance(name_or_path, FrontendSpec):
        return name_or_path
    if isinstance(name_or_path, Mapping):
        return frontend_spec_from_dict(name_or_path, path)
    key = str(name_or_path)
    if key in FRONTEND_PRESETS:
        return frontend_spec_from_dict(FRONTEND_PRESETS[key], f"{path}[{key}]")
    p = Path(key)
    if not p.is_file():
        raise ConfigError(f"{path}", f"{key!r} is neither a front-end preset ({', '.join(FRONTEND_PRESETS)}) "
                         "nor an existing YAML file")
    from servetwin.core.safe_yaml import load_yaml_file  # noqa: PLC0415

    data = load_yaml_file(p, path)  # bounded: aliases, nesting, size, encoding
    return frontend_spec_from_dict(data if data is not None else {}, path)


def default_frontend_preset(device_type: str) -> str:
    """vLLM's API server for GPU hardware (the twin predicts vLLM); servetwin's own server measured
    on the development machine for `cpu` hardware (the torch backend's own front end)."""
    return "servetwin" if device_type == "cpu" else "vllm"


# -- the shared CPU -----------------------------------------------------------------------------
@dataclass(slots=True)
class _Job:
    work: float
    weight: float
    on_done: Callable[[float], None]
    seq: int = 0
    v_finish: float = 0.0
    important: bool = True  # someone waits on it (the engine, a client): schedule a wake-up


class SharedCPU:
    """Weighted processor sharing in virtual time: with total weight W in service, virtual time runs
    at 1/W; a job of work w and weight g started at virtual time V finishes when it reaches
    V + w / g. Pure arithmetic (no SimPy): `advance(t)` completes, in order, every job done by t."""

    def __init__(self) -> None:
        self.now = 0.0
        self.virtual = 0.0
        self.weight = 0.0
        self.busy_s = 0.0
        self._heap: list[tuple[float, int, _Job]] = []
        self._seq = 0
        self._important = 0

    def add(self, t: float, job: _Job) -> None:
        if self._heap or t > self.now:  # (else `advance(t)` does nothing)
            self.advance(t)
        self._seq += 1
        job.seq = self._seq
        job.v_finish = self.virtual + job.work / job.weight
        self.weight += job.weight
        self._important += job.important
        heapq.heappush(self._heap, (job.v_finish, job.seq, job))

    @property
    def has_important_jobs(self) -> bool:
        """Whether a job someone waits on (`_Job.important`) is in service."""
        return self._important > 0

    def next_finish(self, important_only: bool = True) -> Optional[float]:
        """Real time at which the first job finishes if nothing else arrives (None: idle, or only
        unimportant jobs when `important_only`)."""
        if not self._heap or (important_only and not self._important):
            return None
        return self.now + (self._heap[0][0] - self.virtual) * self.weight

    @property
    def idle(self) -> bool:
        """Whether no job is in service."""
        return not self._heap

    def alone_finishes(self, starts: Sequence[float], i: int, work: float, weight: float) -> list[float]:
        """Jobs of `work` and `weight` added at starts[i], starts[i + 1], ... to this idle CPU (advanced to
        starts[i]), each one alone: done, as `advance(starts[j + 1])` finds it, before the next is added.
        Runs them as `add` and `advance` would - the same floats (sequence numbers, virtual time, busy
        time), the CPU left idle and advanced to the next start - and returns their finish times; stops
        before a job that would still run at the next start, and before the last start (those: `add`)."""
        if self._heap:
            raise RuntimeError("SharedCPU.alone_finishes: a job is in service")
        out: list[float] = []
        # (speed: the state in locals, written back once; `work / weight` is the same float every time)
        virtual, now, busy, cpu_weight, seq = self.virtual, self.now, self.busy_s, self.weight, self._seq
        per_job = work / weight
        for j in range(i, len(starts) - 1):
            t = starts[j + 1]
            v_fin = virtual + per_job  # (`add`)
            t_fin = now + (v_fin - virtual) * (cpu_weight + weight)  # (`advance(t)`'s first job)
            a = abs(t)
            if t_fin > t + _EPS * (a if a > 1.0 else 1.0):
                break
            if now > t_fin:
                t_fin = now
            if t < t_fin:
                t_fin = t
            seq += 1
            busy += t_fin - now
            virtual = v_fin
            now = t if t > t_fin else t_fin  # (the CPU idle again: `advance`'s tail)
            cpu_weight = 0.0
            out.append(t_fin)
        self.virtual, self.now, self.busy_s, self.weight, self._seq = virtual, now, busy, cpu_weight, seq
        return out

    def advance(self, t: float) -> None:
        heap = self._heap
        if heap:
            a = abs(t)
            limit = t + _EPS * (a if a > 1.0 else 1.0)  # (max(1.0, |t|))
            pop = heapq.heappop
            while heap:
                v_fin, _, job = heap[0]
                now = self.now
                t_fin = now + (v_fin - self.virtual) * self.weight
                if t_fin > limit:
                    break
                pop(heap)
                if now > t_fin:  # (t_fin = min(max(t_fin, now), t))
                    t_fin = now
                if t < t_fin:
                    t_fin = t
                self.busy_s += t_fin - now
                self.now, self.virtual = t_fin, v_fin
                self.weight = self.weight - job.weight if heap else 0.0
                self._important -= job.important
                job.on_done(t_fin)  # may add jobs at t_fin (the output handler's next message)
        if t > self.now:
            if self.weight > 0:
                self.virtual += (t - self.now) / self.weight
                self.busy_s += t - self.now
            self.now = t


# -- the front-end process ------------------------------------------------------------------------
@dataclass(slots=True)
class _StepOutput:
    """The outputs of one step, or of several consecutive steps waiting for the output handler."""
    t_engines: list[float]
    num_tokens: int  # output tokens in all of them
    num_chunks: int  # chunks written: one per request (the largest step's count, a lower bound)
    num_finished: int
    done: list[simpy.Event]

    def merge(self, t_engine: float, num_outputs: int, num_finished: int, done: list[simpy.Event]) -> None:
        self.t_engines.append(t_engine)
        self.num_tokens += num_outputs
        self.num_chunks = max(self.num_chunks, num_outputs)
        self.num_finished += num_finished
        self.done.extend(done)


class ApiServerFrontend:
    """The API server between the clients and a `servetwin.sim.engine.Simulation`.

    `submit(request)` is the clients' side (what an arrival process calls); `on_step_output(...)` is
    the engine's side (called when a step's outputs are processed). `deliveries` maps each step's
    end time to the time its tokens reach the client."""

    def __init__(self, env: simpy.Environment, spec: FrontendSpec, endpoint: str,
                 to_engine: Callable[[Any, simpy.Event], None], api_server_count: int = 1,
                 ingress: str = "shared") -> None:
        self.env = env
        self.spec = spec
        self.coeffs = spec.coefficients
        self.endpoint = one_of(endpoint, ENDPOINTS, "frontend.endpoint")
        self.chat = endpoint == "chat"
        self.to_engine = to_engine
        self.cpus = [SharedCPU() for _ in range(api_server_count)]  # one per API-server process
        self.cpu = self.cpus[0]
        self._single = api_server_count == 1
        self._in_service: Optional[_StepOutput] = None  # the output message the handler works on
        self._on_output_done = self._output_done  # (bound once: one per output job otherwise)
        self.deliveries = DeliveryMap(split_first_chunk=self.chat)
        self._outputs: deque[_StepOutput] = deque()
        self._handler_busy = False
        self._wake_at: Optional[float] = None  # the pending wake-up's target
        self._wake_fire = 0.0  # where its SimPy timeout lands (`now + delay` from its scheduling)
        self._wake_real = False  # whether that timeout exists (a replay's is made at the replay's end)
        self._clock: Optional[float] = None  # in a replay (`outputs_at`): the time of the call replayed
        # set by the engine: called first when a wake-up fires, so that the outputs of the engine's steps
        # received before now (a step window's, given later) are handed over first (`outputs_at`)
        self.before_wake: Optional[Callable[[], None]] = None
        self.ingress = one_of(ingress, INGRESS_MODES, "frontend.ingress")
        # in_order: per server, the ingress jobs waiting for the one in service (None: none in service)
        self._ingress_queues: list[Optional[deque[_Job]]] = [None] * api_server_count
        self.num_requests = 0
        self.num_messages = 0

    # -- clients -> engine --------------------------------------------------------------------------
    def submit(self, request: Any) -> simpy.Event:
        """A client sends `request` now; the returned event fires when its last chunk reached it."""
        done = self.env.event()
        k = self.num_requests % len(self.cpus)  # connections spread round robin
        self.num_requests += 1
        work = self.coeffs.ingress_work(len(request.prompt_token_ids), self.chat)
        if self.ingress == "shared":
            self._add(self.cpus[k], _Job(work, 1.0, lambda t, r=request, d=done: self._ingress_done(t, r, d)))
            return done
        job = _Job(work, 1.0, lambda t, r=request, d=done, k=k: self._in_order_done(t, k, r, d))
        if self._ingress_queues[k] is None:  # none in service: this one starts now
            self._ingress_queues[k] = deque()
            self._add(self.cpus[k], job)
        else:
            self._ingress_queues[k].append(job)
        return done

    def _in_order_done(self, t: float, k: int, request: Any, done: simpy.Event) -> None:
        """An in-order ingress finished at `t`: the next one of its server starts at `t`."""
        queue = self._ingress_queues[k]
        if queue:
            self.cpus[k].add(t, queue.popleft())  # at t, inside the CPU's advance (as the output handler)
        else:
            self._ingress_queues[k] = None
        self._ingress_done(t, request, done)

    def _ingress_done(self, t: float, request: Any, done: simpy.Event) -> None:
        clock = self._clock
        now = self._now()
        delay = self.coeffs.latency_in_s + (t - now)  # t <= now: done while catching up
        if delay > 0:
            if clock is not None:  # a replay: at the time the replayed call's timeout lands on
                self._at(now + delay, lambda _e: self.to_engine(request, done))
                return
            self.env.timeout(delay).callbacks.append(lambda _e: self.to_engine(request, done))
        elif clock is not None:
            raise RuntimeError(f"ApiServerFrontend: an ingress replayed at t={clock} reached the engine before "
                               f"now (t={self.env.now})")
        else:
            self.to_engine(request, done)

    # -- engine -> clients --------------------------------------------------------------------------
    def on_step_output(self, t_engine: float, num_outputs: int, num_finished: int,
                       done: list[simpy.Event]) -> None:
        """The outputs of the step that ended at `t_engine` (`num_outputs` requests got tokens,
        `num_finished` finished; `done`: the events of workload requests it completes)."""
        if num_outputs <= 0 and not done:
            return
        self._output_at(self.env.now, t_engine, num_outputs, num_finished, done)
        self._schedule_wake()

    def _output_at(self, now: float, t_engine: float, num_outputs: int, num_finished: int,
                   done: list[simpy.Event]) -> None:
        """`on_step_output`'s message, received at `now`, up to its wake-up."""
        if self._single:  # (`_advance` of one CPU)
            self.cpu.advance(now)  # first: a job done by now must not start this one early
        else:
            self._advance(now)
        outputs = self._outputs
        if outputs:  # the handler is behind: these go out with the steps already waiting
            outputs[-1].merge(t_engine, num_outputs, num_finished, done)
            return  # (the handler is busy: it takes them when its message is done)
        out = _StepOutput([t_engine], num_outputs, num_outputs, num_finished, list(done))
        if self._handler_busy:
            outputs.append(out)
        elif self._single:  # (`_start_next` of this message at once)
            self._start_output(now, out)
        else:
            outputs.append(out)
            self._start_next(now)

    def outputs_deferrable(self, t: float) -> bool:
        """Whether the outputs of quiet steps received from now up to `t` may be handed over later, at a
        later event's time (`outputs_at`): no output waiting or in service completes a request (its client
        hears of it at its time), and an ingress done meanwhile reaches the engine after that event (its
        completion is computed at a wake-up, which hands the outputs received before it over first,
        `before_wake`; `latency_in_s`, far above the CPU's tolerance `_EPS`, keeps its arrival at the engine
        after the wake-up that completes it however the outputs' load rounds)."""
        if self._completion_waiting():
            return False
        return self.coeffs.latency_in_s > 1e-9 * max(1.0, t) or self.quiet_until(t)

    def _completion_waiting(self) -> bool:
        """Whether an output message waiting or in service completes a request."""
        return any(o.done for o in self._outputs) or (self._handler_busy and bool(self._in_service.done))

    def outputs_at(self, nows: Sequence[float], t_engines: Sequence[float], num_outputs: int) -> None:
        """The outputs of consecutive quiet steps (no request finished, `num_outputs` requests got a token
        each; the i-th received at nows[i] from the step that ended at t_engines[i], all before now), given
        now: every effect is that of `on_step_output` calls at those times with the front end's own
        wake-ups between them at theirs (their SimPy timeouts, an ingress' hand-over to the engine, made
        now to land at the same times), without a SimPy event per call. Only when `outputs_deferrable`
        was true from the first output's time (a wake-up or an arrival since then handed the outputs
        before it over first). Ties: a wake-up due at a step's end comes first (the step-by-step engine
        settles before its next step); one due exactly now, after the event that called this (a wake-up
        superseded then does nothing either way; a request reaching the engine does not touch the front
        end; an arrival at the front end at exactly a wake-up's float time is ordered by SimPy's event ids
        in the step-by-step run - a coincidence of two unrelated floats, not modelled)."""
        if num_outputs <= 0 or not nows:
            return
        if self.quiet_until(nows[-1]):  # (speed: nothing to wake for: `on_step_outputs_at`'s bulk path)
            self.on_step_outputs_at(nows, t_engines, num_outputs)
            return
        if self._completion_waiting():
            raise RuntimeError("ApiServerFrontend.outputs_at: an output completing a request is waiting")
        for now, t_engine in zip(nows, t_engines):
            self._replay_wakes(now, True)  # (a wake-up due at a step's end: before it, the engine settles first)
            self._clock = now
            self._output_at(now, t_engine, num_outputs, 0, [])
            self._schedule_wake()
        self._replay_wakes(self.env.now, False)  # (one due now: its timeout, after the current event)
        self._clock = None
        if self._wake_at is not None and not self._wake_real:
            self._wake_real = True
            self._at(self._wake_fire, lambda _e, at=self._wake_at: self._wake(at))

    def _now(self) -> float:
        """The time of the call being made: the replayed call's inside `outputs_at`, else SimPy's clock."""
        return self.env.now if self._clock is None else self._clock

    def _replay_wakes(self, t: float, inclusive: bool) -> None:
        """`_wake` of the pending wake-up, at its time, while it is due before `t` (or at `t`, `inclusive`)."""
        while self._wake_at is not None and (self._wake_fire < t or (inclusive and self._wake_fire == t)):
            fire = self._wake_fire
            self._clock = fire
            self._wake_at = None
            self._advance(fire)
            self._schedule_wake()

    def _at(self, t: float, callback: Callable[[Any], None]) -> None:
        """`callback` at SimPy time `t` exactly (not before now; `sim_time.call_at`)."""
        call_at(self.env, t, callback)

    def quiet_until(self, t: float) -> bool:
        """Whether the outputs of quiet steps received up to `t` may be given with their times
        (`on_step_outputs_at`): the front end holds no important job (no ingress in flight, no queued
        output completing a request) and no wake-up of its own is due by `t`. Then such outputs add
        only unimportant jobs, read no clock and set no timer."""
        return (not any(cpu.has_important_jobs for cpu in self.cpus) and not any(o.done for o in self._outputs)
                and (self._wake_at is None or self._wake_at > t))

    def on_step_outputs_at(self, nows: Sequence[float], t_engines: Sequence[float], num_outputs: int) -> None:
        """The outputs of consecutive quiet steps - no request finished, `num_outputs` requests got a token
        each - the i-th received at nows[i] (the `env.now` its `on_step_output` call would have had;
        non-decreasing, and not before the front end's last call) from the step that ended at t_engines[i]:
        every effect (the CPUs' state, the output messages, the deliveries) is that of those calls made at
        those times, and none reads `env.now` or creates a SimPy event. Only while the front end is quiet
        (`quiet_until(nows[-1])`): raises RuntimeError otherwise (an important job's wake-up, a request's
        completion, an ingress reaching the engine must happen at its own time, between these outputs)."""
        if num_outputs <= 0 or not nows:
            return  # (as each call would: nothing to send)
        if not self.quiet_until(nows[-1]):
            raise RuntimeError("ApiServerFrontend.on_step_outputs_at: the front end is not quiet up to "
                               f"t={nows[-1]} (an important job, a request's completion or a wake-up is due)")
        if not self._single:
            for now, t_engine in zip(nows, t_engines):
                self._output_at(now, t_engine, num_outputs, 0, [])
            return
        cpu, outputs = self.cpu, self._outputs
        c = self.coeffs
        # each message alone (`_start_output`'s job of one step's outputs, done before the next step's):
        # `SharedCPU.alone_finishes`, without a message or job per step
        work = c.output_work(1, num_outputs, num_outputs, 0)
        weight = float(num_outputs if num_outputs > 1 else 1)
        i, n = 0, len(nows)
        while i < n:  # (`_output_at` of one server, written out)
            now, t_engine = nows[i], t_engines[i]
            cpu.advance(now)
            if outputs:
                outputs[-1].merge(t_engine, num_outputs, 0, [])
                i += 1
                continue
            if not self._handler_busy and cpu.idle:
                finishes = cpu.alone_finishes(nows, i, work, weight)
                if finishes:
                    m = len(finishes)
                    self.num_messages += m
                    latency = c.latency_out_s  # (`_output_done` of each)
                    self.deliveries.add_many(t_engines[i:i + m], [t_done + latency for t_done in finishes])
                    i += m
                    continue
            out = _StepOutput([t_engine], num_outputs, num_outputs, 0, [])
            if self._handler_busy:
                outputs.append(out)
            else:
                self._start_output(now, out)
            i += 1
        # (each call's `_schedule_wake` would find no important job and no completion: nothing to schedule)

    def _start_next(self, t: float) -> None:
        if not self._outputs:
            self._handler_busy = False
            return
        out = self._outputs.popleft()
        if self._single:
            self._start_output(t, out)
            return
        self._handler_busy = True
        self.num_messages += 1
        self._in_service = out
        c = self.coeffs
        # each server: its own message per step, 1/n of the tokens, chunks and finished requests
        n = len(self.cpus)
        work = c.output_work(len(out.t_engines), out.num_tokens / n, out.num_chunks / n, out.num_finished / n)
        left = [n]

        def part_done(tf: float) -> None:
            left[0] -= 1
            if left[0] == 0:  # the slowest server's clients got the step's tokens last
                self._output_done(tf)
        for cpu in self.cpus:
            cpu.add(t, _Job(work, max(1.0, out.num_chunks / n), part_done, important=bool(out.done)))

    def _start_output(self, t: float, out: _StepOutput) -> None:
        """One server: its handler starts on `out` at `t`."""
        self._handler_busy = True
        self.num_messages += 1
        work = self.coeffs.output_work(len(out.t_engines), out.num_tokens, out.num_chunks, out.num_finished)
        self._in_service = out
        chunks = out.num_chunks
        self.cpu.add(t, _Job(work, float(chunks if chunks > 1 else 1), self._on_output_done,  # (max(1, chunks))
                             important=bool(out.done)))

    def _output_done(self, t: float) -> None:
        """The output message in service is done at `t` (on every server): its tokens go to the clients."""
        out = self._in_service
        t_client = t + self.coeffs.latency_out_s
        add = self.deliveries.add
        for t_engine in out.t_engines:
            add(t_engine, t_client)
        for ev in out.done:
            delay = t_client - self.env.now
            if delay > 0:
                self.env.timeout(delay).callbacks.append(lambda _e, ev=ev: ev.succeed())
            else:
                ev.succeed()
        if self._outputs:
            self._start_next(t)
        else:  # (`_start_next` with nothing waiting)
            self._handler_busy = False

    # -- time -----------------------------------------------------------------------------------
    def _add(self, cpu: SharedCPU, job: _Job) -> None:
        self._advance(self.env.now)  # the other servers first: their jobs done by now complete in order
        cpu.add(self.env.now, job)
        self._schedule_wake()

    def _next_finish(self, important_only: bool) -> Optional[float]:
        times = [t for t in (c.next_finish(important_only) for c in self.cpus) if t is not None]
        return min(times) if times else None

    def _advance(self, t: float) -> None:
        """Every server's CPU to `t`, completing jobs in time order across servers (a completion may
        add work to another server: the next output message)."""
        if len(self.cpus) == 1:
            self.cpu.advance(t)
            return
        while True:
            first = min(((t_c, i) for i, c in enumerate(self.cpus) if (t_c := c.next_finish(False)) is not None),
                        default=None)
            if first is None or first[0] > t:
                break
            self.cpus[first[1]].advance(max(first[0], self.cpus[first[1]].now))
        for c in self.cpus:
            c.advance(max(t, c.now))

    def _schedule_wake(self) -> None:
        # a queued message that completes requests waits for the running one, important or not: its
        # end must wake the handler (else the clients hear of their completion at the next event)
        outputs = self._outputs
        important_only = not outputs or not any(o.done for o in outputs)
        if important_only and self._single and not self.cpu.has_important_jobs:
            return  # (`_next_finish` would find nothing)
        t = self._next_finish(important_only)
        if t is None:
            return
        clock = self._clock
        now = self._now()
        t = max(t, now)
        if self._wake_at is not None and self._wake_at <= t + _EPS:
            return  # an earlier wake-up is pending; it reschedules
        self._wake_at = t
        self._wake_fire = now + (t - now)  # (where SimPy's timeout lands)
        self._wake_real = clock is None  # (a replay's: made at its end, `outputs_at`, if still pending)
        if clock is None:
            self.env.timeout(t - now).callbacks.append(lambda _e, at=t: self._wake(at))

    def _wake(self, at: float) -> None:
        if self.before_wake is not None:  # the engine's outputs received before now first (`outputs_at`)
            self.before_wake()
        if self._wake_at != at:
            return  # superseded by an earlier wake-up
        self._wake_at = None
        self._advance(self.env.now)
        self._schedule_wake()

    def finish(self, t_end: Optional[float] = None) -> None:
        """Complete every queued output (no more work arrives), up to `t_end` if given."""
        while True:
            t = self._next_finish(important_only=False)
            if t is None or (t_end is not None and t > t_end):
                break
            self._advance(t)
        if t_end is not None:
            self._advance(max([t_end] + [c.now for c in self.cpus]))

    def summary(self, duration_s: float) -> dict[str, Any]:
        """`cpu_utilization`: the busiest server's busy share of the run (what saturates first)."""
        busy = [c.busy_s for c in self.cpus]
        return {"type": "api_server", "endpoint": self.endpoint, "coefficients": self.spec.name,
                "api_server_count": len(self.cpus), "requests": self.num_requests,
                "output_messages": self.num_messages, "cpu_busy_s": sum(busy),
                "cpu_utilization": (max(busy) / duration_s) if duration_s > 0 else None}


@dataclass(slots=True, frozen=True)
class FrontendConfig:
    """What an experiment says about the front end (`frontend:` in the experiment YAML)."""
    type: str = "offline"
    endpoint: str = "completions"
    coefficients: Any = None  # preset name / YAML path / mapping; None: the hardware's default
    api_server_count: int = 1  # vLLM's --api-server-count: API-server processes, one CPU each
    ingress: str = "shared"  # "shared" (processor sharing) | "in_order" (one at a time per server, FIFO)

    def spec(self, device_type: str = "cuda") -> FrontendSpec:
        return load_frontend_spec(self.coefficients if self.coefficients is not None
                                  else default_frontend_preset(device_type))

    def resolved(self, device_type: str) -> "FrontendConfig":
        """The same front end with its coefficient set loaded (the hardware's default when not given)."""
        if self.type != "api_server":
            return self
        return FrontendConfig(self.type, self.endpoint, self.spec(device_type), self.api_server_count, self.ingress)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "api_server":
            spec = self.coefficients
            out.update(endpoint=self.endpoint,
                       coefficients=spec.name if isinstance(spec, FrontendSpec) else spec,
                       api_server_count=self.api_server_count)
            if self.ingress != "shared":
                out["ingress"] = self.ingress
        return out


def parse_frontend(cfg: Any, path: str = "frontend") -> FrontendConfig:
    """`{type: api_server, endpoint: chat|completions, coefficients: ..., api_server_count: N,
    ingress: shared|in_order}` or
    `{type: offline}`."""
    cfg = check_mapping(cfg, path)
    kind = one_of(cfg.get("type"), FRONTEND_TYPES, f"{path}.type")
    if kind == "offline":
        check_keys(cfg, {"type"}, path)
        return FrontendConfig("offline")
    check_keys(cfg, {"type", "endpoint", "coefficients", "api_server_count", "ingress"}, path)
    endpoint = one_of(cfg.get("endpoint", "completions"), ENDPOINTS, f"{path}.endpoint")
    coeffs = cfg.get("coefficients")
    if coeffs is not None:
        load_frontend_spec(coeffs, f"{path}.coefficients")  # validate now
    count = cfg.get("api_server_count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1024:
        raise ConfigError(f"{path}.api_server_count", f"must be an integer from 1 to 1024, got {count!r}")
    ingress = one_of(cfg.get("ingress", "shared"), INGRESS_MODES, f"{path}.ingress")
    return FrontendConfig("api_server", endpoint, copy.deepcopy(coeffs), count, ingress)


def default_frontend(online: bool) -> FrontendConfig:
    """No `frontend:` given: online arrivals (poisson, gamma, closed loop, trace) are served by an
    API server (completions endpoint, what `vllm bench serve` uses by default); an offline batch
    by the offline `LLM` (no HTTP)."""
    return FrontendConfig("api_server", "completions") if online else FrontendConfig("offline")
