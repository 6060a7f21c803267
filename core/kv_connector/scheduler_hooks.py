"""The scheduler's side of the KV connector API: vLLM 0.33 `v1/core/sched/scheduler.py`'s connector
paths, kept apart from the scheduler's hot loops (a mixin of `Scheduler`; `sched` below = that file).

State it adds to the scheduler:
- `connector` (None: no connector, and none of this runs), `connector_prefix_cache_stats`;
- `kv_holding_waiting`: waiting requests that hold KV blocks (a remote load in flight or done),
  drained before `waiting` (sched:236, :1062-1066);
- `finished_recving_kv_req_ids` / `failed_recving_kv_req_ids`: loads the worker reported;
- `_inflight_prefills`: requests still prefilling, whose remaining blocks an async load must leave
  free (`_inflight_prefill_reserved_blocks`, sched:3432-3436);
- `defer_block_free` (async scheduling + a consumer): freed blocks go back to the pool only once the
  step that may still write them is processed (sched:188-196, :3077-3119).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Optional

from servetwin.core.kv_cache.kv_cache_manager import PrefixCacheStats
from servetwin.core.kv_connector.base import KVConnectorBase, KVConnectorOutput
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.factory import create_connector
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.outputs import EngineCoreOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sched.request_queue import create_request_queue

if TYPE_CHECKING:
    from servetwin.core.kv_cache.kv_cache_manager import KVCacheManager


class ConnectorSchedulerMixin:
    """Connector hooks of `Scheduler` (which provides `kv_cache_manager`, `requests`, `running`,
    `waiting`, `policy`, `block_size`, `max_model_len`, `finished_req_ids`, `deferred_waiting`)."""

    kv_cache_manager: "KVCacheManager"
    requests: dict[str, Request]
    num_spec_tokens: int  # speculative decoding (the scheduler's _init_spec_decode)
    num_lookahead_tokens: int

    def _init_connector(self, kv_transfer_config: Optional[KVTransferConfig], async_scheduling: bool,
                        log_stats: bool) -> None:
        self.kv_transfer_config = kv_transfer_config
        self.connector: Optional[KVConnectorBase] = None
        self.connector_prefix_cache_stats: Optional[PrefixCacheStats] = None
        self.recompute_kv_load_failures = True
        self.defer_block_free = False
        self.kv_holding_waiting = create_request_queue(self.policy)
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self._inflight_prefills: dict[str, Request] = {}  # by id (a compiled Request is unhashable)
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: deque[tuple[int, list]] = deque()
        if kv_transfer_config is None:
            return
        self.connector = create_connector(kv_transfer_config, self.block_size,
                                          self.kv_cache_manager.kv_cache_groups,
                                          self.kv_cache_manager.coordinator.retention_interval)
        if log_stats:
            self.connector_prefix_cache_stats = PrefixCacheStats()
        self.recompute_kv_load_failures = kv_transfer_config.kv_load_failure_policy == "recompute"
        # two batches in flight and a consumer: a load must not land in blocks a step still writes
        self.defer_block_free = async_scheduling and kv_transfer_config.is_kv_consumer

    def _add_connector_stats(self, stats: Any) -> None:
        """`make_stats` with a connector: its hits for this schedule (reset per schedule, like the local
        hits) and its counters (a `SchedulerStats`' connector_prefix_cache_stats, kv_connector_stats)."""
        if self.connector_prefix_cache_stats is not None:
            stats.connector_prefix_cache_stats = self.connector_prefix_cache_stats
            self.connector_prefix_cache_stats = PrefixCacheStats()
        stats.kv_connector_stats = self.connector.take_stats()

    # -- admission (the waiting pass) ----------------------------------------------------------
    @staticmethod
    def _holds_kv_blocks(request: Request) -> bool:
        return request.num_computed_tokens > 0 or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def _enqueue_waiting_request(self, request: Request) -> None:
        (self.kv_holding_waiting if self._holds_kv_blocks(request) else self.waiting).add_request(request)

    def _skip_waiting_request(self, queue, skipped_holding: deque, skipped_waiting: deque) -> None:
        """vLLM's `skip_request`: out of the queue for this step, back at its head afterwards."""
        request = queue.pop_request()
        self.deferred_waiting.add(request.request_id)
        (skipped_holding if self._holds_kv_blocks(request) else skipped_waiting).appendleft(request)

    def _connector_matched_tokens(self, request: Request, hit_blocks, num_hit: int):
        """(hit blocks, local hit, external tokens, load asynchronously) for a request with no
        computed tokens, or None: the connector cannot tell yet (skip it this step). The connector
        sees a block-aligned local hit; a longer remote hit supersedes a sub-block local tail
        (sched:1130-1187)."""
        partial_tail = num_hit % self.block_size
        aligned = num_hit - partial_tail
        ext, load_async = self.connector.get_num_new_matched_tokens(request, aligned)
        if request.skip_reading_prefix_cache:
            ext, load_async = 0, False
        if ext is None:
            return None
        if partial_tail and ext > partial_tail:
            n = cdiv(aligned, self.block_size)
            hit_blocks = tuple(g[:n] for g in hit_blocks)
            num_hit = aligned
        elif partial_tail:
            ext, load_async = 0, False
        return hit_blocks, num_hit, ext, load_async

    def _connector_after_alloc(self, request: Request, num_external: int, queries: int) -> None:
        self.connector.update_state_after_alloc(
            request, self.kv_cache_manager.get_blocks(request.request_id), num_external)
        if self.connector_prefix_cache_stats is not None and queries:
            self.connector_prefix_cache_stats.record(queries, num_external, request.num_preemptions > 0)

    def _inflight_prefill_reserved_blocks(self) -> int:
        """Blocks the in-flight prefills still need for their whole sequence and, with speculative
        decoding, one verify step (1 + k drafts + lookahead) past it (sched:3404-3436)."""
        coord = self.kv_cache_manager.coordinator
        spec_step = 1 + self.num_spec_tokens + self.num_lookahead_tokens if self.num_spec_tokens else 0
        total = 0
        for request in self._inflight_prefills.values():
            num_tokens = min(request.num_tokens, self.max_model_len) + spec_step
            total += coord.get_num_blocks_to_allocate(request.request_id, num_tokens, coord.empty_hits,
                                                      request.num_computed_tokens, True)
        return total

    def _finish_remote_kv_wait(self, request: Request) -> bool:
        """A WAITING_FOR_REMOTE_KVS request at the head of its queue: False while its load is not
        reported; else cache what loaded and promote it (sched:3467-3530). A full-prompt load
        recomputes the last token, so the first step samples."""
        rid = request.request_id
        if rid not in self.finished_recving_kv_req_ids:
            return False
        kv = self.kv_cache_manager
        if rid in self.failed_recving_kv_req_ids:
            if request.num_computed_tokens:
                kv.cache_blocks(request, request.num_computed_tokens)
            else:
                kv.free(request)  # nothing valid: a retry may find a local hit
            self.failed_recving_kv_req_ids.remove(rid)
        else:
            kv.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1
        self.finished_recving_kv_req_ids.remove(rid)
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        return True

    # -- finishing ------------------------------------------------------------------------------
    def _connector_finished(self, request: Request) -> tuple[bool, Optional[dict[str, Any]]]:
        """`request_finished` with the blocks that hold the request's computed tokens (sched:3349-3402)."""
        kv = self.kv_cache_manager
        rid = request.request_id
        if kv.has_windows:
            kv.coordinator.remove_skipped_blocks(
                rid, max(0, request.num_computed_tokens - request.num_in_flight_tokens))
        n = cdiv(request.num_computed_tokens, self.block_size)
        block_ids = tuple(ids[:n] for ids in kv.get_block_ids(rid))
        return self.connector.request_finished(request, block_ids)

    def _free_blocks(self, request: Request) -> None:
        """Return a finished request's blocks and forget it."""
        self._free_request_blocks(request)
        del self.requests[request.request_id]

    def _free_request_blocks(self, request: Request) -> None:
        """With `defer_block_free`, blocks an in-flight step may still write wait for that step's
        output (sched:3077-3093)."""
        kv = self.kv_cache_manager
        if not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq:
            kv.free(request)
            return
        blocks = kv.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def _victim_blocks_can_be_freed(self, priority: bool) -> bool:
        """Whether preempting the running pass's next victim would free its blocks now."""
        if priority:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        else:
            victim = self.running[-1]
        return victim.last_sched_seq <= self.processed_step_seq

    def _finalise_connector(self, scheduler_output) -> None:
        """End of `schedule()`, computed counts advanced: the connector's metadata for the worker
        (vLLM builds it just before advancing them; servetwin's connectors read the advanced counts);
        the fence of this step's writes (non-empty steps only); requests leaving prefill stop
        reserving blocks."""
        scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(scheduler_output)
        nst = scheduler_output.num_scheduled_tokens
        if self.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            self.sched_step_seq += 1
            for rid in nst:
                self.requests[rid].last_sched_seq = self.sched_step_seq
        if self._inflight_prefills:
            for rid in nst:
                r = self.requests[rid]
                if not r.is_prefill_chunk:
                    self._inflight_prefills.pop(rid, None)

    def _drain_deferred_frees(self) -> None:
        pool = self.kv_cache_manager.block_pool
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            _, blocks = self.deferred_frees.popleft()
            pool.free_blocks(reversed(blocks))  # tail first, as a free does

    # -- the worker's report (update_from_output) ----------------------------------------------
    def _handle_failed_recving(self, failed_req_ids: set[str]) -> set[str]:
        """Failed whole-request loads (sched:3688-3700): "recompute" drops the computed count to 0
        (the local hit is kept when the load is reported done); "fail" returns them to finish."""
        affected = set()
        for rid in failed_req_ids:
            request = self.requests.get(rid)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                affected.add(rid)
                if self.recompute_kv_load_failures:
                    request.num_computed_tokens = 0
                    self.failed_recving_kv_req_ids.add(rid)
        return set() if self.recompute_kv_load_failures else affected

    def _handle_invalid_blocks(self, invalid_block_ids: set[int],
                               num_scheduled_tokens: dict[str, int]) -> set[str]:
        """Blocks whose KV failed to load (sched:3702-3783): the affected requests' computed counts
        drop to the first invalid block. Returns the ids the update must skip (and, with "fail",
        finish with an error)."""
        if len(self.kv_cache_manager.kv_cache_groups) > 1:
            raise RuntimeError("A KV connector reported block-level load failures (invalid_block_ids), "
                               "which is not supported with several KV cache groups")
        waiting_loads = [r for r in self.kv_holding_waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        async_failed, _ = self._requests_with_invalid_blocks(waiting_loads, invalid_block_ids,
                                                             num_scheduled_tokens, None)
        evict: set[int] = set()
        sync_failed, _ = self._requests_with_invalid_blocks(self.running, invalid_block_ids,
                                                            num_scheduled_tokens, evict)
        if not async_failed and not sync_failed:
            return set()
        if not self.recompute_kv_load_failures:
            if evict:
                self.kv_cache_manager.evict_blocks(evict)
            return async_failed | sync_failed
        self.failed_recving_kv_req_ids |= async_failed
        return sync_failed

    def _requests_with_invalid_blocks(self, requests, invalid_block_ids: set[int],
                                      num_scheduled_tokens: dict[str, int],
                                      evict: Optional[set[int]]) -> tuple[set[str], int]:
        """(affected ids, tokens to recompute); truncates each affected request's computed count at
        its first invalid block that no earlier request already recomputes (sched:3586-3686)."""
        affected: set[str] = set()
        total = 0
        marked: set[int] = set()
        bs = self.block_size
        for request in requests:
            rid = request.request_id
            (block_ids,) = self.kv_cache_manager.get_block_ids(rid)
            computed = request.num_computed_tokens - num_scheduled_tokens.get(rid, 0)
            is_affected = truncated = False
            for idx, bid in zip(range(cdiv(computed, bs)), block_ids):
                if bid not in invalid_block_ids:
                    continue
                is_affected = True
                if bid in marked:
                    continue
                marked.add(bid)
                if truncated:
                    continue
                truncated = True
                request.num_computed_tokens = idx * bs
                total += computed - request.num_computed_tokens
                if evict is not None:
                    evict.update(block_ids[idx:])
            if is_affected:
                if not truncated:
                    total += request.num_computed_tokens - computed
                    request.num_computed_tokens = computed
                affected.add(rid)
        return affected, total

    def _begin_connector_update(self, scheduler_output, output: Optional[KVConnectorOutput]) -> set[str]:
        """Start of `update_from_output`: the processed step's fence releases deferred frees; failed
        loads are found (their ids are skipped by the update)."""
        if self.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            self.processed_step_seq += 1
            self._drain_deferred_frees()
        failed: set[str] = set()
        if output is not None and output.failed_recving:
            failed |= self._handle_failed_recving(output.failed_recving)
        if output is not None and output.invalid_block_ids:
            failed |= self._handle_invalid_blocks(output.invalid_block_ids,
                                                  scheduler_output.num_scheduled_tokens)
        return failed

    def _end_connector_update(self, output: Optional[KVConnectorOutput], failed_kv_loads,
                              outputs: list) -> None:
        """End of `update_from_output`: with the "fail" policy, failed loads finish with an error
        (sched:2553-2577); then finished transfers promote or free (sched:2581)."""
        if failed_kv_loads and not self.recompute_kv_load_failures:
            for request in self.finish_requests(sorted(failed_kv_loads), RequestStatus.FINISHED_ERROR):
                outputs.append(EngineCoreOutput(request.request_id, [], request.get_finished_reason()))
        if output is not None:
            self._update_from_kv_xfer_finished(output)

    def _update_from_kv_xfer_finished(self, output: KVConnectorOutput) -> None:
        """Finished loads promote their request at its next turn; a finished request's load or send
        frees its blocks (sched:3556-3583)."""
        self.connector.update_connector_output(output)
        for rid in output.finished_recving or ():
            request = self.requests[rid]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(rid)
            else:
                assert request.is_finished(), f"{rid}: finished_recving for a {request.status.name} request"
                self._free_blocks(request)
        for rid in output.finished_sending or ():
            self._free_blocks(self.requests[rid])

    def delayed_free_blocks(self) -> dict[str, int]:
        """{id: blocks held} of finished requests whose blocks a connector still holds."""
        kv = self.kv_cache_manager
        return {rid: sum(kv.num_blocks_per_group(rid)) for rid, r in self.requests.items() if r.is_finished()}
