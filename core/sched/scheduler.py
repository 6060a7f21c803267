"""The scheduler: vLLM 0.33.0's `Scheduler.schedule()` / `update_from_output()` (docs/scheduler_behaviour.md §2-3).

There is no prefill or decode phase: each request has `num_computed_tokens` (C) and `num_tokens` (N)
and every step hands out tokens so that C catches up. Running requests first (admission order), then
waiting ones (only in a step without preemption). `async_scheduling=True` adds vLLM's one-step
run-ahead: output placeholders for tokens sampled but not yet returned (docs/scheduler_behaviour.md §2.10).

This module holds vLLM's behaviour only. servetwin's deliberate deviations are marked
`DEVIATION from vLLM` where they live (README, "Where servetwin deviates from vLLM on purpose").
Speed-ups that are not vLLM's (the simulator's implicit steady decodes and decode fast-forward) live
in a subclass, `servetwin.sim.scheduler.SimScheduler`, built on the protected interface documented on
`Scheduler`; tests/sim proves that subclass takes exactly this class's decisions.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, Iterable, Optional, Sequence

from servetwin.core.config_error import ConfigError
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.kv_cache.hashing import get_hash_fn_by_name, get_request_block_hasher
from servetwin.core.kv_cache.kv_cache_manager import KVCacheManager, PrefixCacheStats
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.scheduler_hooks import ConnectorSchedulerMixin
from servetwin.core.prompt_memo import PromptMemo
from servetwin.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from servetwin.core.outputs import EngineCoreOutput, ModelRunnerOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sched.request_queue import SchedulingPolicy, create_request_queue
from servetwin.core.sched.spec_decode import (DraftTokenIds, SpecDecodingStats, SpeculativeConfig,
                                              spec_decode_step_blocks)


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preempted_reqs: int = 0  # preemptions since the previous make_stats()
    # speculative decoding: drafts verified by the updates since the previous make_stats() (None: none)
    spec_decoding_stats: Optional[SpecDecodingStats] = None
    # KV connector: its hits for this schedule (vLLM's connector_prefix_cache_stats), its counters
    connector_prefix_cache_stats: Optional[PrefixCacheStats] = None
    kv_connector_stats: Optional[object] = None


def check_stop(request: Request, max_model_len: int) -> bool:
    """0.33 order: EOS, stop token ids, length caps, then the min_tokens gate (docs/scheduler_behaviour.md §3.1)."""
    sp = request.sampling_params
    last = request._output_token_ids[-1]
    if last == sp._eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if sp.stop_token_ids and last in sp.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    num_output = len(request._output_token_ids)
    if request.num_prompt_tokens + num_output >= max_model_len or num_output >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def _block_ids(blocks_per_group) -> tuple[list[int], ...]:
    """Block ids per KV cache group, group order (null entries are block 0)."""
    return tuple([[b.block_id for b in blocks] for blocks in blocks_per_group])


class UnservableRequestError(ConfigError):
    """A request that could never fit the KV pool (vLLM would block its queue forever); `path` is the
    request's field at fault (`prompt`), `message` says why."""


