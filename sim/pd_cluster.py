"""Prefill/decode disaggregation across a cluster's instances: llm-d's P/D flow over vLLM's NIXL connector.

A request's path (llm-d-inference-scheduler's P/D profiles and its routing sidecar, as
docs/cluster.md describes them):

1. The router's decode profile picks a decode instance (`ClusterSimulation.router` over the decode
   endpoints). The prefix-based P/D decider (`PrefixBasedPDDecider`, `nonCachedTokens` 16) sends the
   request to a prefill instance only when its prompt tokens not cached on that decode instance exceed
   the threshold; the cached tokens are what the decode profile's approximate prefix index holds (0 when
   it has no prefix scorer). Otherwise the decode instance serves the request alone.
2. The prefill profile (`cluster.prefill_router`) picks a prefill instance, which runs a copy of the
   request with `max_tokens=1` and `kv_transfer_params={"do_remote_decode": True}` (id `<id>.prefill`).
   Its scheduler (core/kv_connector/nixl.py, producer) keeps the prompt's blocks after it finishes
   (delayed free) and returns the kv_transfer_params a decode engine reads them with.
3. When the prefill copy's response reaches the sidecar (through the prefill instance's front end), the
   request goes to the decode instance with those kv_transfer_params (`do_remote_prefill`). Its scheduler
   allocates the prompt's blocks and parks it in WAITING_FOR_REMOTE_KVS; its worker reads the KV over the
   link (`cluster.links.kv_transfer`): bytes = the prompt's blocks x the model's KV bytes per token, over
   min(TP prefill, TP decode) NICs in parallel (each GPU reads or serves through its own NIC; a side with
   fewer ranks serves several shards through each). Only after the read is reported finished does the
   scheduler run the request (it recomputes the last prompt token and samples the first output token).
4. The read's end releases the producer's blocks (its worker reports `finished_sending` at its next step),
   or the lease (`kv_lease_duration`, 30 s) does.

TTFT and E2E are the client's, as inference-perf measures them through llm-d: from the request's arrival to
the decode instance's first (last) token reaching the client, so TTFT = prefill (queue, prefill, front end)
+ the decode instance's admission + the transfer + its first step. The prefill copies are recorded on the
prefill instances (ids ending `.prefill`) and left out of the client's figures.

The hop from the decode instance's sidecar to the prefill instance and back is priced by each instance's
front end (the API server model); the sidecar itself and the EPP's own time are taken as 0. A read that
fails (`failed_recving`) is not modelled.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import simpy

from servetwin.sim.routers import Endpoint, PrefixBasedPDDecider, PrefixCacheScorer, RouteDecision
from servetwin.sim.workload import WorkloadRequest

PREFILL_SUFFIX = ".prefill"
DEFAULT_KV_LEASE_S = 30.0  # NIXL kv_lease_duration (vLLM nixl/base_scheduler.py:82-86)


@dataclass(slots=True)
class Transfer:
    """One KV read, decode instance <- prefill instance (a row of the transfer timeline)."""
    request_id: str
    prefill: str
    decode: str
    start_s: float
    end_s: float
    released_s: Optional[float] = None  # when the producer was told (its blocks free at its next step)


@dataclass(slots=True)
class PDPhases:
    """Per request: its phases' instances and the times the invariants are checked on."""
    decode: Optional[str] = None
    prefill: Optional[str] = None
    prefill_done_s: Optional[float] = None
    decode_submit_s: Optional[float] = None


@dataclass(slots=True)
class PDRecord:
    phases: dict[str, PDPhases] = field(default_factory=dict)
    transfers: dict[str, Transfer] = field(default_factory=dict)
    expired_leases: list[str] = field(default_factory=list)


def prefill_id(request_id: str) -> str:
    return request_id + PREFILL_SUFFIX


def is_prefill_id(request_id: str) -> bool:
    return request_id.endswith(PREFILL_SUFFIX)


def client_id(request_id: str) -> str:
    """The client's request id of a prefill copy's id (any other id as it is)."""
    return request_id[:-len(PREFILL_SUFFIX)] if is_prefill_id(request_id) else request_id


