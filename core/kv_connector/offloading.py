"""An offloading connector with vLLM 0.33's OffloadingConnector scheduler semantics (a CPU tier,
`kv_connector/v1/offloading/scheduler.py`), one chunk per block, for full-attention and sliding-window
KV cache groups: vLLM 0.33's connector supports the hybrid KV cache manager (`SupportsHMA`) and
offloads every prefix-cacheable group (`offloading/config.py:39-46`); a chunk is one block of one
group, keyed by (block hash, group index) (`v1/kv_offload/base.py:30-32`).

- Lookup (scheduler.py:849-1053): the tokens after the local prefix-cache hit that the CPU tier holds
  in every group: a full-attention group's chunks as a prefix, a sliding-window group's as the last
  run of `cdiv(W, block)` chunks before the hit's end (the groups are looked up again until the hit
  converges); with a sliding-window group the last prompt token is never a hit. At least one chunk,
  else 0; "ask again later" (None) while a hit chunk is still being stored or loaded, or while the
  request has jobs in flight. Hits load asynchronously (WAITING_FOR_REMOTE_KVS).
- Stores (scheduler.py:1815-2101): `build_connector_meta` stores each request's newly computed full
  prompt chunks of every group; a sliding-window group's only where a later lookup can reach them
  (the window's tail before the prompt's replay boundary and a shared-prefix junction under sparse
  retention, `_reachable_store_mask`) and never a block the window already freed (the CPU tier makes
  room by eviction, or skips the store when it cannot); a preempted request's jobs, and stores whose
  blocks are reallocated this step (a finished request's, or a sliding-window block freed while its
  request runs), are flushed (`jobs_to_flush`).
- `update_connector_output`: completed jobs (`completed_jobs`) make stored chunks readable and unpin
  loaded ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_cache_interface import FULL_ATTENTION, SLIDING_WINDOW
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.kv_connector.base import KVConnectorBase, KVConnectorOutput, KVConnectorOutputError
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.cpu_tier import (
    POLICIES, CPUOffloadingManager, LookupResult, OffloadKey, RequestContext, make_offload_key)
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
    deferred_fence_block_ids: list[int] = field(default_factory=list)  # full attention: fenced once finished
    fenced_block_ids: list[int] = field(default_factory=list)  # sliding window: fenced from the store on


@dataclass(slots=True, frozen=True)
class _GroupConfig:
    """One offloaded KV cache group (vLLM's `GroupOffloadConfig`, one block per chunk)."""
    group_idx: int
    sliding_window: Optional[int] = None  # None: full attention
    window_chunks: Optional[int] = None  # chunks a hit needs (offloading/config.py:61-72)

    def load_window_chunks(self, num_tokens: int, block_size: int) -> Optional[int]:
        """The chunks a load of a hit ending at `num_tokens` reads (scheduler.py:117-133)."""
        if self.sliding_window is None:
            return None
        return max(self.window_chunks, cdiv(self.sliding_window - 1 + (-num_tokens % block_size), block_size))


@dataclass(slots=True)
class _GroupState:
    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_stored_chunk_idx: int = 0


@dataclass(slots=True)
class _RequestState:
    request: "Request"
    groups: tuple[_GroupState, ...]
    ctx: RequestContext = field(default_factory=RequestContext)
    num_locally_computed_tokens: int = 0
    transfer_jobs: set[int] = field(default_factory=set)
    finished_signaled: bool = False

    def update_offload_keys(self, configs: tuple[_GroupConfig, ...], block_size: int) -> None:
        hashes = self.request.block_hashes
        if len(hashes) == len(self.groups[0].keys):  # (every group keys every hash)
            return
        for config, state in zip(configs, self.groups):
            for h in hashes[len(state.keys):]:
                key = make_offload_key(h, config.group_idx)
                state.keys.append(key)
                self.ctx.positions[key] = len(state.keys) * block_size


def _offloaded_groups(kv_cache_groups: Optional[tuple], block_size: int) -> tuple[_GroupConfig, ...]:
    """Every group, full attention and sliding window (vLLM's prefix-cacheable groups)."""
    configs = []
    for idx, spec in enumerate(kv_cache_groups or (None,)):
        if spec is None or spec.type == FULL_ATTENTION:
            configs.append(_GroupConfig(idx))
        elif spec.type == SLIDING_WINDOW:
            configs.append(_GroupConfig(idx, spec.sliding_window, cdiv(spec.sliding_window, block_size)))
        else:
            raise ConfigError("kv_connector", f"OffloadingConnector: full-attention and sliding-window KV cache "
                              f"groups only (group {idx} is {spec.type})")
    return tuple(configs)


class OffloadingConnector(KVConnectorBase):
    """vLLM's `OffloadingConnector` with the CPU tier (`kv_connector_extra_config`: `cpu_bytes_to_use`,
    `eviction_policy` "lru", `store_threshold`; `kv_bytes_per_block`, the KV bytes of one block of one
    group on every rank, default one 4096-byte page). A best-effort cache: it never delays a free.
    `retention_interval`: the engine's `prefix_cache_retention_interval` (which sliding-window blocks
    a lookup can reach)."""

    class_name = "OffloadingConnector"
    requires_kv_delivery = False
    uses_retention_interval = True  # create_connector passes the engine's prefix_cache_retention_interval

    def __init__(self, config: KVTransferConfig, block_size: int, kv_cache_groups: Optional[tuple] = None,
                 retention_interval: Optional[int] = 0) -> None:
        super().__init__(config, block_size, kv_cache_groups)
        self._groups = _offloaded_groups(kv_cache_groups, block_size)
        self._sliding_groups = tuple(i for i, g in enumerate(self._groups) if g.sliding_window is not None)
        # full attention first, then the windows, widest first (scheduler.py:574-592)
        self._lookup_groups = tuple(i for i, g in enumerate(self._groups) if g.sliding_window is None) + tuple(
            sorted(self._sliding_groups, key=lambda i: self._groups[i].window_chunks, reverse=True))
        self.retention_interval = retention_interval
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
        self._req_status[request.request_id] = _RequestState(request, tuple(_GroupState() for _ in self._groups))

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        req = self._req_status[request.request_id]
        for state in req.groups:
            state.block_ids.clear()
            state.next_stored_chunk_idx = 0  # restarting at token 0: every chunk is offered again
        if req.transfer_jobs:
            return None, False  # retry while its jobs are in flight (scheduler.py:1247-1252)
        req.update_offload_keys(self._groups, self.block_size)
        req.num_locally_computed_tokens = num_computed_tokens
        hit = 0 if request.skip_reading_prefix_cache else self._lookup(req)
        return hit, bool(hit)

    def _prefix_hits(self, keys: list[OffloadKey]) -> Optional[int]:
        """Consecutive chunks held from the start; None while one of them is still being stored."""
        hits, pending = 0, False
        for key in keys:
            result = self.manager.lookup(key)
            if result is LookupResult.MISS:
                break
            hits += 1
            pending |= result is LookupResult.HIT_PENDING
        return None if pending else hits

    def _window_hits(self, keys: list[OffloadKey], window: int, initial_window: int) -> Optional[int]:
        """The end (in `keys`) of the last run of `window` held chunks, scanning from the right (the
        first run may need `initial_window`); 0: none; None while a chunk of the run is being stored
        (scheduler.py:805-847)."""
        pending, run, need = False, 0, initial_window
        for idx in range(len(keys) - 1, -1, -1):
            result = self.manager.lookup(keys[idx])
            if result is LookupResult.MISS:
                run, pending, need = 0, False, window
                continue
            run += 1
            pending |= result is LookupResult.HIT_PENDING
            if run == need:
                return None if pending else idx + need
        return None if pending else run

    def _lookup(self, req: _RequestState) -> Optional[int]:
        """Tokens beyond the local hit every group's CPU chunks cover, chunk-granular; the groups are
        looked up again while one shortens the hit (scheduler.py:849-1053)."""
        bs = self.block_size
        computed = req.num_locally_computed_tokens
        max_hit = req.request.num_tokens - (1 if self._sliding_groups else 0)
        num_hit, defer = 0, False
        lookup_groups = self._lookup_groups
        while lookup_groups:
            looked_up_window = False
            groups, lookup_groups = lookup_groups, ()
            for gi in groups:
                config, keys = self._groups[gi], req.groups[gi].keys
                max_hit = min(max_hit, len(keys) * bs)
                if max_hit - computed < bs:
                    return 0
                start = computed // bs
                candidates = keys[start:min(cdiv(max_hit, bs), len(keys))]
                if config.sliding_window is None:
                    hits = self._prefix_hits(candidates)
                else:
                    hits = self._window_hits(candidates, config.window_chunks,
                                             config.load_window_chunks(max_hit, bs))
                if hits == 0:
                    return 0
                if hits is None:
                    defer = True
                else:
                    max_hit = min(max_hit, bs * (start + hits))
                new_hit = max_hit - computed
                if new_hit < bs:
                    return 0
                if new_hit < num_hit:
                    if defer:
                        defer, lookup_groups = False, self._lookup_groups
                    elif looked_up_window and not lookup_groups:
                        lookup_groups = self._sliding_groups
                looked_up_window |= config.sliding_window is not None
                num_hit = new_hit
        if defer:
            return None
        if self._chunks_being_loaded:  # hit chunks already being loaded: ask again later
            end = computed + num_hit
            for config, state in zip(self._groups, req.groups):
                loaded = state.keys[computed // bs:cdiv(end, bs)]
                window = config.load_window_chunks(end, bs)
                if window is not None:
                    loaded = loaded[-window:]
                if any(k in self._chunks_being_loaded for k in loaded):
                    return None
        return num_hit

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        for group in blocks:
            self._batch_allocated_block_ids.update(b.block_id for b in group if not b.is_null)
        if num_external_tokens == 0:
            return
        req = self._req_status[request.request_id]
        bs = self.block_size
        computed = req.num_locally_computed_tokens
        num_cached = computed + num_external_tokens
        num_blocks = cdiv(num_cached, bs)
        keys: list[OffloadKey] = []
        gpu_block_ids: list[int] = []
        for config, state in zip(self._groups, req.groups):
            group = blocks[config.group_idx]
            # the first fresh block past the local hit (a window's nulls and kept blocks are skipped)
            load_start = next((i for i in range(cdiv(computed, bs), num_blocks)
                               if not group[i].is_null and group[i].block_hash is None), num_blocks)
            keys += state.keys[load_start:num_blocks]
            gpu_block_ids += (b.block_id for b in group[load_start:num_blocks])
            state.next_stored_chunk_idx = num_blocks  # CHUNK_LEVEL: loaded chunks are stored
        self.manager.prepare_load(keys, req.ctx)
        job_id = self._new_job(req, list(keys), is_store=False)
        self._batch_load_jobs[job_id] = TransferJob(request.request_id, sync=False, num_blocks=len(keys),
                                                    gpu_block_ids=tuple(gpu_block_ids),
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
        """Each scheduled request's block tables (whole for new / resumed ones); a sliding-window
        block not stored yet that this step reallocated (the window freed it) is dropped, 0
        (scheduler.py:1502-1552)."""
        cached = so.scheduled_cached_reqs
        tables = [(r.req_id, r.block_ids, True) for r in so.scheduled_new_reqs]
        tables += [(rid, ids, rid in cached.resumed_req_ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids)]
        old_ends: dict[str, tuple[int, ...]] = {}
        for rid, block_ids, full in tables:
            req = self._req_status[rid]
            req.update_offload_keys(self._groups, self.block_size)
            if full:
                for state in req.groups:
                    state.block_ids.clear()
            if block_ids:
                old_ends[rid] = tuple(len(req.groups[gi].block_ids) for gi in self._sliding_groups)
                for config, state in zip(self._groups, req.groups):
                    new = block_ids[config.group_idx]
                    state.block_ids.extend(new)
                    self._batch_allocated_block_ids.update(b for b in new if b != 0)
        if not (self._sliding_groups and self._batch_allocated_block_ids):
            return
        reallocated = self._batch_allocated_block_ids
        for rid, req in self._req_status.items():
            ends = old_ends.get(rid)
            for i, gi in enumerate(self._sliding_groups):
                ids = req.groups[gi].block_ids
                for j in range(req.groups[gi].next_stored_chunk_idx, len(ids) if ends is None else ends[i]):
                    if ids[j] in reallocated:
                        ids[j] = 0

    def _reachable_store_mask(self, config: _GroupConfig, start: int, end: int,
                              boundaries: tuple[int, ...]) -> Optional[list[bool]]:
        """Which chunks [start, end) of a sliding-window group a later lookup can reach; None: all
        (vLLM's `SlidingWindowManager.reachable_block_mask` with the full-attention chunk as the
        alignment, single_type_kv_cache_manager.py:1067-1146; its final-segment tail applies only
        without a retention interval, where every block is reachable)."""
        if config.sliding_window is None:
            return None
        bs, interval = self.block_size, self.retention_interval
        need = cdiv(config.sliding_window - 1, bs)
        mask = [False] * (end - start)
        segment = bs if interval is None else (interval or None)
        if segment is not None:
            per_segment = segment // bs
            if need >= per_segment:
                return None
            for i in range(start, end):
                mask[i - start] = i % per_segment >= per_segment - need
        if interval is not None:
            for boundary in boundaries:
                tail_end = boundary // bs
                for j in range(max(start, tail_end - need), min(end, tail_end)):
                    mask[j - start] = True
        return mask

    def _store_candidates(self, req: _RequestState, num_offloadable: int) -> tuple[list[OffloadKey], list[int]]:
        """The chunks to offer the CPU tier, all groups, and each group's end (scheduler.py:1858-1968)."""
        r = req.request
        boundaries: tuple[int, ...] = ()
        if self.retention_interval is not None and r.shared_prefix_boundary:
            boundaries = (r.num_prompt_tokens - 1, r.shared_prefix_boundary)
        elif self.retention_interval is not None:
            boundaries = (r.num_prompt_tokens - 1,)
        keys: list[OffloadKey] = []
        ends: list[int] = []
        for config, state in zip(self._groups, req.groups):
            end = min(num_offloadable // self.block_size, len(state.block_ids), len(state.keys))
            ends.append(end)
            start = state.next_stored_chunk_idx
            if end <= start:
                continue
            mask = self._reachable_store_mask(config, start, end, boundaries)
            keys += (k for i, (k, b) in enumerate(zip(state.keys[start:end], state.block_ids[start:end]))
                     if b != 0 and (mask is None or mask[i]))
        return keys, ends

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
            keys, ends = self._store_candidates(req, offloadable)
            to_store = self.manager.prepare_store(keys, req.ctx) if keys else []
            if to_store is None:
                continue  # no room: offered again next step
            for state, end in zip(req.groups, ends):
                state.next_stored_chunk_idx = max(state.next_stored_chunk_idx, end)
            if not to_store:
                continue
            stored = set(to_store)
            src: list[int] = []
            fenced: list[int] = []
            deferred: list[int] = []
            for config, state in zip(self._groups, req.groups):
                for k, b in zip(state.keys, state.block_ids):
                    if k in stored and b != 0:
                        src.append(b)
                        (deferred if config.sliding_window is None else fenced).append(b)
            job_id = self._new_job(req, list(to_store), is_store=True)
            self._jobs[job_id].deferred_fence_block_ids = deferred
            self._jobs[job_id].fenced_block_ids = fenced
            for b in fenced:  # a window's block can be freed before its request finishes
                self._block_id_to_pending_jobs.setdefault(b, set()).add(job_id)
            jobs[job_id] = TransferJob(rid, num_blocks=len(src), gpu_block_ids=tuple(src),
                                       cpu_chunk_ids=self.manager.chunk_ids(to_store))
            self.stats.num_stores_started += 1
            if r.is_finished():
                for b in deferred:
                    self._block_id_to_pending_jobs.setdefault(b, set()).add(job_id)
                    if b in self._batch_allocated_block_ids:
                        self._batch_jobs_to_flush.add(job_id)
        return jobs

    # -- the worker's report, finishing ---------------------------------------------------------
    def _remove_pending_job(self, job_id: int, block_ids: list[int]) -> None:
        for b in block_ids:
            jobs = self._block_id_to_pending_jobs[b]
            jobs.remove(job_id)
            if not jobs:
                del self._block_id_to_pending_jobs[b]

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
            if self._block_id_to_pending_jobs:
                self._remove_pending_job(job_id, job.fenced_block_ids)
                if req.request.is_finished():
                    self._remove_pending_job(job_id, job.deferred_fence_block_ids)
            req.transfer_jobs.remove(job_id)
            if req.finished_signaled and not req.transfer_jobs:
                del self._req_status[job.req_id]

    def request_finished(self, request: "Request",
                         block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        req = self._req_status.get(request.request_id)
        if req is None:
            return False, None
        req.update_offload_keys(self._groups, self.block_size)
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
        """The CPU tier's ("stored" | "removed", block hash) events of the first offloaded group since
        the last call (a router's prefix index keys blocks by hash alone); [] when off."""
        events = self.manager.events
        if not events:
            return []
        self.manager.events = []
        suffix = make_offload_key(b"", self._groups[0].group_idx)
        return [(kind, key[:-len(suffix)]) for kind, key in events if key.endswith(suffix)]
