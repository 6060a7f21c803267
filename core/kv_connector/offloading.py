"""An offloading connector with vLLM 0.33's OffloadingConnector scheduler semantics (a CPU tier,
`kv_connector/v1/offloading/scheduler.py`), for full-attention KV cache groups, one chunk per block.

- Lookup: the chunks after the local prefix-cache hit that the CPU tier holds, as a prefix; at least
  one chunk, else 0; "ask again later" (None) while a hit chunk is still being stored or loaded, or
  while the request has jobs in flight. Hits load asynchronously (WAITING_FOR_REMOTE_KVS).
- Stores: `build_connector_meta` stores each request's newly computed full prompt chunks (the CPU
  tier makes room by eviction, or skips the store when it cannot); a preempted request's jobs, and a
  finished request's stores whose blocks are reallocated this step, are flushed (`jobs_to_flush`).
- `update_connector_output`: completed jobs (`completed_jobs`) make stored chunks readable and unpin
  loaded ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_cache_interface import FULL_ATTENTION
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.kv_connector.base import KVConnectorBase, KVConnectorOutput, KVConnectorOutputError
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.cpu_tier import (
    POLICIES, CPUOffloadingManager, LookupResult, OffloadKey, RequestContext)
from servetwin.core.request import RequestStatus

if TYPE_CHECKING:
    from servetwin.core.request import Request

PAGE_BYTES = 4096  # a CPU chunk is aligned to the page


@dataclass(slots=True)
class TransferJob:
    """One load (CPU chunks -> GPU blocks) or store (GPU blocks -> CPU chunks) for the worker side;
    `gpu_block_ids[i]` and `cpu_chunk_ids[i]` are one block's two places (vLLM's transfer specs)."""
    req_id: str
    sync: bool = False
    num_blocks: int = 0  # chunks (one block each) it moves: what a simulated worker prices
    gpu_block_ids: tuple[int, ...] = ()
    cpu_chunk_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class OffloadingConnectorMetadata:
    load_jobs: dict[int, TransferJob] = field(default_factory=dict)
    store_jobs: dict[int, TransferJob] = field(default_factory=dict)
    jobs_to_flush: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _JobStatus:
    req_id: str
    keys: list[OffloadKey]
    is_store: bool
    deferred_fence_block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _RequestState:
    request: "Request"
    ctx: RequestContext = field(default_factory=RequestContext)
    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_stored_chunk_idx: int = 0
    num_locally_computed_tokens: int = 0
    transfer_jobs: set[int] = field(default_factory=set)
    finished_signaled: bool = False

    def update_offload_keys(self, block_size: int) -> None:
        for h in self.request.block_hashes[len(self.keys):]:
            self.keys.append(h)
            self.ctx.positions[h] = len(self.keys) * block_size


class OffloadingConnector(KVConnectorBase):
    """vLLM's `OffloadingConnector` with the CPU tier (`kv_connector_extra_config`: `cpu_bytes_to_use`,
    `eviction_policy` "lru", `store_threshold`; `kv_bytes_per_block`, the KV bytes of one block,
    default one 4096-byte page). A best-effort cache: it never delays a free."""

    class_name = "OffloadingConnector"
    requires_kv_delivery = False

    def __init__(self, config: KVTransferConfig, block_size: int, kv_cache_groups: Optional[tuple] = None) -> None:
        super().__init__(config, block_size, kv_cache_groups)
        if any(g.type != FULL_ATTENTION for g in kv_cache_groups or ()):
            raise ConfigError("kv_connector", "OffloadingConnector: full-attention KV cache groups only")
        policy = config.get_from_extra_config("eviction_policy", "lru")
        if policy not in POLICIES:
            raise ConfigError("kv_connector_extra_config.eviction_policy",
                              f"must be one of {', '.join(POLICIES)}, got {policy!r}")
        cpu_bytes = config.get_from_extra_config("cpu_bytes_to_use", None)
        if not isinstance(cpu_bytes, int) or isinstance(cpu_bytes, bool) or cpu_bytes < 1:
            raise ConfigError("kv_connector_extra_config.cpu_bytes_to_use", "required, an integer >= 1")
        chunk_bytes = cdiv(int(config.get_from_extra_config("kv_bytes_per_block", PAGE_BYTES)), PAGE_BYTES) * PAGE_BYTES
        self.num_cpu_chunks = cpu_bytes // chunk_bytes
        self.manager = CPUOffloadingManager(self.num_cpu_chunks, policy,
                                            int(config.get_from_extra_config("store_threshold", 0)))
        self._req_status: dict[str, _RequestState] = {}
        self._jobs: dict[int, _JobStatus] = {}
        self._job_counter = 0
        self._chunks_being_loaded: set[OffloadKey] = set()
        self._block_id_to_pending_jobs: dict[int, set[int]] = {}
        self._batch_load_jobs: dict[int, TransferJob] = {}
        self._batch_jobs_to_flush: set[int] = set()
        self._batch_allocated_block_ids: set[int] = set()

    def _new_job(self, req: _RequestState, keys: list[OffloadKey], is_store: bool) -> int:
        job_id = self._job_counter
        self._job_counter += 1
        req.transfer_jobs.add(job_id)
        self._jobs[job_id] = _JobStatus(req.request.request_id, keys, is_store)
        return job_id

    # -- lookup and loads -----------------------------------------------------------------------
    def on_new_request(self, request: "Request") -> None:
        self._req_status[request.request_id] = _RequestState(request)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        req = self._req_status[request.request_id]
        req.block_ids.clear()
        req.next_stored_chunk_idx = 0  # restarting at token 0: every chunk is offered again
        if req.transfer_jobs:
            return None, False  # retry while its jobs are in flight (scheduler.py:1247-1252)
        req.update_offload_keys(self.block_size)
        req.num_locally_computed_tokens = num_computed_tokens
        hit = 0 if request.skip_reading_prefix_cache else self._lookup(req)
        return hit, bool(hit)

    def _lookup(self, req: _RequestState) -> Optional[int]:
        """Tokens beyond the local hit held by the CPU tier, chunk-granular (scheduler.py:849-1053)."""
        bs = self.block_size
        computed = req.num_locally_computed_tokens
        max_hit = min(req.request.num_tokens, len(req.keys) * bs)
        if max_hit - computed < bs:
            return 0
        start = computed // bs
        hits, pending = 0, False
        for key in req.keys[start:min(cdiv(max_hit, bs), len(req.keys))]:
            result = self.manager.lookup(key)
            if result is LookupResult.MISS:
                break
            hits += 1
            pending |= result is LookupResult.HIT_PENDING
        if hits == 0 and not pending:
            return 0
        if pending:
            return None
        num_hit = min(max_hit, bs * (start + hits)) - computed
        if num_hit < bs:
            return 0
        end = cdiv(computed + num_hit, bs)
        if any(k in self._chunks_being_loaded for k in req.keys[start:end]):
            return None  # hit chunks already being loaded: ask again later
        return num_hit

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        for group in blocks:
            self._batch_allocated_block_ids.update(b.block_id for b in group if not b.is_null)
        if num_external_tokens == 0:
            return
        req = self._req_status[request.request_id]
        bs = self.block_size
        num_cached = req.num_locally_computed_tokens + num_external_tokens
        num_gpu_blocks = cdiv(num_cached, bs)
        group = blocks[0]
        load_start = num_gpu_blocks
        for i in range(cdiv(req.num_locally_computed_tokens, bs), num_gpu_blocks):
            if not group[i].is_null and group[i].block_hash is None:
                load_start = i
                break
        keys = req.keys[load_start:cdiv(num_cached, bs)] if num_gpu_blocks > load_start else []
        gpu_block_ids = tuple(b.block_id for b in group[load_start:load_start + len(keys)])
        req.next_stored_chunk_idx = cdiv(num_cached, bs)  # CHUNK_LEVEL: loaded chunks are stored
        self.manager.prepare_load(keys, req.ctx)
        job_id = self._new_job(req, list(keys), is_store=False)
        self._batch_load_jobs[job_id] = TransferJob(request.request_id, sync=False, num_blocks=len(keys),
                                                    gpu_block_ids=gpu_block_ids,
                                                    cpu_chunk_ids=self.manager.chunk_ids(keys))
        self._chunks_being_loaded.update(keys)
        self.stats.num_loads_started += 1
        self.stats.num_loaded_tokens += num_external_tokens

    # -- stores (end of schedule) ---------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> OffloadingConnectorMetadata:
        """Called once the step's computed counts have advanced (servetwin's `_finalise` order)."""
        self._update_req_states(scheduler_output)
        for rid in scheduler_output.preempted_req_ids or ():
            req = self._req_status.get(rid)
            if req is not None:  # a preempted request's jobs finish before its blocks are reused
                self._batch_jobs_to_flush.update(req.transfer_jobs - self._batch_load_jobs.keys())
        pending = self._block_id_to_pending_jobs
        if pending and not pending.keys().isdisjoint(self._batch_allocated_block_ids):
            self._batch_jobs_to_flush.update(
                j for b in self._batch_allocated_block_ids if b in pending for j in pending[b])
        meta = OffloadingConnectorMetadata(self._batch_load_jobs, self._build_store_jobs(scheduler_output),
                                           self._batch_jobs_to_flush)
        for rid in scheduler_output.finished_req_ids or ():
            req = self._req_status.get(rid)
            if req is None:
                continue
            req.finished_signaled = True
            self.manager.on_request_finished(req.ctx)
            if not req.transfer_jobs:
                del self._req_status[rid]
        self._batch_load_jobs, self._batch_jobs_to_flush, self._batch_allocated_block_ids = {}, set(), set()
        return meta

    def _update_req_states(self, so) -> None:
        """Each scheduled request's block table (whole for new / resumed ones)."""
        cached = so.scheduled_cached_reqs
        tables = [(r.req_id, r.block_ids, True) for r in so.scheduled_new_reqs]
        tables += [(rid, ids, rid in cached.resumed_req_ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids)]
        for rid, block_ids, full in tables:
            req = self._req_status[rid]
            req.update_offload_keys(self.block_size)
            if full:
                req.block_ids.clear()
            if block_ids:
                req.block_ids.extend(block_ids[0])
                self._batch_allocated_block_ids.update(b for b in block_ids[0] if b != 0)

    def _build_store_jobs(self, so) -> dict[int, TransferJob]:
        """Newly computed full prompt chunks of each scheduled or finished request (scheduler.py:1815)."""
        jobs: dict[int, TransferJob] = {}
        for rid in [*so.num_scheduled_tokens, *(so.finished_req_ids or ())]:
            req = self._req_status.get(rid)
            if req is None:
                continue
            r = req.request
            if r.status == RequestStatus.FINISHED_ABORTED:
                after = r.num_computed_tokens
            elif r.is_finished():
                after = max(r.num_prompt_tokens, r.num_tokens - 1)
            else:
                after = r.num_computed_tokens  # (already advanced by this step)
            offloadable = min(after, r.num_tokens, r.num_prompt_tokens)  # offload_prompt_only
            num_chunks = min(offloadable // self.block_size, len(req.block_ids), len(req.keys))
            start = req.next_stored_chunk_idx
            keys = [k for k, b in zip(req.keys[start:num_chunks], req.block_ids[start:num_chunks]) if b != 0]
            if not keys:
                req.next_stored_chunk_idx = max(start, num_chunks)
                continue
            to_store = self.manager.prepare_store(keys, req.ctx)
            if to_store is None:
                continue  # no room: offered again next step
            if not to_store:
                req.next_stored_chunk_idx = max(start, num_chunks)
                continue
            stored = set(to_store)
            src = [b for k, b in zip(req.keys[start:num_chunks], req.block_ids[start:num_chunks])
                   if k in stored and b != 0]
            req.next_stored_chunk_idx = max(start, num_chunks)
            job_id = self._new_job(req, list(to_store), is_store=True)
            self._jobs[job_id].deferred_fence_block_ids = src
            jobs[job_id] = TransferJob(rid, num_blocks=len(src), gpu_block_ids=tuple(src),
                                       cpu_chunk_ids=self.manager.chunk_ids(to_store))
            self.stats.num_stores_started += 1
            if r.is_finished():
                for b in src:
                    self._block_id_to_pending_jobs.setdefault(b, set()).add(job_id)
                    if b in self._batch_allocated_block_ids:
                        self._batch_jobs_to_flush.add(job_id)
        return jobs

    # -- the worker's report, finishing ---------------------------------------------------------
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for job_id in connector_output.completed_jobs:
            job = self._jobs.pop(job_id, None)
            if job is None:  # (vLLM fails on a KeyError here)
                raise KVConnectorOutputError(
                    "kv_connector_output.completed_jobs", f"job {job_id} is reported done but is not in "
                    "flight (a worker that reports a job twice, e.g. a store flushed again while its "
                    "completion is still in flight under async scheduling)")
            req = self._req_status[job.req_id]
            if job.is_store:
                self.manager.complete_store(job.keys)
            else:
                self.manager.complete_load(job.keys)
                self._chunks_being_loaded.difference_update(job.keys)
            if self._block_id_to_pending_jobs and req.request.is_finished():
                for b in job.deferred_fence_block_ids:
                    jobs = self._block_id_to_pending_jobs[b]
                    jobs.remove(job_id)
                    if not jobs:
                        del self._block_id_to_pending_jobs[b]
            req.transfer_jobs.remove(job_id)
            if req.finished_signaled and not req.transfer_jobs:
                del self._req_status[job.req_id]

    def request_finished(self, request: "Request",
                         block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        req = self._req_status.get(request.request_id)
        if req is None:
            return False, None
        req.update_offload_keys(self.block_size)
        for job_id in req.transfer_jobs:  # its blocks may not be reused before these stores finish
            for b in self._jobs[job_id].deferred_fence_block_ids:
                self._block_id_to_pending_jobs.setdefault(b, set()).add(job_id)
        return False, None

    def has_pending_push_work(self) -> bool:
        return bool(self._jobs)

    # -- KV events (vLLM: `OffloadingConnector.take_events`, offloading_connector.py:231-233) --------------
    def enable_kv_cache_events(self) -> None:
        """Publish the CPU tier's stores and evictions (medium CPU), as with vLLM's `--kv-events-config`."""
        if self.manager.events is None:
            self.manager.events = []

    def take_events(self) -> list[tuple[str, Any]]:
        """The CPU tier's ("stored" | "removed", block hash) events since the last call; [] when off."""
        events = self.manager.events
        if not events:
            return []
        self.manager.events = []
        return events