def cached_prompt_tokens(router: Any, request: WorkloadRequest, endpoint: Endpoint) -> int:
    """Prompt tokens the router's approximate prefix index holds for `endpoint` (0 without one): what
    llm-d's P/D decider reads from the prefix plugin's state."""
    scorers = [s for s, _ in getattr(router, "scorers", ())] + [getattr(f, "scorer", None)
                                                               for f in getattr(router, "filters", ())]
    scorer = next((s for s in scorers if isinstance(s, PrefixCacheScorer)), None)
    if scorer is None:
        return 0
    n = len(request.prompt_token_ids)  # (llm-d's tail block is counted whole: an unmatched prompt gives < 0)
    return max(0, n - scorer.uncached_tokens(request, endpoint.index))


def read_scale(prefill_tp: int, decode_tp: int) -> float:
    """How many of its own shards a decode rank's read moves through one NIC's time: the KV crosses
    min(TP prefill, TP decode) NICs in parallel, a decode rank's worker prices 1/TP decode of it."""
    return decode_tp / min(prefill_tp, decode_tp)


class PDFlow:
    """The P/D path of every request of a `ClusterSimulation` with prefill and decode instances."""

    def __init__(self, cluster: Any, prefill_router: Any, threshold_tokens: int,
                 tensor_parallel: Sequence[int], lease_s: float = DEFAULT_KV_LEASE_S) -> None:
        self.cluster = cluster
        self.env: simpy.Environment = cluster.env
        self.prefill_router = prefill_router
        self.decider = PrefixBasedPDDecider(threshold_tokens)
        self.tp = list(tensor_parallel)  # per instance
        self.record = PDRecord()
        insts = cluster.instances
        self.prefill = [i for i, inst in enumerate(insts) if inst.role == "prefill"]
        self.decode = [i for i, inst in enumerate(insts) if inst.role == "decode"]
        self._unplaced = 0  # requests routed, not yet handed to their decode instance
        self._arrivals_done = False
        self._params: dict[str, dict] = {}  # prefill copy -> its producer's kv_transfer_params
        for i in self.prefill:
            (sim,) = insts[i].ranks
            connector = sim.engine.scheduler.connector  # its kv_lease_duration, as vLLM's worker enforces it
            sim.engine.executor.kv_worker.hold_sends(float(getattr(connector, "kv_lease_duration", lease_s)))
            sim.hooks.on_kv_transfer_params = self._params.__setitem__
        for i in self.decode:
            (sim,) = insts[i].ranks
            sim.engine.executor.kv_worker.on_recv_done = self._read_done_hook(i)

    # -- routing ---------------------------------------------------------------------------------
    def route(self, request: WorkloadRequest) -> simpy.Event:
        done = self.env.event()
        self._unplaced += 1  # (now: the arrivals may end before the process below starts)
        self.env.process(self._serve(request, done))
        return done

    def _pick(self, router: Any, request: WorkloadRequest, pool: list[int]) -> int:
        endpoints = [self.cluster.endpoints[i] for i in pool]
        decision: RouteDecision = router.route(request, endpoints)
        chosen = endpoints[decision.pick]
        cands = [endpoints[i].name for i in decision.candidates] if decision.candidates is not None else \
            [e.name for e in endpoints]
        self.cluster.record_decision(request.request_id, chosen.index, 0, cands, decision.scores)  # (DP 1)
        return chosen.index

    @staticmethod
    def _routed(router: Any, request: WorkloadRequest, endpoint: Endpoint) -> None:
        on_routed = getattr(router, "on_routed", None)
        if on_routed is not None:
            on_routed(request, endpoint)

    def _serve(self, request: WorkloadRequest, done: simpy.Event):
        cluster, rid = self.cluster, request.request_id
        d = self._pick(cluster.router, request, self.decode)
        phases = self.record.phases[rid] = PDPhases(decode=cluster.instances[d].name)
        # the decider reads the prefix index as it was before this request (llm-d updates it afterwards)
        cached = cached_prompt_tokens(cluster.router, request, cluster.endpoints[d])
        self._routed(cluster.router, request, cluster.endpoints[d])
        if self.decider.disaggregate(len(request.prompt_token_ids), cached):
            p = self._pick(self.prefill_router, request, self.prefill)
            self._routed(self.prefill_router, request, cluster.endpoints[p])
            phases.prefill = cluster.instances[p].name
            copy = dataclasses.replace(request, request_id=prefill_id(rid), max_tokens=1, n=1, eos_at=None,
                                       kv_transfer_params={"do_remote_decode": True}, keep_output_tokens=False,
                                       output_token_ids=None)
            yield cluster.dispatch(p, copy)[1]
            params = self._params.pop(copy.request_id, None)
            phases.prefill_done_s = float(self.env.now)
            if params is None:  # aborted or rejected on the prefill instance: the client got its answer
                self._unplaced -= 1
                self._maybe_close_decode()
                done.succeed()
                return
            request = dataclasses.replace(request, kv_transfer_params=params)
            (decode_sim,) = cluster.instances[d].ranks
            decode_sim.engine.executor.kv_worker.scale_read(rid, read_scale(self.tp[p], self.tp[d]))
        phases.decode_submit_s = float(self.env.now)
        _, finished = cluster.dispatch(d, request)
        self._unplaced -= 1
        self._maybe_close_decode()
        yield finished
        done.succeed()

    # -- the transfer's end frees the producer's blocks ------------------------------------------
    def _read_done_hook(self, decode_index: int) -> Callable[[str, float], None]:
        def on_read_done(request_id: str, offset_s: float) -> None:
            phases = self.record.phases.get(request_id)
            if phases is None or phases.prefill is None:
                return
            worker = self.cluster.instances[decode_index].ranks[0].engine.executor.kv_worker
            end = float(self.env.now) + offset_s
            start = end - worker.recv_s.pop(request_id, 0.0)
            transfer = Transfer(request_id, phases.prefill, phases.decode, start, end)
            self.record.transfers[request_id] = transfer
            self.env.timeout(max(0.0, offset_s)).callbacks.append(lambda _e: self._release(transfer))
        return on_read_done

    def _release(self, transfer: Transfer) -> None:
        inst = self.cluster.instance(transfer.prefill)
        (sim,) = inst.ranks
        if sim.engine.executor.kv_worker.release_send(prefill_id(transfer.request_id)):
            transfer.released_s = float(self.env.now)
            sim.wake()
        else:
            self.record.expired_leases.append(transfer.request_id)

    def summary(self) -> dict[str, Any]:
        """Whole-run P/D figures: requests per path, the reads' durations, expired leases."""
        reads = [t.end_s - t.start_s for t in self.record.transfers.values()]
        waits = [t.start_s - self.record.phases[t.request_id].prefill_done_s for t in self.record.transfers.values()]
        return {"disaggregated": sum(p.prefill is not None for p in self.record.phases.values()),
                "decode_only": sum(p.prefill is None for p in self.record.phases.values()),
                "kv_read_s_mean": sum(reads) / len(reads) if reads else None,
                "kv_read_s_max": max(reads, default=None),
                "prefill_done_to_read_s_mean": sum(waits) / len(waits) if waits else None,
                "expired_leases": len(self.record.expired_leases)}

    # -- end of the run --------------------------------------------------------------------------
    def idle(self) -> bool:
        """Every request routed so far is at its decode instance."""
        return self._unplaced == 0

    def on_arrivals_done(self) -> None:
        """No more client requests: the prefill instances take none; the decode instances once the last
        request has been handed over."""
        self._arrivals_done = True
        for i in self.prefill:
            for sim in self.cluster.instances[i].ranks:
                sim.close_arrivals()
        self._maybe_close_decode()

    def _maybe_close_decode(self) -> None:
        if self._arrivals_done and self._unplaced == 0:
            for i in self.decode:
                for sim in self.cluster.instances[i].ranks:
                    sim.close_arrivals()


def transfers_frame(record: PDRecord):
    """The transfer timeline: one row per KV read (request, prefill, decode, prefill_done_s, start_s, end_s,
    released_s)."""
    import pandas as pd  # noqa: PLC0415

    rows = [{"request_id": t.request_id, "prefill": t.prefill, "decode": t.decode,
             "prefill_done_s": record.phases[t.request_id].prefill_done_s, "start_s": t.start_s, "end_s": t.end_s,
             "released_s": t.released_s} for t in record.transfers.values()]
    return pd.DataFrame(rows, columns=["request_id", "prefill", "decode", "prefill_done_s", "start_s", "end_s",
                                       "released_s"])


__all__ = ["PDFlow", "transfers_frame", "PDRecord", "PDPhases", "Transfer", "prefill_id", "is_prefill_id", "client_id", "read_scale",
           "cached_prompt_tokens", "PREFILL_SUFFIX", "DEFAULT_KV_LEASE_S"]
