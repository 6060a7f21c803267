"""Many engines in one SimPy environment: instances behind a router, data-parallel ranks behind vLLM's
internal load balancer.

Layout: a cluster has instances (endpoints a router picks among); an instance has `data_parallel_size`
ranks, each one `servetwin.sim.engine.Simulation` over its own `EngineCore`, all sharing the cluster's
environment. The arrival process hands each request to the router (`servetwin.sim.routers`), which picks an
instance; the instance's DP front end picks a rank with vLLM's rule (`servetwin.core.engine.dp_lb`).

Dense DP (vLLM's rule for non-MoE models, `v1/engine/core.py:1546-1555`): the ranks are independent
engines. Each rank sends `(waiting, running, kv_usage)` to the instance's coordinator at step boundaries when
`(running, waiting)` changed; the coordinator publishes to the balancer 100 ms after the previous publish if
anything changed, else every 5 s (`DPStatsCoordinator`), so the balancer works on stale counts overlaid by
its exact in-flight counts and its own +client_count bumps. One API-server client per instance
(`client_count = 1`). The ZMQ latency between engines, coordinator and front end is taken as 0.

The router sees each instance's waiting / running / KV usage as scraped every `scrape_interval_s` (50 ms by
default: the llm-d EPP's metrics refresh) and its own exact in-flight counts, which drop when a request
completes. Every routing decision is recorded (`decisions`: request, time, candidates, scores, pick).

MoE DP (an instance whose model has routed experts, `InstanceEngines.lockstep`) runs its ranks in lockstep
(`servetwin.sim.lockstep`: global step barrier, padding, dummy batches, the 16-step all-reduce, wave starts).
Prefill/decode roles (`role: prefill` / `decode`): every request takes llm-d's P/D path through a prefill and
a decode instance, the KV read over the link in between (`servetwin.sim.pd_cluster`).

Event order at one simulated time is each engine's own (`servetwin.sim.engine`); between engines, the order
of SimPy's event queue (creation order), so a run is deterministic for a seed.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import simpy

from servetwin.core.engine.dp_lb import DPLoadBalancer, DPStatsCoordinator, RequestCountsPublisher
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.kv_cache.hashing import make_block_hash_with_group_id
from servetwin.core.prompt_memo import PromptMemo
from servetwin.sim.arrivals import ArrivalProcess
from servetwin.sim.cluster_offload import enable_cpu_tier_events, take_cpu_tier_events
from servetwin.sim.cluster_parallel import ArrivalEnv, RemoteDone, end_together, run_partitioned, workers_for
from servetwin.sim.engine import Settler, Simulation, SimResult, rare_young_collections
from servetwin.sim.lockstep import LockstepGroup
from servetwin.sim.pd_cluster import client_id, is_prefill_id
from servetwin.sim.routers import DEFAULT_SCRAPE_INTERVAL_S, Endpoint, RouteDecision, reads_scraped_metrics
from servetwin.sim.workload import WorkloadRequest


@dataclass(slots=True)
class InstanceEngines:
    """One instance's engines (its DP ranks, in rank order)."""
    name: str
    engines: list[EngineCore]
    role: str = "both"
    infos: list[Any] = field(default_factory=list)  # each engine's ExecutorInfo (KV pool sizing), for outputs
    lockstep: bool = False  # MoE DP: the ranks step together (servetwin.sim.lockstep)
    # the DP deployment the ranks belong to: instances with the same key and `lockstep` form one lockstep group
    # (external / hybrid DP load balancing split one deployment into several endpoints); None: this instance
    dp_group: Optional[str] = None
    tensor_parallel_size: int = 1  # (P/D: a KV read crosses min(TP prefill, TP decode) NICs at once)


@dataclass(slots=True)
class Decision:
    """One row of the router decision table."""
    request_id: str
    t: float
    pick: str
    rank: int  # the DP rank the instance's balancer chose
    candidates: list[str]
    scores: Optional[list[float]]


@dataclass(slots=True)
class ClusterResult:
    end_time_s: float
    instances: dict[str, list[SimResult]]  # instance -> one result per DP rank
    decisions: list[Decision] = field(default_factory=list)
    completion_s: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    aborted_s: dict[str, float] = field(default_factory=dict)  # client timeouts
    publishes: dict[str, list[float]] = field(default_factory=dict)  # DP instance -> its coordinator's publish times

    @property
    def num_steps(self) -> int:
        return sum(r.num_steps for results in self.instances.values() for r in results)


