"""The simulator's worker side of a KV connector: transfers that finish at modelled simulated times.

The scheduler side (core/kv_connector/) is vLLM's; this module plays the worker that vLLM's model
runner drives (`start_load_kv` before the forward pass, `get_finished` after it) and reports what
finished in the step's `ModelRunnerOutput.kv_connector_output` (docs/kv_connectors.md).

- NIXL read (`reqs_to_recv`, consumer): starts when the step starts and takes
  `link.transfer_s(bytes)`, bytes = the read's blocks x block_size x the model's KV bytes per token
  (per TP rank: each rank reads its shard over its own link, at the same time); with several KV cache
  groups (hybrid attention) the blocks of every group, each a page of the group's layers.
- NIXL send (`reqs_to_send`, producer): the modelled decode engine pulls the finished request's
  prompt blocks over the same link from the step that lists it; `finished_sending` when it is done.
- Offloading jobs (`load_jobs`, `store_jobs`): `pcie.transfer_s(bytes)`, bytes = the job's blocks x
  block_size x KV bytes per token. A load starts with the step; a store when its KV exists (the end
  of the step); a job the scheduler flushes (`jobs_to_flush`) or a sync load finishes inside the step,
  which lasts until it is done. A finished async load also reports its request in `finished_recving`.
- A step that schedules no tokens while transfers are in flight waits for the next one to finish
  (its duration is that wait, capped by `horizon_s`, the time to the driver's next event), so a
  request waiting for KV is never stuck: the engine loop jumps to the completion, as vLLM's busy loop
  would reach it.

No contention: transfers in flight at once each get the link's full bandwidth (as sim/links.py).
A transfer is reported in the first step that ends at or after its completion.

In a cluster with prefill/decode instances (sim/pd_cluster.py) the two sides are two engines: the
producer's worker holds each send (`hold_sends`) until the consumer's read of it ends
(`release_send`) or the lease expires, and the consumer's worker reports each finished read with its
end time (`on_recv_done`) and reads at the pace the two sides' TP allows (`scale_read`).

With `replay` (a `TransferReplay`, sim/kv_transfer_replay.py) completion is not modelled: each
transfer is reported the recorded number of steps after the step that starts it, and no step waits
for a transfer (durations stay the forward pass's), so a simulated run reports transfers in exactly
the steps a recorded run (e.g. the torch backend's) did.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_connector.base import KVConnectorOutput
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.sim.kv_transfer_replay import TransferReplay
from servetwin.sim.links import LINK_PRESETS, Link, parse_link

# P/D between nodes over one 400 Gb/s NIC per GPU (vLLM's NIXL over UCX/RDMA); a CPU tier behind PCIe 5
DEFAULT_KV_LINK = "ib-ndr-400"
DEFAULT_PCIE_LINK = "pcie5-x16"
# servetwin's keys in `kv_connector_extra_config` (vLLM's connectors ignore keys they do not know)
KV_LINK_KEY = "kv_link"
PCIE_LINK_KEY = "pcie_link"


def transfer_links(config: KVTransferConfig) -> tuple[Link, Link]:
    """(the P/D link, the PCIe link to the CPU tier) from the extra config: a preset name or a mapping
    {bandwidth_gbps, latency_us, efficiency, preset}; errors name the key."""
    out = []
    for key, default in ((KV_LINK_KEY, DEFAULT_KV_LINK), (PCIE_LINK_KEY, DEFAULT_PCIE_LINK)):
        raw = config.get_from_extra_config(key, default)
        try:
            out.append(parse_link(raw, key))
        except ConfigError as e:
            raise e.within("kv_transfer_config.kv_connector_extra_config") from None
    return out[0], out[1]


@dataclass(slots=True)
class KVTransferTotals:
    """Bytes moved and transfers finished, by kind (`recv`, `send`, `load`, `store`)."""
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("recv", "send", "load", "store"), 0))
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("recv", "send", "load", "store"), 0))


@dataclass(order=True, slots=True)
class _InFlight:
    done_s: float
    seq: int
    kind: str = field(compare=False)  # recv | send | load | store
    req_id: str = field(compare=False)
    job_id: int = field(compare=False, default=-1)


class SimKVWorker:
    """One engine's connector worker in simulated time. `clock_s` is the start of the next step: the
    sum of the durations it was given, or the simulated time where a driver sets it before each step
    (sim/engine.py does, so transfers run on while the engine is idle)."""

    def __init__(self, kv_bytes_per_token: float, block_size: int, link: Link, pcie: Link,
                 offloading: bool = False, group_block_bytes: Optional[int] = None,
                 replay: Optional[TransferReplay] = None) -> None:
        self.offloading = offloading  # an offloading connector's worker (its counters are reported)
        # a block of one KV cache group where the model has several (a page of each of the group's layers);
        # a NIXL read moves the blocks of every group (None: one group holding every layer)
        self.group_block_bytes = group_block_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.block_size = block_size
        self.link = link
        self.pcie = pcie
        self.clock_s = 0.0
        self.horizon_s = math.inf  # the longest a wait step may last (a driver sets it before a step)
        self.in_flight: list[_InFlight] = []  # a heap by completion time
        self.totals = KVTransferTotals()
        self.recv_s: dict[str, float] = {}  # request -> modelled duration of its NIXL read
        self._seq = 0
        # cluster P/D (sim/pd_cluster.py): sends wait for the remote read (None: modelled here, see above)
        self.held_sends: Optional[dict[str, _InFlight]] = None
        self.lease_s = 30.0  # NIXL kv_lease_duration: a held send is given up this long after it started
        # called with (request, the read's end in seconds after the start of the step that reports it)
        self.on_recv_done: Optional[Callable[[str, float], None]] = None
        self._read_scale: dict[str, float] = {}
        # replay: completions in steps (the heap's times are then step indexes), not modelled times
        self.replay = replay
        self.num_steps = 0  # steps finished
        self._num_started: dict[tuple[str, str], int] = {}  # (kind, request) -> transfers started

    def block_bytes(self, num_blocks: int) -> int:
        return int(num_blocks * self.block_size * self.kv_bytes_per_token)

    def chunk_bytes(self, num_chunks: int) -> int:
        """An offloading job's bytes: a chunk is one block of one KV cache group (with hybrid groups,
        a page of each of the group's layers; else every layer's)."""
        return self.block_bytes(num_chunks) if self.group_block_bytes is None else num_chunks * self.group_block_bytes

    def hold_sends(self, lease_s: float) -> None:
        """Producer in a cluster: a send ends when `release_send` says the consumer's read ended, or
        `lease_s` after it started (vLLM's NIXL lease, `kv_lease_duration`)."""
        self.held_sends = {}
        self.lease_s = lease_s

    def release_send(self, req_id: str) -> bool:
        """The consumer's read of `req_id` ended: the send is reported by the next step (False: no such
        held send, e.g. its lease expired first)."""
        held = self.held_sends.pop(req_id, None) if self.held_sends is not None else None
        if held is None:
            return False
        held.done_s = min(held.done_s, self.clock_s)
        heapq.heapify(self.in_flight)
        return True

    def scale_read(self, req_id: str, scale: float) -> None:
        """The read of `req_id` moves `scale` times this rank's shard over this rank's link (a remote side
        with fewer TP ranks than this one serves several shards through each of its NICs)."""
        self._read_scale[req_id] = scale

    def has_in_flight(self) -> bool:
        return bool(self.in_flight)

    def next_done_s(self) -> float:
        """When the first transfer in flight ends (on `clock_s`'s scale)."""
        return self.in_flight[0].done_s

    def _add(self, kind: str, req_id: str, num_bytes: int, start_s: float, link: Link, job_id: int = -1) -> float:
        if self.replay is None:
            done = start_s + link.transfer_s(num_bytes)
        else:
            nth = self._num_started.get((kind, req_id), 0)
            self._num_started[(kind, req_id)] = nth + 1
            delay = self.replay.delay(kind, req_id, job_id, nth)
            done = math.inf if delay is None else float(self.num_steps + delay)
        self._seq += 1
        heapq.heappush(self.in_flight, _InFlight(done, self._seq, kind, req_id, job_id))
        self.totals.bytes[kind] += num_bytes
        return done

    def start(self, meta: Any, prompt_tokens: Mapping[str, int]) -> None:
        """The step's new transfers (its `kv_connector_metadata`), before the forward pass.
        `prompt_tokens`: the prompt length of each request this engine holds (a send's size)."""
        if meta is None:
            return
        if hasattr(meta, "reqs_to_recv"):
            self._start_nixl(meta, prompt_tokens)

    def _start_nixl(self, meta: Any, prompt_tokens: Mapping[str, int]) -> None:
        now = self.clock_s
        for rid, recv in meta.reqs_to_recv.items():
            if not recv.awaiting_kvs:  # a notice to the remote engine: nothing to read
                continue
            if self.group_block_bytes is None:  # one KV cache group holding every layer
                num_bytes = self.block_bytes(len(recv.local_block_ids[0]) if recv.local_block_ids else 0)
            else:  # hybrid groups (e.g. sliding window + full): each group's blocks, a page of its layers each
                num_bytes = sum(len(ids) for ids in recv.local_block_ids) * self.group_block_bytes
            num_bytes = int(num_bytes * self._read_scale.pop(rid, 1.0))
            done = self._add("recv", rid, num_bytes, now, self.link)
            if self.replay is None:  # (replayed: a step index, not a time)
                self.recv_s[rid] = done - now
        for rid in meta.reqs_to_send:
            num_blocks = -(-prompt_tokens.get(rid, 0) // self.block_size)
            if self.held_sends is None:
                self._add("send", rid, self.block_bytes(num_blocks), now, self.link)
                continue
            self.totals.bytes["send"] += self.block_bytes(num_blocks)  # what the remote read moves
            self._seq += 1
            held = _InFlight(now + self.lease_s, self._seq, "send", rid)
            heapq.heappush(self.in_flight, held)
            self.held_sends[rid] = held

    def finish(self, meta: Any, duration_s: float, ran_tokens: bool) -> tuple[Optional[KVConnectorOutput], float]:
        """After the forward pass of `duration_s`: (what the step reports, the step's duration, longer
        when it waited for a flush, a sync load or, with no tokens run, the next transfer)."""
        start = self.clock_s
        end = start + duration_s
        jobs = getattr(meta, "load_jobs", None)
        if jobs is not None:
            must_end = self._offload_jobs(meta, start, end)
            end = end if self.replay is not None else must_end
        if self.replay is None and not ran_tokens and self.in_flight and self.in_flight[0].done_s > end:
            end = max(end, min(self.in_flight[0].done_s, start + self.horizon_s))
        self.clock_s = end
        step, self.num_steps = self.num_steps, self.num_steps + 1
        return self._report(end if self.replay is None else step, start), end - start

    def _offload_jobs(self, meta: Any, start: float, end: float) -> float:
        flush = set(meta.jobs_to_flush)
        must_end = end
        for j, job in meta.load_jobs.items():
            done = self._add("load", job.req_id, self.chunk_bytes(job.num_blocks), start, self.pcie, j)
            if job.sync or j in flush:
                must_end = max(must_end, done)
        for j, job in meta.store_jobs.items():  # the KV exists once the forward pass is done
            done = self._add("store", job.req_id, self.chunk_bytes(job.num_blocks), end, self.pcie, j)
            if j in flush:
                must_end = max(must_end, done)
        older = flush - meta.load_jobs.keys() - meta.store_jobs.keys()
        for t in self.in_flight:  # flushed jobs of earlier steps: waited for before this forward pass
            if t.job_id in older:
                must_end = max(must_end, t.done_s)
        return must_end

    def _report(self, end: float, start: float) -> Optional[KVConnectorOutput]:
        recving: set[str] = set()
        sending: set[str] = set()
        jobs: dict[int, int] = {}
        while self.in_flight and self.in_flight[0].done_s <= end:
            t = heapq.heappop(self.in_flight)
            self.totals.finished[t.kind] += 1
            if t.kind == "send":
                sending.add(t.req_id)
                if self.held_sends is not None:
                    self.held_sends.pop(t.req_id, None)  # its lease expired
            elif t.kind == "recv":
                recving.add(t.req_id)
                if self.on_recv_done is not None:
                    self.on_recv_done(t.req_id, t.done_s - start)
            else:
                jobs[t.job_id] = 1
                if t.kind == "load":
                    recving.add(t.req_id)
        if not (recving or sending or jobs):
            return None
        return KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None,
                                 completed_jobs=jobs)


def build_kv_worker(config: KVTransferConfig, kv_bytes_per_token: float, block_size: int,
                    group_block_bytes: Optional[int] = None,
                    replay: Optional[TransferReplay] = None) -> SimKVWorker:
    """The worker for `config`; with `replay`, completions come from a recorded run (module docstring)."""
    link, pcie = transfer_links(config)
    return SimKVWorker(kv_bytes_per_token, block_size, link, pcie,
                       offloading=config.kv_connector == "OffloadingConnector", group_block_bytes=group_block_bytes,
                       replay=replay)


__all__ = ["DEFAULT_KV_LINK", "DEFAULT_PCIE_LINK", "KV_LINK_KEY", "PCIE_LINK_KEY", "LINK_PRESETS",
           "KVTransferTotals", "SimKVWorker", "build_kv_worker", "transfer_links"]