class Scheduler(ConnectorSchedulerMixin):
    """vLLM 0.33's scheduler (a KV connector's paths: `ConnectorSchedulerMixin`).

    Protected interface for subclasses (the contract `servetwin.sim.scheduler.SimScheduler` relies
    on; a subclass overrides only public methods and must leave every decision, block id and output
    equal to this class's):
    - `_long_prefill_threshold()`: the step's cap on one request's chunk (0: none).
    - `_running_tokens(request, threshold, max_model_len)`: the tokens the running pass gives
      `request` before the step budgets cap them (0: skipped this step).
    - `_schedule_waiting(threshold, token_budget, input_budget, new, resumed, req_to_new_blocks,
      num_scheduled_tokens)`: the waiting pass with the budgets the running pass left; admitted
      requests are appended to `running` (in admission order, at its end) and to the lists.
    - `_finalise(new, resumed, running_reqs, preempted, req_to_new_blocks, num_scheduled_tokens)`:
      builds the step's `SchedulerOutput` and advances C (vLLM's `_update_after_schedule`); the
      caller has already incremented `current_step`.
    """

    # Speed (pure Python): this class's attributes live in slots. CPython 3.11 keeps an instance's
    # attributes in a compact, shared-keys layout only up to 29 of them; past that the instance dict
    # turns into a plain one and every `self.method()` / attribute access on the scheduler loses its
    # specialisation (measured: 49 attributes once the KV connector and spec-decode state came in, the
    # simulator's loop ~3% slower). The mixin and subclasses keep a __dict__ (connector state,
    # SimScheduler's own, anything else set later), now small. Compiled, a native class is slotted anyway.
    __slots__ = (
        "scheduler_config", "cache_config", "max_num_running_reqs", "max_num_active_reqs",
        "max_num_scheduled_tokens", "max_num_batched_tokens", "max_model_len", "block_size", "policy",
        "async_scheduling", "use_pp", "log_stats", "num_hash_lookahead_tokens", "use_eagle_block_drop",
        "kv_cache_manager", "block_hasher", "requests", "waiting", "running", "deferred_waiting",
        "finished_req_ids", "reset_preempted_req_ids", "current_step", "num_preemptions_total",
        "_num_preempted_since_stats", "last_spec_decoding_stats", "_spec_stats_since_read",
        "speculative_config", "num_spec_tokens", "num_lookahead_tokens", "spec_decode_step_blocks",
        "_spec_token_placeholders", "_step_spec_tokens", "refuse_unservable",
    )

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 log_stats: bool = True, speculative_config: Optional[SpeculativeConfig] = None,
                 kv_transfer_config: Optional[KVTransferConfig] = None) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("num_gpu_blocks: the KV pool size must be known before building the scheduler")
        # (SchedulerConfig.__post_init__ resolves both None defaults; typed int for the compiled build)
        max_model_len, max_scheduled = scheduler_config.max_model_len, scheduler_config.max_num_scheduled_tokens
        assert max_model_len is not None and max_scheduled is not None
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        # check_servable refuses a request the pool can never hold (servetwin's DEVIATION); `servetwin replay`
        # turns it off to match vLLM's recorded decisions, where such a request waits forever
        self.refuse_unservable = True
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_active_reqs = scheduler_config.max_num_active_seqs or scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens: int = max_scheduled
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len: int = max_model_len
        self.block_size = cache_config.block_size
        self.policy = scheduler_config.scheduling_policy
        self.async_scheduling = scheduler_config.async_scheduling
        self.use_pp = scheduler_config.pipeline_parallel_size > 1  # vLLM 0.33 v1/core/sched/scheduler.py:386
        self.log_stats = log_stats
        # eagle / mtp: every block hash covers the next token too, or (no lookahead hashes, as with a
        # KV connector) a hit drops its last block (config/vllm.py:677-693, sched:330-345)
        self.num_hash_lookahead_tokens = speculative_config.num_hash_lookahead_tokens(
            cache_config.enable_prefix_caching, kv_transfer_config is not None) if speculative_config else 0
        self.use_eagle_block_drop = bool(speculative_config and speculative_config.use_eagle_block_drop(
            self.num_hash_lookahead_tokens))
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks=cache_config.num_gpu_blocks, block_size=cache_config.block_size,
            max_model_len=self.max_model_len, enable_caching=cache_config.enable_prefix_caching,
            watermark=scheduler_config.watermark, log_stats=log_stats,
            kv_cache_groups=cache_config.kv_cache_groups,
            prefix_cache_retention_interval=cache_config.prefix_cache_retention_interval,
            max_in_flight_tokens=scheduler_config.max_in_flight_tokens,
            drop_eagle_block=self.use_eagle_block_drop)
        self.block_hasher = self.make_block_hasher()
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.deferred_waiting: set[str] = set()
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        self.current_step = 0
        self.num_preemptions_total = 0
        self._num_preempted_since_stats = 0
        # speculative decoding's stats: of the last update, and merged since the last make_stats()
        self.last_spec_decoding_stats: Optional[SpecDecodingStats] = None
        self._spec_stats_since_read: Optional[SpecDecodingStats] = None
        self._init_spec_decode(speculative_config)
        # KV connector (None without kv_transfer_config) and the held-blocks queue
        self._init_connector(kv_transfer_config, self.async_scheduling, log_stats)

    def make_block_hasher(self, prompt_memo: Optional[PromptMemo] = None) -> Optional[Callable[[Any], list[bytes]]]:
        """The prefix cache's request block hasher (None: caching off); `prompt_memo`: see
        `get_request_block_hasher`."""
        config = self.cache_config
        if not config.enable_prefix_caching:
            return None
        return get_request_block_hasher(config.block_size, get_hash_fn_by_name(config.prefix_caching_hash_algo),
                                        self.num_hash_lookahead_tokens, prompt_memo)

    def _init_spec_decode(self, speculative_config: Optional[SpeculativeConfig]) -> None:
        """Speculative decoding state (vLLM 0.33 sched:294-381, async_scheduler.py:14-17)."""
        self.speculative_config = speculative_config
        k = speculative_config.num_speculative_tokens if speculative_config else 0
        if speculative_config is not None:
            speculative_config.check(self.max_num_batched_tokens, self.async_scheduling)
        self.num_spec_tokens = k
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0
        self.spec_decode_step_blocks = spec_decode_step_blocks(
            k, self.num_lookahead_tokens,
            [m.block_size for m in self.kv_cache_manager.coordinator.single_type_managers])
        self._spec_token_placeholders = [-1] * k  # what AsyncScheduler gives each decoding request
        self._step_spec_tokens: dict[str, list[int]] = {}  # scheduled_spec_decode_tokens being built

    # -- requests in and out -----------------------------------------------------------------
    def check_servable(self, request: Request) -> None:
        """Reject a request that can never be served, instead of blocking the queue (docs/scheduler_behaviour.md §8.4).

        DEVIATION from vLLM: vLLM 0.33 admits such a request and its waiting queue then blocks
        forever (its input processor rejects only the empty and the too-long prompt); with
        `refuse_unservable` off (the replay of vLLM's recordings) the pool check is skipped, as in vLLM."""
        usable = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        if request.num_prompt_tokens == 0:
            raise UnservableRequestError("prompt", f"request {request.request_id} has an empty prompt")
        if request.num_prompt_tokens >= self.max_model_len:
            raise UnservableRequestError(
                "prompt", f"request {request.request_id} has {request.num_prompt_tokens} prompt tokens, "
                f"max_model_len is {self.max_model_len} (the prompt plus at least one output token must fit)")
        if not self.refuse_unservable:
            return
        longest = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        blocks = cdiv(longest, self.block_size)  # per group; a window group needs at most its cap
        need = sum(min(blocks, m.max_admission_blocks_per_request or blocks)
                   for m in self.kv_cache_manager.coordinator.single_type_managers)
        if need > usable:
            raise UnservableRequestError(
                "prompt", f"request {request.request_id} can grow to {longest} tokens "
                f"({request.num_prompt_tokens} prompt + up to {request.max_tokens} output), needing "
                f"{need} KV blocks, but the pool has only {usable} usable blocks "
                f"of {self.block_size} tokens ({usable * self.block_size} tokens)")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: duplicate request id {request.request_id!r}")
        self.check_servable(request)  # DEVIATION from vLLM: see check_servable
        if self.block_hasher is not None and request._block_hasher is None:
            request.set_block_hasher(self.block_hasher, self.block_size)
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        if self.connector is not None:
            self.connector.on_new_request(request)

    def finish_requests(self, request_ids: Optional[str | Iterable[str]],
                        finished_status: RequestStatus) -> list[Request]:
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status: {finished_status!r} is not a finished status")
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = (request_ids,)
        running_to_remove, waiting_to_remove, finished = set(), [], []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                running_to_remove.add(rid)
            else:
                waiting_to_remove.append(request)
                self.deferred_waiting.discard(rid)
            finished.append(request)
        if running_to_remove:
            self.running = [r for r in self.running if r.request_id not in running_to_remove]
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)
            if self.kv_holding_waiting:
                self.kv_holding_waiting.remove_requests(waiting_to_remove)
        for request in finished:
            delay_free = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # the load still lands in its blocks: free them when it is reported (sched:3014-3027)
                delay_free = request.request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request.request_id)
                self.failed_recving_kv_req_ids.discard(request.request_id)
            request.status = finished_status
            self._free_request(request, delay_free)
        return finished

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Optional[dict]:
        """Finish a request; a connector may keep its blocks for a transfer (delay free). Returns the
        connector's kv_transfer_params for the request's output."""
        kv_transfer_params = None
        if self.connector is not None:
            self._inflight_prefills.pop(request.request_id, None)
            delay, kv_transfer_params = self._connector_finished(request)
            delay_free_blocks |= delay
        self.finished_req_ids.add(request.request_id)
        if not delay_free_blocks:
            self._free_blocks(request)
        return kv_transfer_params

    # -- counters ----------------------------------------------------------------------------
    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting) + len(self.kv_holding_waiting)

    def shared_kv_tokens(self) -> int:
        """Tokens of the KV blocks several requests hold (`SchedulerOutput.shared_kv_tokens`: the cost model's
        attention reads them once per step, not once per row)."""
        return self.kv_cache_manager.block_pool.num_shared_refs * self.block_size

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.kv_holding_waiting)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        if self.finished_req_ids:
            return True
        # finished requests whose blocks a connector still holds stay in `requests` (sched:3157-3165)
        return self.connector is not None and len(self.requests) > self.get_num_unfinished_requests()

    def has_requests(self) -> bool:
        # (speed: called two or three times per engine step; the queues' truth values decide it without
        # the calls of has_unfinished_requests -> get_num_unfinished_requests; the rest only when all are empty)
        if self.running or self.waiting or self.kv_holding_waiting or self.finished_req_ids:
            return True
        return (self.has_finished_requests()
                or (self.connector is not None and self.connector.has_pending_push_work()))

    # -- schedule ----------------------------------------------------------------------------
    def _long_prefill_threshold(self) -> int:
        cfg = self.scheduler_config
        num_eligible = len(self.running) + len(self.waiting) + len(self.kv_holding_waiting)
        threshold = cfg.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold > 0 and cfg.long_prefill_token_threshold_adaptive:
            threshold = max(threshold, self.max_num_batched_tokens // num_eligible)
        return threshold

    def schedule(self) -> SchedulerOutput:
        self.current_step += 1
        kv = self.kv_cache_manager
        token_budget = self.max_num_scheduled_tokens
        input_budget = self.max_num_batched_tokens
        threshold = self._long_prefill_threshold()
        priority = self.policy == SchedulingPolicy.PRIORITY
        max_model_len = self.max_model_len
        block_size = self.block_size
        caching = kv.enable_caching
        # one full-attention group: a request whose blocks already hold the slots skips allocate_slots
        req_to_blocks = kv.req_to_blocks if kv.single_full_attention else {}
        num_cached_block = kv.num_cached_block
        lookahead = self.num_lookahead_tokens  # eagle / mtp draft KV slots (sched:914-918)
        scheduled_spec = self._step_spec_tokens = {}  # scheduled_spec_decode_tokens, filled below

        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_blocks: dict[str, Optional[Sequence[list]]] = {}
        num_scheduled_tokens: dict[str, int] = {}

        # Pass 1: running requests, in admission order.
        running = self.running
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            if input_budget <= 0:
                break
            computed = request.num_computed_tokens
            n = self._running_tokens(request, threshold, max_model_len)
            if n > token_budget:
                n = token_budget
            if n > input_budget:
                n = input_budget
            if n <= 0:
                req_index += 1
                continue

            rid = request.request_id
            blocks = req_to_blocks.get(rid)
            if blocks is not None and computed + n + lookahead <= len(blocks) * block_size:
                new_blocks: Optional[Sequence[list]] = []  # fast path: its blocks already hold these slots
                if caching and computed + n >= (num_cached_block.get(rid, 0) + 1) * block_size:
                    kv.cache_blocks(request, min(computed + n, request.num_tokens))
            else:
                while True:
                    new_blocks = kv.allocate_slots(request, n, num_lookahead_tokens=lookahead)
                    if new_blocks is not None:
                        break
                    if self.defer_block_free and not self._victim_blocks_can_be_freed(priority):
                        break  # a deferred free would not help this allocation (sched:940-942)
                    if priority:
                        victim = max(running, key=attrgetter("priority", "arrival_time"))
                        victim_index = running.index(victim)
                        del running[victim_index]
                        if victim_index < req_index:
                            req_index -= 1
                        victim_tokens = num_scheduled_tokens.pop(victim.request_id, None)
                        if victim_tokens is not None:  # un-schedule a victim scheduled earlier this step
                            scheduled_running_reqs.remove(victim)
                            req_to_new_blocks.pop(victim.request_id, None)
                            scheduled_spec.pop(victim.request_id, None)
                            token_budget += victim_tokens
                            input_budget += victim_tokens
                    else:
                        victim = running.pop()
                    self._preempt_request(victim)
                    preempted_reqs.append(victim)
                    if victim is request:
                        break
                if new_blocks is None:
                    if priority and request.status == RequestStatus.PREEMPTED:
                        continue
                    break
            scheduled_running_reqs.append(request)
            req_to_new_blocks[rid] = new_blocks
            num_scheduled_tokens[rid] = n
            token_budget -= n
            input_budget -= n
            req_index += 1
            if request.spec_token_ids:  # spec decode: the drafts the budget let through (sched:1010-1025)
                num_spec = n + computed - request.num_tokens - request.num_output_placeholders
                if num_spec > 0:
                    scheduled_spec[rid] = request.spec_token_ids[:num_spec]
                request.spec_token_ids = []  # the drafter proposes afresh after this step

        # Pass 2: waiting requests, only in a step without preemption.
        if not preempted_reqs:
            self._schedule_waiting(threshold, token_budget, input_budget, scheduled_new_reqs,
                                   scheduled_resumed_reqs, req_to_new_blocks, num_scheduled_tokens)

        return self._finalise(scheduled_new_reqs, scheduled_resumed_reqs, scheduled_running_reqs,
                              preempted_reqs, req_to_new_blocks, num_scheduled_tokens)

    @staticmethod
    def _running_tokens(request: Request, threshold: int, max_model_len: int) -> int:
        """Tokens the running pass gives `request` before the step budgets cap them (0: skipped)."""
        computed = request.num_computed_tokens
        placeholders = request.num_output_placeholders
        if placeholders and computed + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens:
            return 0
        n = request.num_tokens_with_spec + placeholders - computed
        if 0 < threshold < n:
            n = threshold
        return min(n, max_model_len - computed - 1)

    def _schedule_waiting(self, threshold: int, token_budget: int, input_budget: int,
                          scheduled_new_reqs: list[Request], scheduled_resumed_reqs: list[Request],
                          req_to_new_blocks: dict, num_scheduled_tokens: dict[str, int]) -> None:
        if not self.waiting and not self.kv_holding_waiting:
            return  # (speed: most steps have no one waiting; the loop below would stop at once)
        kv = self.kv_cache_manager
        connector = self.connector
        chunked = self.scheduler_config.enable_chunked_prefill
        reserve_full = self.scheduler_config.scheduler_reserve_full_isl
        # spec decode: which running requests this step's first pass scheduled (for the padding rule)
        running_scheduled = list(num_scheduled_tokens) if self.num_spec_tokens else ()
        skipped_holding: deque = deque()  # requests skipped this step go back to their queue's head
        skipped_waiting: deque = deque()
        while token_budget > 0:
            # requests holding KV blocks (remote loads) are drained before `waiting` (sched:1062-1066)
            waiting = self.kv_holding_waiting or self.waiting
            if not waiting or input_budget <= 0:
                break
            if len(self.running) >= self.max_num_active_reqs:
                break
            request = waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self._finish_remote_kv_wait(request):
                self._skip_waiting_request(waiting, skipped_holding, skipped_waiting)
                continue
            num_external, load_async, looked_up = 0, False, request.num_computed_tokens == 0
            if looked_up:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                if connector is not None:
                    matched = self._connector_matched_tokens(request, hit_blocks, num_hit)
                    if matched is None:  # the connector asks to be asked again later
                        self._skip_waiting_request(waiting, skipped_holding, skipped_waiting)
                        continue
                    hit_blocks, num_hit, num_external, load_async = matched
                num_computed = num_hit + num_external
            else:
                hit_blocks, num_hit, num_computed = None, 0, request.num_computed_tokens
            pad = False
            if load_async:
                n = 0  # an async load runs no forward pass yet
            else:
                n = request.num_tokens - num_computed
                request_budget = min(token_budget, input_budget)
                pad = n == 1 and self._pads_drafts(num_computed, running_scheduled)
                if pad:
                    if 1 + self.num_spec_tokens > request_budget:
                        break  # vLLM prefers not scheduling it to scheduling it unpadded
                    n = 1 + self.num_spec_tokens
                if 0 < threshold < n:
                    n = threshold
                if not chunked and n > request_budget:
                    break  # no skipping ahead: strict head-of-line
                n = min(n, request_budget)
                assert n > 0
            # an async load holds its blocks with no progress: it must leave what in-flight prefills
            # still need plus one spec-decode step of its own (all-or-nothing, sched:1421-1430); its
            # lookahead slots come once it runs (sched:1398-1403)
            reserved = self._inflight_prefill_reserved_blocks() + self.spec_decode_step_blocks if load_async else 0
            new_blocks = kv.allocate_slots(request, n, num_hit, hit_blocks,
                                           num_lookahead_tokens=0 if load_async else self.num_lookahead_tokens,
                                           full_sequence_must_fit=reserve_full,
                                           has_scheduled_reqs=bool(self.running),
                                           num_external_computed_tokens=num_external,
                                           delay_cache_blocks=load_async, reserved_blocks=reserved)
            if new_blocks is None:
                break  # the waiting pass never preempts
            if connector is not None:
                self._connector_after_alloc(request, num_external,
                                            request.num_tokens - num_hit if looked_up else 0)
            if looked_up:
                kv.record_prefix_cache_stats(request, num_hit)
            if load_async:  # park it, holding its blocks, until the load is reported (sched:1514-1545)
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = num_computed
                self._inflight_prefills[request.request_id] = request
                self._skip_waiting_request(waiting, skipped_holding, skipped_waiting)
                continue
            waiting.pop_request()
            self.deferred_waiting.discard(request.request_id)
            self.running.append(request)
            if request.status == RequestStatus.WAITING:
                scheduled_new_reqs.append(request)
            elif request.status == RequestStatus.PREEMPTED:
                scheduled_resumed_reqs.append(request)
            else:
                raise RuntimeError(f"Invalid request status: {request.status}")
            req_to_new_blocks[request.request_id] = kv.get_blocks(request.request_id)
            num_scheduled_tokens[request.request_id] = n
            token_budget -= n
            input_budget -= n
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            if pad:
                self._step_spec_tokens[request.request_id] = [-1] * self.num_spec_tokens
            if connector is not None and num_computed + n < request.num_tokens:
                self._inflight_prefills[request.request_id] = request
        if skipped_holding:
            self.kv_holding_waiting.prepend_requests(skipped_holding)
        if skipped_waiting:
            self.waiting.prepend_requests(skipped_waiting)

    def _pads_drafts(self, num_computed: int, running_scheduled: Sequence[str]) -> bool:
        """Whether a waiting request needing one token is padded to 1 + k tokens with -1 drafts (to keep
        the decode batch uniform for CUDA graphs; vLLM 0.33 sched:1308-1331): only when no running
        prefill chunk was scheduled this step, a running request was (or the request has a prefix
        hit), and the padded tokens plus the sampled one fit max_model_len."""
        k = self.num_spec_tokens
        if not k or not (running_scheduled or num_computed > 0):
            return False
        if any(self.requests[rid].is_prefill_chunk for rid in running_scheduled):
            return False
        return num_computed + 1 + k + 1 <= self.max_model_len

    def _finalise(self, scheduled_new_reqs, scheduled_resumed_reqs, scheduled_running_reqs,
                  preempted_reqs, req_to_new_blocks, num_scheduled_tokens) -> SchedulerOutput:
        """Build the `SchedulerOutput` (from the state before this step) and advance C optimistically
        (vLLM's `_update_after_schedule`): running, then new, then resumed requests; in async mode a
        sampling chunk gets an output placeholder."""
        nst = num_scheduled_tokens
        total = sum(nst.values())
        assert total <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs
        new_reqs_data = [
            NewRequestData(r.request_id, r.prompt_token_ids, r.sampling_params,
                           _block_ids(req_to_new_blocks[r.request_id]), r.num_computed_tokens)
            for r in scheduled_new_reqs
        ]
        async_sched = self.async_scheduling
        spec, drafting = self._step_spec_tokens, async_sched and self.num_spec_tokens > 0
        self._step_spec_tokens = {}
        before: dict[str, int] = {}
        cached = CachedRequestData()
        req_ids, new_block_ids = cached.req_ids, cached.new_block_ids
        computed_list, output_list = cached.num_computed_tokens, cached.num_output_tokens
        new_token_ids = cached.new_token_ids
        send_tokens = self.use_pp and not async_sched
        for r in scheduled_running_reqs:  # collect and advance in one pass (the hot loop)
            rid = r.request_id
            blocks = req_to_new_blocks[rid]
            computed = r.num_computed_tokens
            placeholders = r.num_output_placeholders
            req_ids.append(rid)
            new_block_ids.append(_block_ids(blocks) if blocks and any(blocks) else None)
            computed_list.append(computed)
            output_list.append(len(r._output_token_ids) + placeholders)
            n = nst[rid]
            if send_tokens:  # vLLM 0.33 v1/core/sched/scheduler.py:1945 (spec tokens are not in the list)
                new_token_ids.append(r.get_token_ids(computed, computed + n))
            before[rid] = computed
            r.num_computed_tokens = computed = computed + n
            r.num_in_flight_tokens += n
            r.is_prefill_chunk = is_chunk = computed < r.num_tokens + placeholders
            if async_sched and not is_chunk:
                r.num_output_placeholders = placeholders + 1
                if drafting:
                    self._add_async_draft_placeholders(r, spec)
        for r in scheduled_resumed_reqs:
            rid = r.request_id
            req_ids.append(rid)
            new_block_ids.append(_block_ids(req_to_new_blocks[rid]))
            computed_list.append(r.num_computed_tokens)
            output_list.append(len(r._output_token_ids))
            cached.resumed_req_ids.add(rid)
            cached.all_token_ids[rid] = r.get_token_ids(0, r.num_tokens)  # (a new list)
            if send_tokens:
                new_token_ids.append(r.get_token_ids(r.num_computed_tokens, r.num_computed_tokens + nst[rid]))
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=nst,  # insertion order = scheduling order
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.reset_preempted_req_ids,
            step=self.current_step - 1,
            scheduler_step=self.current_step - 1,
            num_computed_before=before,
            preempted_order=[r.request_id for r in preempted_reqs],
            shared_kv_tokens=self.shared_kv_tokens(),
            scheduled_spec_decode_tokens=spec,
        )
        for scheduled in (scheduled_new_reqs, scheduled_resumed_reqs):
            for request in scheduled:
                n = nst[request.request_id]
                computed = request.num_computed_tokens
                before[request.request_id] = computed
                request.num_computed_tokens = computed = computed + n
                request.num_in_flight_tokens += n
                request.is_prefill_chunk = is_chunk = (
                    computed < request.num_tokens + request.num_output_placeholders)
                if async_sched and not is_chunk:
                    request.num_output_placeholders += 1
                    if drafting:
                        self._add_async_draft_placeholders(request, spec)
        if self.connector is not None:  # the connector's metadata, fences (sched:1755-1781)
            self._finalise_connector(out)
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        return out

    def _add_async_draft_placeholders(self, request: Request, spec: dict[str, list[int]]) -> None:
        """AsyncScheduler (vLLM 0.33 async_scheduler.py:24-49): a decoding request gets one output
        placeholder per scheduled draft (on top of the sampled token's) and k placeholder drafts for
        the next step, as its real drafts only exist on the worker."""
        drafts = spec.get(request.request_id)
        if drafts:
            request.num_output_placeholders += len(drafts)
        request.spec_token_ids = self._spec_token_placeholders

    def _preempt_request(self, request: Request) -> None:
        assert request.status == RequestStatus.RUNNING, f"preempting a non-running request {request}"
        if self.connector is not None:
            self._inflight_prefills.pop(request.request_id, None)
            self._free_request_blocks(request)
        else:
            self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # preemption drops the drafts (sched:1823-1824)
        if self.connector is not None:  # (sched:1832-1834)
            request.drop_stale_output = self.connector.requires_kv_delivery or (
                request.drop_stale_output and request.num_stale_output_tokens > 0)
        request.num_stale_output_tokens += request.num_output_placeholders
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._num_preempted_since_stats += 1
        self.waiting.prepend_request(request)
        self.reset_preempted_req_ids.add(request.request_id)

    # -- update ------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stopped_running: list[Request] = []
        stopped_preempted: list[Request] = []
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        requests = self.requests
        max_model_len = self.max_model_len
        async_sched = self.async_scheduling
        kv = self.kv_cache_manager
        caching = kv.enable_caching
        num_cached_block = kv.num_cached_block
        block_size = self.block_size
        preempted_status = RequestStatus.PREEMPTED
        running_status = RequestStatus.RUNNING
        # spec decode: every row takes the general path (rejections, vLLM's post-update caching)
        spec_on = self.num_spec_tokens > 0
        spec_rows = scheduler_output.scheduled_spec_decode_tokens
        # (reset through a method: an assignment of None here would narrow the attribute to None for the
        # rest of this function in the compiled build, though _update_with_drafts sets it; speed: called
        # only when set, i.e. never without speculative decoding)
        if self.last_spec_decoding_stats is not None:
            self._reset_step_spec_stats()
        connector_active = self.connector is not None
        failed_kv_loads = (self._begin_connector_update(scheduler_output, model_runner_output.kv_connector_output)
                           if connector_active else ())
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.status > preempted_status:
                continue  # finished or aborted while the step was executing
            request.num_in_flight_tokens -= n
            if connector_active:
                if failed_kv_loads and rid in failed_kv_loads:
                    continue  # its KV load failed: rescheduled or failed below (sched:2318-2320)
                if request.drop_stale_output and request.num_stale_output_tokens:
                    # output of a step before its preemption, dropped (sched:2337-2339); it drains
                    # what that step put in (with drafts: 1 + m placeholders, as _update_with_drafts)
                    i = index.get(rid)
                    num_stale = (1 + len(spec_rows.get(rid) or ()) if spec_on
                                 else len(sampled[i]) if i is not None else 0)
                    request.num_stale_output_tokens -= min(request.num_stale_output_tokens, num_stale)
                    continue
            i = index.get(rid)
            generated = sampled[i] if i is not None else ()
            plp = prompt_logprobs.get(rid) if prompt_logprobs else None
            if not generated and plp is None:
                continue  # a non-final prefill chunk samples nothing
            stopped = False
            status_before = request.status
            new_token_ids = generated
            if generated:
                if len(generated) == 1 and not spec_on:  # the hot path: check_stop, async bookkeeping inlined
                    token = generated[0]
                    out_ids = request._output_token_ids
                    out_ids.append(token)
                    all_ids = request._all_token_ids
                    if all_ids is not None:  # (built once read: Request.all_token_ids)
                        all_ids.append(token)
                    num_tokens = request.num_prompt_tokens + len(out_ids)
                    if num_tokens >= request._next_hash_at:
                        request.hash_new_blocks()
                    sp = request.sampling_params
                    if (token == sp._eos_token_id or (sp.stop_token_ids and token in sp.stop_token_ids)
                            or num_tokens >= max_model_len or len(out_ids) >= request.max_tokens):
                        stopped = check_stop(request, max_model_len)
                    if async_sched:
                        if request.num_stale_output_tokens:
                            self._update_async_bookkeeping(request, 1, status_before)
                        else:
                            request.num_output_placeholders -= 1
                            # a request that stops here caches its last full block too, before it is
                            # freed (vLLM 0.33 v1/core/sched/scheduler.py:2406-2414: no stop check)
                            if caching and status_before == running_status:
                                known = request.num_computed_tokens - request.num_in_flight_tokens
                                if known >= (num_cached_block.get(rid, 0) + 1) * block_size:
                                    kv.cache_blocks(request, known)
                else:
                    new_token_ids, stopped = self._update_with_drafts(request, generated, spec_rows.get(rid))
            kv_transfer_params = None
            if stopped:
                kv_transfer_params = self._free_request(request)
                if (kv_transfer_params is not None and kv_transfer_params.get("do_remote_prefill")
                        and len(request._output_token_ids) == len(new_token_ids)):
                    # the prefill side's own hits, for the decode side's usage report; only on the
                    # request's first output, which carries its prefill stats (sched:2453-2487)
                    kv_transfer_params["remote_prefill_cached_tokens"] = max(request.num_cached_tokens, 0)
                if status_before == running_status:
                    stopped_running.append(request)
                else:
                    stopped_preempted.append(request)
            outputs.append(EngineCoreOutput(
                rid, new_token_ids if type(new_token_ids) is list else list(new_token_ids),
                request.get_finished_reason() if stopped else None,
                request.stop_reason,
                (logprobs[i][:len(new_token_ids)] if logprobs is not None and i is not None
                 and logprobs[i] is not None else None),
                plp,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
                kv_transfer_params))
        if stopped_running:
            if len(stopped_running) <= 4:  # (list.remove finds a request by identity, in C)
                for request in stopped_running:
                    self.running.remove(request)
            else:
                stopped_ids = set(map(id, stopped_running))
                self.running = [r for r in self.running if id(r) not in stopped_ids]
        if stopped_preempted:
            self.waiting.remove_requests(stopped_preempted)
            if self.kv_holding_waiting:
                self.kv_holding_waiting.remove_requests(stopped_preempted)
        if self.last_spec_decoding_stats is not None:
            if self._spec_stats_since_read is None:
                self._spec_stats_since_read = SpecDecodingStats.new(self.num_spec_tokens)
            self._spec_stats_since_read.merge(self.last_spec_decoding_stats)
        if connector_active:
            self._end_connector_update(model_runner_output.kv_connector_output, failed_kv_loads, outputs)
        return outputs

    def _update_with_drafts(self, request: Request, generated, drafts: Optional[list[int]]):
        """A row returning several tokens, or any row once speculative decoding is on (vLLM 0.33
        sched:2346-2420). `a + 1` tokens back for `m` drafts: `m - a` were rejected, and the optimistic
        `num_computed_tokens` (and, async, the placeholders) roll back by them; their blocks stay
        allocated. A stale output (sent before the request was preempted) delivers its tokens but
        leaves the reset counters alone."""
        stale = request.num_stale_output_tokens > 0
        if stale:  # drains what this output's step put in: 1 + m placeholders
            request.num_stale_output_tokens -= min(request.num_stale_output_tokens, 1 + len(drafts or ()))
        if drafts:
            num_accepted = len(generated) - 1
            num_rejected = len(drafts) - num_accepted
            if not stale:
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= num_rejected
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= num_rejected
            if self.log_stats:
                if self.last_spec_decoding_stats is None:
                    self.last_spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
                self.last_spec_decoding_stats.observe_draft(len(drafts), num_accepted)
        status_before = request.status
        had_placeholders = request.num_output_placeholders > 0
        new_token_ids, stopped = self._update_request_with_output(request, generated, self.max_model_len, stale)
        if not stale and had_placeholders:
            request.num_output_placeholders -= len(generated)  # trimmed tokens included (sched:2766-2769)
        kv = self.kv_cache_manager
        if (not stale and status_before == RequestStatus.RUNNING and kv.enable_caching
                and (had_placeholders or self.num_spec_tokens)):  # even when it stopped (sched:2404-2414)
            kv.cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)
        return new_token_ids, stopped

    def _reset_step_spec_stats(self) -> None:
        self.last_spec_decoding_stats = None

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """The drafter's proposals for the next step (vLLM 0.33 sched:2862-2881): dropped for a
        finished request and for one still in prefill."""
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            request.spec_token_ids = [] if request.is_prefill_chunk else list(drafts)

    def _update_async_bookkeeping(self, request: Request, num_generated: int,
                                  status_before: RequestStatus) -> None:
        """Returned tokens replace placeholders (or stale ones of a preempted request); only KV known
        to be written (computed minus in flight) is cached, also for a request that stopped on these
        tokens (vLLM 0.33 v1/core/sched/scheduler.py:2406-2414 checks the status before the stop)."""
        if request.num_stale_output_tokens:
            stale = min(request.num_stale_output_tokens, num_generated)
            request.num_stale_output_tokens -= stale
            num_generated -= stale
        request.num_output_placeholders -= num_generated
        kv = self.kv_cache_manager
        if kv.enable_caching and status_before == RequestStatus.RUNNING:
            known = request.num_computed_tokens - request.num_in_flight_tokens
            if known >= (kv.num_cached_block.get(request.request_id, 0) + 1) * self.block_size:
                kv.cache_blocks(request, known)

    @staticmethod
    def _update_request_with_output(request: Request, generated, max_model_len: int, is_stale: bool = False):
        """Append the tokens one by one; a stop or length cap drops the rest (sched:2744-2770)."""
        for k, token in enumerate(generated, start=1):
            request.append_output_token_ids(token)
            if check_stop(request, max_model_len):
                surplus = len(generated) - k
                if surplus and not is_stale:
                    request.num_computed_tokens -= surplus
                return generated[:k], True
        return generated, False

    # -- stats and maintenance ---------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            # (speed: get_request_counts()[1] without the call and its tuple, once per step)
            num_waiting_reqs=len(self.waiting) + len(self.kv_holding_waiting) - len(self.deferred_waiting),
            num_skipped_waiting_reqs=len(self.deferred_waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_stats=kv.make_prefix_cache_stats() or PrefixCacheStats(),
            num_preempted_reqs=self._num_preempted_since_stats,
            spec_decoding_stats=self._spec_stats_since_read,
        )
        self._num_preempted_since_stats = 0
        self._spec_stats_since_read = None
        if self.connector is not None:  # (speed: without a connector, one test per step)
            self._add_connector_stats(stats)
        return stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if reset_running_requests:
            while self.running:
                request = self.running.pop()
                self._preempt_request(request)
        ok = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not ok:
            raise RuntimeError("Failed to reset the prefix cache after preempting all running requests")
        return ok