@dataclass(slots=True)
class EngineRun:
    """One engine's results after a cluster's run: what the outputs read (another worker's, shipped as this)."""
    result: SimResult
    frontend_summary: Optional[dict[str, Any]]  # the API server's (None: offline)
    window_stats: tuple[int, int]  # (step windows, steps inside them)

    def __reduce__(self) -> tuple:
        # (to another worker: the result as its fields - with the compiled build SimResult is a native class)
        r = self.result
        fields = (r.recorder, r.end_time_s, r.num_steps, r.completion_s, r.rejected, r.aborted_s, r.unfinished)
        return _engine_run, (fields, self.frontend_summary, self.window_stats)

    @classmethod
    def of(cls, sim: Simulation, result: SimResult) -> "EngineRun":
        fe = sim.frontend.summary(result.end_time_s) if sim.frontend is not None else None
        return cls(result, fe, sim.window_stats)


def _engine_run(fields: tuple, frontend_summary: Optional[dict[str, Any]], window_stats: tuple[int, int]) -> EngineRun:
    return EngineRun(SimResult(*fields), frontend_summary, window_stats)


class _Instance:
    """An instance: its ranks' simulations, the DP front end (balancer + coordinator) when it has several."""

    def __init__(self, index: int, spec: InstanceEngines, env: simpy.Environment, make_sim: Callable) -> None:
        self.index = index
        self.name = spec.name
        self.role = spec.role
        self.env = env
        self.ranks: list[Simulation] = [make_sim(engine, self, rank) for rank, engine in enumerate(spec.engines)]
        n = len(self.ranks)
        self.lb = DPLoadBalancer(n) if n > 1 else None
        self.coordinator = DPStatsCoordinator(n) if n > 1 else None
        self._publishers = [RequestCountsPublisher() for _ in range(n)]
        self._stats_arrived: Optional[simpy.Event] = None
        self.lockstep = spec.lockstep
        self.dp_group = spec.dp_group or spec.name
        self.publish_times: list[float] = []
        self.group: Optional[LockstepGroup] = None
        self._kv_events: Optional[Callable[[int, list], None]] = None
        self._cpu_kv_events: Optional[Callable[[int, list], None]] = None  # the CPU tier's (sim/cluster_offload.py)
        if self.lb is not None:
            for rank, sim in enumerate(self.ranks):
                sim.on_step_boundary = self._boundary_hook(rank)

    def publish_kv_events(self, sink: Callable[[int, list], None],
                          cpu_sink: Optional[Callable[[int, list], None]] = None) -> None:
        """Turn the ranks' KV cache events on; after each step they go to `sink(instance index, events)`
        (vLLM publishes them per step over ZMQ, `--kv-events-config`), a CPU tier's to `cpu_sink`."""
        self._kv_events = sink
        for rank, sim in enumerate(self.ranks):
            sim.engine.scheduler.kv_cache_manager.block_pool.enable_kv_cache_events()
            if cpu_sink is not None and enable_cpu_tier_events(sim.engine.scheduler):
                self._cpu_kv_events = cpu_sink
            sim.on_step_boundary = self._boundary_hook(rank)

    def _boundary_hook(self, rank: int) -> Callable[[Simulation], None]:
        publisher = self._publishers[rank]
        coordinator, kv_sink, cpu_sink = self.coordinator, self._kv_events, self._cpu_kv_events

        def on_boundary(sim: Simulation) -> None:
            sched = sim.engine.scheduler
            if kv_sink is not None:
                events = sched.kv_cache_manager.block_pool.take_events()
                if events:
                    kv_sink(self.index, events)
            if cpu_sink is not None:
                events = take_cpu_tier_events(sched)
                if events:
                    cpu_sink(self.index, events)
            if coordinator is None:
                return
            running, waiting = sched.get_request_counts()
            stats = publisher.maybe_publish(running, waiting, sched.kv_cache_manager.usage)
            if stats is not None:
                coordinator.on_engine_stats(rank, *stats)
                if self._stats_arrived is not None and not self._stats_arrived.triggered:
                    self._stats_arrived.succeed()
        return on_boundary

    def coordinator_process(self, done: Callable[[], bool]):
        """Publishes the ranks' counts to the balancer on the coordinator's schedule."""
        env, coord = self.env, self.coordinator
        while not done():
            due = coord.next_publish_s(env.now)
            if due > env.now:
                self._stats_arrived = env.event()
                yield env.any_of([env.timeout(due - env.now), self._stats_arrived])
                self._stats_arrived = None
                if coord.next_publish_s(env.now) > env.now:
                    continue  # stats arrived: the deadline moved (100 ms after the last publish)
            self.lb.on_publish(coord.publish(env.now))
            self.publish_times.append(float(env.now))
            yield env.timeout(0)  # (a publish per instant at most)

    def counts(self) -> tuple[int, int, float]:
        """(waiting, running, kv usage) now, summed over ranks (usage: their mean), as /metrics reports."""
        waiting = running = 0
        usage = 0.0
        for sim in self.ranks:
            sim.catch_up()  # (a step window's KV events before now)
            sched = sim.engine.scheduler
            r, w = sched.get_request_counts()
            waiting += w
            running += r
            usage += sched.kv_cache_manager.usage
        return waiting, running, usage / len(self.ranks)

    def key_scheme(self) -> tuple[int, str]:
        """What decides the engines' block keys of a prompt: block size and hash algorithm."""
        config = self.ranks[0].engine.scheduler.cache_config
        return config.block_size, config.prefix_caching_hash_algo

    def num_gpu_blocks(self) -> int:
        """The KV pool's blocks, summed over the ranks (vLLM's `cache_config_info` num_gpu_blocks per engine)."""
        return sum(sim.engine.scheduler.cache_config.num_gpu_blocks or 0 for sim in self.ranks)

    def block_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The keys (block hash + group 0) the engines give a prompt's full blocks: what their KV events name."""
        hasher = getattr(self.ranks[0].engine.scheduler, "block_hasher", None)
        if hasher is None:  # prefix caching off: no events either
            return []
        probe = SimpleNamespace(block_hashes=[], all_token_ids=tokens, lora_request=None, cache_salt=None)
        return [make_block_hash_with_group_id(h, 0) for h in hasher(probe)]


    def accept(self, request: WorkloadRequest) -> tuple[int, simpy.Event]:
        rank = self.lb.choose(request.request_id) if self.lb is not None else 0
        return rank, self.ranks[rank].accept(request)

    def on_finished(self, request_id: str) -> None:
        if self.lb is not None:
            self.lb.on_finished(request_id)


class ClusterSimulation:
    """Instances behind a router in one simulated time (see the module docstring)."""

    def __init__(self, instances: Sequence[InstanceEngines], router: Any, requests: Sequence[WorkloadRequest],
                 arrival: ArrivalProcess, *, rng: Optional[np.random.Generator] = None, run: str = "sim",
                 scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S, max_time_s: Optional[float] = None,
                 record_step_requests: bool = True, frontend: Any = None,
                 on_complete: Optional[Callable[[str, float], None]] = None,
                 on_reject: Optional[Callable[[str, str], None]] = None,
                 pd_flow: Optional[Callable[["ClusterSimulation"], Any]] = None, sim_workers: int | str = 1,
                 **sim_kwargs: Any) -> None:
        if not instances:
            raise ValueError("cluster.instances: at least one instance")
        self.env = simpy.Environment()
        self.router = router
        self.requests = list(requests)
        self.arrival = arrival
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.scrape_interval_s = scrape_interval_s
        self.max_time_s = max_time_s
        self.on_complete = on_complete
        self.on_reject = on_reject
        self.result = ClusterResult(0.0, {})
        # (speed: the engines split over this many forked worker processes, `sim/cluster_parallel.py`; "auto": two
        # where two CPUs are free; 1 where the cluster cannot be split; the results are the one-process run's)
        self.sim_workers = sim_workers
        self._link: Any = None  # this worker's WorkerLink in a partitioned run (None: every engine is here)
        self._shipped: dict[tuple[str, int], EngineRun] = {}  # the other workers' engines, after a partitioned run
        self.workers_used = 1  # the worker processes the run took (`run`: `sim_workers` where the cluster can be split)
        self.num_meetings = 0  # (a partitioned run: how often the workers met, routing decisions and stage ends)
        self._where: dict[str, tuple[_Instance, int]] = {}  # request -> its instance and prompt tokens, in flight
        self._arrivals_done = False
        settler = self.settler = Settler(self.env)
        if max_time_s is not None:  # (a run cut at a time: the engines step one by one, `Simulation._plan_window`)
            sim_kwargs = {**sim_kwargs, "step_windows": False}

        # the router releases a load charge at each request's first token and end (llm-d's in-flight load)
        wants_first_token = self._router_wants_first_token = bool(getattr(router, "wants_first_token", False))

        # (speed: the engines share the memos of what is a pure function of a prompt list - its full blocks'
        # hashes, its token salt's CRC - so a prompt sent to several engines is hashed once; core/prompt_memo.py)
        block_hash_memo, crc_memo = PromptMemo(), PromptMemo()

        def make_sim(engine: EngineCore, inst: _Instance, rank: int) -> Simulation:
            share = getattr(engine.scheduler, "share_prompt_memo", None)
            if share is not None:
                share(block_hash_memo)
            share = getattr(engine.executor, "share_prompt_memo", None)
            if share is not None:
                share(crc_memo)
            sim = Simulation(engine, [], arrival, rng=self.rng, run=run, record_step_requests=record_step_requests,
                             frontend=frontend, env=self.env, settler=settler, on_complete=self._completed,
                             on_reject=self._rejected, **sim_kwargs)
            sim.hooks.on_abort = self._aborted
            if wants_first_token:
                sim.hooks.on_first_token = self._first_token
            return sim

        self.instances = [_Instance(i, spec, self.env, make_sim) for i, spec in enumerate(instances)]
        self.endpoints = [Endpoint(i, inst.name, inst.role, block_keys=inst.block_keys, key_scheme=inst.key_scheme(),
                                   block_size=inst.key_scheme()[0], num_gpu_blocks=inst.num_gpu_blocks())
                          for i, inst in enumerate(self.instances)]
        self._by_name = {inst.name: inst for inst in self.instances}
        # prefill/decode roles: `pd_flow(self)` builds the P/D path (sim/pd_cluster.py), None: every instance serves
        self.pd = pd_flow(self) if pd_flow is not None else None
        on_kv_events = getattr(router, "on_kv_events", None)
        if on_kv_events is not None and getattr(router, "wants_kv_events", False):
            delay = float(getattr(router, "kv_event_delay_s", 0.0))
            env = self.env

            def delayed(handler: Callable[[int, list], None]) -> Callable[[int, list], None]:
                def sink(index: int, events: list) -> None:
                    if delay <= 0:
                        handler(index, events)
                    else:  # the events' way to the router (ZMQ publisher -> indexer)
                        env.timeout(delay).callbacks.append(lambda _e: handler(index, events))
                return sink
            on_cpu = getattr(router, "on_cpu_kv_events", None) if getattr(router, "wants_cpu_kv_events", False) else None
            for inst in self.instances:
                inst.publish_kv_events(delayed(on_kv_events), delayed(on_cpu) if on_cpu is not None else None)

    # -- routing ---------------------------------------------------------------------------------
    def _route(self, request: WorkloadRequest) -> simpy.Event:
        if self.pd is not None:  # prefill/decode instances: llm-d's P/D path (sim/pd_cluster.py)
            return self.pd.route(request)
        forced = None
        if self._link is not None:  # (a partitioned run: the other workers' router events first, unless the pick
            # cannot depend on them; then its recorded scores are the owner's, `adopt`)
            forced_pick = getattr(self.router, "forced_pick", None)
            forced = forced_pick(request, self.endpoints) if forced_pick is not None else None
            if forced is None:
                self._meet()
        route_forced = getattr(self.router, "route_forced", None) if forced is not None else None
        if route_forced is not None and not self._link.owns(forced):  # (speed: no scores the owner computes)
            decision: RouteDecision = route_forced(request, self.endpoints, forced)
        else:
            decision = self.router.route(request, self.endpoints)
        if forced is not None and decision.pick != forced:
            raise AssertionError(f"partitioned run: the router picked {decision.pick} for {request.request_id}, "
                                 f"its forced_pick said {forced}")
        on_routed = getattr(self.router, "on_routed", None)
        if on_routed is not None:
            on_routed(request, self.endpoints[decision.pick])
        cands = decision.candidates if decision.candidates is not None else range(len(self.endpoints))
        rank, done = self.dispatch(decision.pick, request)
        self.record_decision(request.request_id, decision.pick, rank, [self.endpoints[i].name for i in cands],
                             decision.scores)
        return done

    def dispatch(self, index: int, request: WorkloadRequest) -> tuple[int, simpy.Event]:
        """Hand `request` to instance `index` (the router's in-flight counts follow it): (the DP rank its
        balancer chose, an event that fires when it is done)."""
        inst = self.instances[index]
        endpoint = self.endpoints[index]
        endpoint.active += 1
        endpoint.active_tokens += len(request.prompt_token_ids)
        self._where[request.request_id] = (inst, len(request.prompt_token_ids))
        if self._link is not None and not self._link.owns(index):  # another worker simulates it: booked here
            return 0, RemoteDone(self.env)
        return inst.accept(request)

    def record_decision(self, request_id: str, index: int, rank: int, candidates: list[str],
                        scores: Optional[list[float]]) -> None:
        inst = self.instances[index]
        self.result.decisions.append(Decision(request_id, float(self.env.now), inst.name, rank, candidates, scores))

    def instance(self, name: str) -> _Instance:
        return self._by_name[name]

    def _release(self, request_id: str) -> Optional[_Instance]:
        inst, tokens = self._where.pop(request_id, (None, 0))
        if inst is not None:
            endpoint = self.endpoints[inst.index]
            endpoint.active -= 1
            endpoint.active_tokens -= tokens
            inst.on_finished(request_id)
            if self._router_wants_first_token:
                self.router.on_finished(request_id)
        return inst

    def _first_token(self, request_id: str, t: float) -> None:
        """A request's first output token was processed by its engine: the router's load producer releases its
        prompt charge (llm-d's inflight-load-producer does at the first streamed token; the API server's output
        path, a few ms, is not added)."""
        self.router.on_first_token(request_id)
        if self._link is not None:
            self._link.outbox.append(("f", request_id, t))

    def _completed(self, request_id: str, t: float) -> None:
        if self._link is not None:
            self._link.outbox.append(("c", request_id, t))
        self._release(request_id)
        if self.pd is not None and is_prefill_id(request_id):
            return  # a P/D prefill copy: the client's request goes on at a decode instance
        self.result.completion_s[request_id] = t
        if self.on_complete is not None:
            self.on_complete(request_id, t)

    def _aborted(self, request_id: str, t: float) -> None:
        if self._link is not None:
            self._link.outbox.append(("a", request_id, t))
        self._release(request_id)  # vLLM reports an aborted request finished: its in-flight slot is free
        self.result.aborted_s[client_id(request_id) if self.pd is not None else request_id] = t

    def _rejected(self, request_id: str, reason: str) -> None:
        if self._link is not None:
            self._link.outbox.append(("x", request_id, reason))
        self._release(request_id)
        if self.pd is not None:  # a P/D prefill copy's rejection is the client's request's
            request_id = client_id(request_id)
        self.result.rejected[request_id] = reason
        if self.on_reject is not None:
            self.on_reject(request_id, reason)

    # -- processes -------------------------------------------------------------------------------
    def _arrivals(self):
        env = self.env if self._link is None else ArrivalEnv(self.env, self._stage_end)
        yield from self.arrival.process(env, self.requests, self._route, self.rng)
        self._arrivals_done = True
        if self.pd is not None:  # decode instances still get the requests whose prefill is running
            self.pd.on_arrivals_done()
            return
        for inst in self.instances:
            for sim in inst.ranks:
                sim.close_arrivals()

    def _done(self) -> bool:
        return self._arrivals_done and not self._where and (self.pd is None or self.pd.idle())

    def _scraper(self):
        """The router's metrics refresh: every endpoint's counts as they are at each tick."""
        env = self.env
        pairs = [(e, inst) for e, inst in zip(self.endpoints, self.instances)
                 if self._link is None or self._link.owns(inst.index)]  # (a worker scrapes its own instances)
        while not self._done():
            for endpoint, inst in pairs:
                endpoint.waiting, endpoint.running, endpoint.kv_usage = inst.counts()
            yield env.timeout(self.scrape_interval_s)

    def scrapes_needed(self) -> bool:
        """Whether the router's metrics refresh can change the run: with several instances, when a router (or the
        P/D path's prefill router) reads scraped metrics (`reads_scraped_metrics`), or when an engine has a KV
        connector's worker (a step waiting for KV transfers ends at the next other event, `Simulation._engine`:
        a scrape is one). Otherwise the scrapes would only write endpoint fields nobody reads (tests/sim/
        test_sim_cluster_speed.py runs both ways)."""
        if len(self.instances) < 2:  # (one instance: nothing to choose)
            return False
        if any(getattr(sim.engine.executor, "kv_worker", None) is not None
               for inst in self.instances for sim in inst.ranks):
            return True
        prefill_router = getattr(self.pd, "prefill_router", None)
        return reads_scraped_metrics(self.router) or (prefill_router is not None
                                                      and reads_scraped_metrics(prefill_router))

    # -- a partitioned run (sim/cluster_parallel.py) ------------------------------------------------
    def _meet(self) -> None:
        """Before a routing decision: the other workers' router events since the last meeting applied, and their
        instances' last scraped metrics."""
        link = self._link
        scraped = [(e.index, e.waiting, e.running, e.kv_usage) for e in self.endpoints if link.owns(e.index)]
        events, link.outbox = link.outbox, []
        for their_events, their_scraped in link.exchange("route", (events, scraped)):
            self._apply_remote(their_events)
            for i, waiting, running, usage in their_scraped:
                endpoint = self.endpoints[i]
                endpoint.waiting, endpoint.running, endpoint.kv_usage = waiting, running, usage
        self._met()

    def _met(self) -> None:
        self.num_meetings += 1
        at_meeting = getattr(self.router, "at_meeting", None)
        if at_meeting is not None:
            at_meeting()

    def _apply_remote(self, events: list[tuple[str, str, Any]]) -> None:
        """Another worker's router events ((code, request id, t or reason), in their order): "f" a first token,
        "c" an end, "x" a rejection, "a" a client's abort. (Their requests' results come with `adopt`.)"""
        for code, request_id, extra in events:
            if code == "f":
                self.router.on_first_token(request_id)
                continue
            self._release(request_id)
            if code == "c" and self.on_complete is not None:  # (worker 0's progress)
                self.on_complete(request_id, extra)
            elif code == "x" and self.on_reject is not None:
                self.on_reject(request_id, extra)

    def _stage_end(self, out: simpy.Event) -> None:
        """This worker's requests of a stage are done (now): `out` fires when every worker's are."""
        events, self._link.outbox = self._link.outbox, []
        theirs = self._link.exchange("stage", (events, self.env.now))
        for their_events, _ in theirs:
            self._apply_remote(their_events)
        self._met()
        end_together(self.env, out, self.env.now, [t for _, t in theirs])

    def shipment(self, interrupted: bool = False) -> Iterator[Any]:
        """This worker's results for worker 0 (`adopt`), in parts: its requests' ends and its router news, then
        ((instance, rank), EngineRun) per engine - each sent as it is made, so that worker 0 unpickles one while
        the next is packed. `interrupted`: the engines as they are (no `finish`)."""
        r = self.result
        yield {"completion_s": r.completion_s, "rejected": r.rejected, "aborted_s": r.aborted_s,
               "router_events": self._link.outbox,  # (since the last meeting: worker 0's router ends complete)
               "decisions": [(i, d) for i, d in enumerate(r.decisions) if self._link.owns(self._by_name[d.pick].index)]}
        for inst in self.instances:
            if self._link.owns(inst.index):
                results = [sim.result for sim in inst.ranks] if interrupted else self.result.instances[inst.name]
                for rank, sim, e in zip(range(len(inst.ranks)), inst.ranks, results):
                    # (speed: the recorder packed - its token times one array - pickles ~4x faster)
                    packed = SimResult(e.recorder.packed(), e.end_time_s, e.num_steps, e.completion_s, e.rejected,
                                       e.aborted_s, e.unfinished)
                    yield (inst.name, rank), EngineRun.of(sim, packed)

    def adopt(self, shipped: dict[int, dict[str, Any]], interrupted: bool = False) -> ClusterResult:
        """Worker 0 after a partitioned run: the other workers' engines and requests into its result
        (`interrupted`: theirs as they were, this one's result not finished either)."""
        r = self.result
        for part in shipped.values():
            self._shipped.update(part["engines"])  # (`WorkerLink.result_of` gathered the parts)
            r.completion_s.update(part["completion_s"])
            r.rejected.update(part["rejected"])
            r.aborted_s.update(part["aborted_s"])
            self._apply_remote(part["router_events"])
            for i, d in part["decisions"]:  # (the owner's scores: a pick made without meeting read stale ones here)
                if i >= len(r.decisions) or (r.decisions[i].request_id, r.decisions[i].pick) != (d.request_id, d.pick):
                    if interrupted:  # (the workers stopped at different places)
                        break
                    raise AssertionError(f"partitioned run: decision {i} differs between workers")
                r.decisions[i] = d
        self._link = None
        if interrupted:
            return r
        for (name, rank), run in self._shipped.items():
            r.instances[name][rank] = run.result
        r.completion_s = dict(sorted(r.completion_s.items(), key=lambda kv: kv[1]))  # (by time, as they came)
        r.end_time_s = max([r.end_time_s, *(run.result.end_time_s for run in self._shipped.values())])
        return r

    def engine_runs(self) -> list[tuple[str, int, "EngineRun"]]:
        """(instance, rank, its EngineRun) of every engine after the run, in instance and rank order (another
        worker's as it shipped them)."""
        out = []
        for inst in self.instances:
            for rank, sim in enumerate(inst.ranks):
                shipped = self._shipped.get((inst.name, rank))
                out.append((inst.name, rank, shipped if shipped is not None else EngineRun.of(sim, sim.result)))
        return out

    def run(self) -> ClusterResult:
        workers = workers_for(self, self.sim_workers)
        self.workers_used = workers
        if workers > 1:
            return run_partitioned(self, workers)
        return self.run_here(None)

    def run_here(self, link: Any) -> ClusterResult:
        """The run of this process's engines: all of them (`link` None), or a partitioned run's worker's."""
        self._link = link
        env = self.env
        env.process(self._arrivals())
        engines = self._start_engines()
        if self.scrapes_needed():
            env.process(self._scraper())
        for inst in self.instances:
            if inst.coordinator is not None:
                env.process(inst.coordinator_process(self._done))
        until: Any = env.all_of(engines)
        if self.max_time_s is not None:
            until = env.any_of([until, env.timeout(self.max_time_s)])
        with rare_young_collections():
            env.run(until=until)
        if link is not None:  # (the one-process run stops when the last engine anywhere is done: every engine's
            # result ends then; this worker's clock runs on to that time)
            t_end = max([env.now, *link.exchange("end", env.now)])
            if t_end > env.now:
                env.run(until=t_end)
        end = 0.0
        for inst in self.instances:
            if link is not None and not link.owns(inst.index):
                self.result.instances[inst.name] = [None] * len(inst.ranks)  # (`adopt` fills them in worker 0)
                continue
            results = [sim.finish() for sim in inst.ranks]
            self.result.instances[inst.name] = results
            if inst.coordinator is not None:
                self.result.publishes[inst.name] = inst.publish_times
            end = max([end, *(r.end_time_s for r in results)])
        self.result.end_time_s = end
        return self.result

    def _start_engines(self) -> list[simpy.Process]:
        """One process per independent engine, one per lockstep group (its ranks may span several endpoints)."""
        procs, groups = [], {}
        for inst in self.instances:
            if self._link is not None and not self._link.owns(inst.index):
                continue  # (another worker's)
            if inst.lockstep:
                groups.setdefault(inst.dp_group, []).append(inst)
            else:
                procs += [sim.start_engine() for sim in inst.ranks]
        for members in groups.values():
            ranks = [sim for inst in members for sim in inst.ranks]
            if len(ranks) == 1:  # DP 1: nothing to step with
                procs.append(ranks[0].start_engine())
                continue
            group = LockstepGroup(self.env, ranks, self.settler.wait)
            for inst in members:
                inst.group = group
            procs.append(self.env.process(group.process()))
        return procs

    def simulations(self) -> list[tuple[str, int, Simulation]]:
        """(instance, rank, simulation) of every engine, in instance and rank order."""
        return [(inst.name, rank, sim) for inst in self.instances for rank, sim in enumerate(inst.ranks)]


__all__ = ["ClusterSimulation", "ClusterResult", "InstanceEngines", "Decision"]
