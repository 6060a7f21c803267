"""`SimScheduler`: the core `Scheduler` plus the simulator's two exact shortcuts, off by default.

Neither is vLLM's behaviour; both leave every decision, block id, token and step time equal to the
core scheduler's step-by-step run (tests/sim/test_sim_lazy_decode.py, test_sim_fast_forward.py and
test_sim_scheduler_fast_forward.py check it with Hypothesis). They do not overlap: each removes a
different cost.

- Implicit steady decodes (`enable_lazy_decode`, bookkeeping in `servetwin.sim.lazy_decode`) remove
  the per-row cost: a request in steady decode is scheduled in aggregate (`SchedulerOutput.
  implicit_decodes`) instead of listed, until its next event. Works in sync and async scheduling,
  under any load, with full-attention and sliding-window KV cache groups (a window's free is an
  event; with several groups every listed row goes through `allocate_slots` as in the core);
  needs an executor whose tokens depend on the request alone and a trace without per-request step
  rows. On bench_h100_llama8b (async) it makes the simulator about 7x faster.
- Decode fast-forward (`steady_decode_steps` + `fast_forward_decode`, driven by
  `servetwin.sim.fast_forward`) removes the per-step cost: k steps of an all-decode batch in one go.
  Sync scheduling only, when nothing waits and nothing arrives in the window (small offline batches,
  the tail of a run); there about 5x, with per-request step rows too.

The subclass overrides only public methods of `Scheduler` and builds its running pass from the
protected interface documented on `Scheduler`; the core scheduler knows nothing of it. It is paired
with `SimExecutor` (`SimExecutor.scheduler_cls`), the only executor that executes implicit rows.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Sequence

from servetwin.core.kv_cache.kv_cache_interface import FULL_ATTENTION, SLIDING_WINDOW
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.kv_cache.single_type_kv_cache_manager import SlidingWindowManager
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.outputs import EngineCoreOutput, ModelRunnerOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.output import ImplicitDecodes, SchedulerOutput
from servetwin.core.sched.spec_decode import SpeculativeConfig
from servetwin.core.prompt_memo import PromptMemo
from servetwin.core.sched.scheduler import Scheduler
from servetwin.core.testbed.trace import LateTokens
from servetwin.sim.lazy_decode import LazyDecodes, LazyTokenSource


_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerOutput))
_DROP, _ALLOCATE, _CACHE = 0, 1, 2  # a decode window's KV work per row and step, in the core's order


def _with_rows(so: SchedulerOutput, num_scheduled_tokens: dict[str, int]) -> SchedulerOutput:
    """A copy of `so` listing these rows (`dataclasses.replace` without its per-call introspection)."""
    kwargs = {name: getattr(so, name) for name in _OUTPUT_FIELDS}
    kwargs["num_scheduled_tokens"] = num_scheduled_tokens
    return SchedulerOutput(**kwargs)


def _most_steps_within(k: int, blocks_needed: Callable[[int], int], free: int) -> int:
    """The largest number of steps up to k whose new blocks (`blocks_needed(steps)`, non-decreasing)
    fit in `free`."""
    if blocks_needed(k) <= free:
        return k
    lo, hi = 0, k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_needed(mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SimScheduler(Scheduler):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 log_stats: bool = True, speculative_config: Optional[SpeculativeConfig] = None,
                 kv_transfer_config: Optional[KVTransferConfig] = None) -> None:
        super().__init__(scheduler_config, cache_config, log_stats, speculative_config, kv_transfer_config)
        self.lazy: Optional[LazyDecodes] = None  # implicit steady decodes, off until enabled
        self.last_updated_step = -1  # scheduler step of the last output processed
        self.running_order: dict[str, int] = {}  # request id -> stamp of its (re)admission (lazy only)
        self._admissions = 0
        self._group_managers: list = []  # every KV cache group's manager when there are several (lazy only)
        self._window_managers: list = []  # the sliding-window ones among them
        self._scheduled_ahead: Optional[SchedulerOutput] = None  # `quiet_step`'s output with rows, for `schedule`
        self._quiet_finished: set[str] = set()  # the finished ids a `quiet_step` handed over (`take_quiet_finished`)
        # (speed: a prompt sent again - the same list, as the simulator's workloads send it - hashes its full
        # blocks once per engine: servetwin.core.prompt_memo; kept for this engine's run only)
        self.block_hasher = self.make_block_hasher(PromptMemo())

    def share_prompt_memo(self, memo: PromptMemo) -> None:
        """Keep the prompts' block hashes in `memo`, shared with other engines of the same simulation (a
        cluster's): a prompt's full blocks' hashes are a pure function of its tokens, the block size and the
        hash function (the memo's tag), so an engine finds those another engine computed. Before any request."""
        # (speed: a prompt list sent to several engines - round robin sends each of the ladder's 750 prompts to
        # all 16 - is hashed once per simulation, not once per engine)
        self.block_hasher = self.make_block_hasher(memo)

    # -- implicit steady decodes: public entry points -------------------------------------------------
    def lazy_decode_supported(self) -> bool:
        """Whether implicit decodes handle this model's KV cache groups: full-attention and
        sliding-window groups (a window's out-of-window frees are member events); not chunked local
        attention."""
        return all(g.type in (FULL_ATTENTION, SLIDING_WINDOW) for g in self.kv_cache_manager.kv_cache_groups)

    def enable_lazy_decode(self, source: LazyTokenSource) -> None:
        """Schedule steady decodes implicitly (exact; `source` gives the tokens they sample)."""
        if not self.lazy_decode_supported():
            raise ValueError("kv_cache_groups: implicit decodes need full-attention or sliding-window "
                             "KV cache groups")
        kv = self.kv_cache_manager
        windows = tuple(g.sliding_window for g in kv.kv_cache_groups if g.type == SLIDING_WINDOW)
        self.lazy = LazyDecodes(source, self.block_size, self.max_model_len, self.async_scheduling,
                                kv.enable_caching, windows)
        # several groups: every row goes through allocate_slots as in the core's running pass (the
        # windows free blocks every few steps), and KV demand is summed over the groups
        self._group_managers = [] if kv.single_full_attention else kv.coordinator.single_type_managers
        self._window_managers = [g for g in self._group_managers if isinstance(g, SlidingWindowManager)]
        self.running_order = {}
        for r in self.running:
            self._stamp(r)

    def take_late_tokens(self) -> list[LateTokens]:
        """The tokens of implicit steps applied since the last call (for the trace)."""
        lazy = self.lazy
        return lazy.take_flushed() if lazy is not None and lazy.flushed else []

    def flush_lazy(self) -> list[LateTokens]:
        """Materialise every member (between steps); returns every late-token record not yet taken."""
        if self.lazy is None:
            return []
        self._materialise_all()
        return self.lazy.take_flushed()

    def quiet_step(self) -> Optional[ImplicitDecodes]:
        """Schedule the next step at once when its batch can only be the implicit members' (the fused step
        of `servetwin.sim.engine.Simulation`): every running request a member, nobody waiting, nothing
        preempted since the last step, no drafts, no KV connector, no prefix-cache lookup or preemption
        since the last stats - so that `make_stats()` would change nothing. Returns the step's aggregates
        (its `ImplicitDecodes`) when the step lists no row: no member event due (then nothing changes but
        the step counter), or only KV events done in place (`_in_place_step`); the requests finished since
        the last step are handed over with it, as its `SchedulerOutput.finished_req_ids` would be
        (`take_quiet_finished`). None: not such a step - nothing changed, or the step was scheduled in full
        (`schedule()`) and listed rows after all, and the next `schedule()` returns that output (the
        finished ids in it)."""
        lazy = self.lazy
        if lazy is None or not self._members_alone(finished_ok=True):
            return None
        implicit = lazy.quiet_step(self.current_step)
        if implicit is not None:
            self.current_step += 1
        elif not lazy.members_only():
            return None
        elif self._in_place_step():  # member KV events done in place
            implicit = lazy.step_aggregates(self.current_step - 1)
        else:
            so = self.schedule()  # the normal path
            if (so.num_scheduled_tokens or so.scheduled_new_reqs or so.preempted_order or so.implicit_decodes is None
                    or lazy.pending_update or lazy.flushed):
                self._scheduled_ahead = so
                return None
            self._hand_over_finished(so.finished_req_ids)
            return so.implicit_decodes
        if self.finished_req_ids:  # (speed: the step after a finish fused too, as `_finalise` hands them over)
            self._hand_over_finished(self.finished_req_ids)
            self.finished_req_ids = set()
        return implicit

    def _hand_over_finished(self, finished: set[str]) -> None:
        if not finished:
            return
        if self._quiet_finished:
            self._quiet_finished |= finished
        else:
            self._quiet_finished = finished

    def take_quiet_finished(self) -> set[str]:
        """The requests finished before the steps `quiet_step` took since the last call, which it handed over
        (the runner forgets them, as with a scheduled step's `finished_req_ids`)."""
        finished = self._quiet_finished
        if finished:
            self._quiet_finished = set()
        return finished

    def _members_alone(self, finished_ok: bool = False) -> bool:
        """Whether the next step's batch can only be the implicit members' (what `quiet_step` needs besides
        the members' events): nobody waiting, nothing finished (unless `finished_ok`) or preempted, no
        drafts, no connector, no prefix-cache lookup or preemption since the last stats, the members within
        the token budget."""
        lazy = self.lazy
        if (self.waiting or self.kv_holding_waiting or self.deferred_waiting
                or (self.finished_req_ids and not finished_ok)
                or self.reset_preempted_req_ids or self._step_spec_tokens or self._num_preempted_since_stats
                or self._spec_stats_since_read is not None or self.connector is not None
                or self._scheduled_ahead is not None
                or len(lazy.members) > min(self.max_num_scheduled_tokens, self.max_num_batched_tokens)):
            return False
        pcs = self.kv_cache_manager.prefix_cache_stats
        # (make_stats would hand these counts to the step's row)
        return pcs is None or not (pcs.requests or pcs.preempted_requests or pcs.reset)

    def quiet_run(self, limit: int) -> Optional[tuple[int, int, int, int]]:
        """How the next steps go if nothing reaches the scheduler meanwhile (a step window of
        `servetwin.sim.engine.Simulation`): (n, members, sum of offsets, max offset) when each of the next
        n steps (1 <= n <= limit) is certain to be a `quiet_step` - then step `current_step + i` has the
        aggregates ImplicitDecodes(members, sum + members x step, max + step) and the same shared KV
        tokens, and changes nothing but the step counters and, at member KV events done in place, the KV
        pool (the members, their offsets, the running list and the waiting queue stay as they are); None:
        not even the next one. Changes nothing."""
        lazy = self.lazy
        if lazy is None or not self._members_alone():
            return None
        step = self.current_step
        n = self._in_place_run(step, limit)
        if n < limit:  # (what is left: the steps before the first member event)
            n = max(n, lazy.quiet_run(step, limit))
        if not n:
            return None
        return n, len(lazy.members), lazy.sum_offset, lazy.max_offset()

    def _in_place_run(self, step: int, limit: int) -> int:
        """How many of the next steps (at most `limit`) are certain to stay quiet through their member KV
        events: before every member's terminal event (`LazyDecodes.in_place_run`); every allocation
        fits - each member needs at most cdiv(n, block_size) new blocks per KV cache group in n steps
        (it holds the blocks of its C already), all of them within the pool's free blocks now (windows'
        frees only add to them), so `_schedule_lazy`'s KV check passes at each; and the shared KV tokens
        stay - a block held by several requests is freed only by a sliding window's drop, so a member
        holding one in a window group takes no event in the run. (Its KV event's `advance` always finds
        the next one ahead: the KV work leaves the member a block ahead of C, its full blocks
        registered, its window's drops done.)"""
        lazy = self.lazy
        n = lazy.in_place_run(step, limit)
        if not n:
            return 0
        kv = self.kv_cache_manager
        pool = kv.block_pool
        per_block = len(lazy.members) * (len(self._group_managers) or 1)
        n = min(n, self.block_size * (pool.free_block_queue.num_free_blocks // per_block))
        if n and pool.num_shared_refs and self._window_managers:
            for rid, m in lazy.members.items():
                if m.event - step < n and self._holds_shared_window_block(rid):
                    n = m.event - step
        return n

    def _holds_shared_window_block(self, rid: str) -> bool:
        """Whether a sliding-window group's block table of `rid` holds a block other requests hold too (the
        blocks a drop could free: those after its last null block)."""
        for g in self._window_managers:
            for b in reversed(g.req_to_blocks.get(rid) or ()):
                if b.is_null:
                    break
                if b.ref_cnt > 1:
                    return True
        return False

    def quiet_steps(self, n: int, lag: int) -> tuple[list[int], list[float]]:
        """Take the next n steps as `quiet_step` would, after `quiet_run` found them quiet and nothing reached
        the scheduler since: the step counters move, and the member KV events among them are done in place
        (`_in_place_step`, with the outputs processed up to `lag` steps back: 1 in sync, 2 in
        async scheduling, as the fused step has them). Returns the KV pool's free blocks and usage after
        each step's scheduling. Raises if a step is not quiet after all (`quiet_run` promised it)."""
        lazy = self.lazy
        kv = self.kv_cache_manager
        free: list[int] = []
        usage: list[float] = []
        checked = False  # (speed: `_members_alone` checked after the last step with KV events; nothing since)
        while n:
            step = self.current_step
            run = lazy.quiet_run(step, n)
            if run:
                lazy.skip_quiet(step, run)
                self.current_step += run
                if free:  # (speed: the pool as after the last step with KV events: no step since changed it)
                    free += [free[-1]] * run
                    usage += [usage[-1]] * run
                else:
                    free += [kv.num_free_blocks] * run
                    usage += [kv.usage] * run
                n -= run
                if not n:
                    break
            self.last_updated_step = self.current_step - lag
            if not ((checked or self._members_alone()) and lazy.members_only() and self._in_place_step()):
                raise AssertionError(f"step window: scheduler step {self.current_step} has member events that "
                                     "did not stay in place")
            free.append(kv.num_free_blocks)
            usage.append(kv.usage)
            n -= 1
            if n and not self._members_alone():  # (the step-by-step run checks it before each step)
                raise AssertionError(f"step window: scheduler step {self.current_step - 1}'s KV events changed "
                                     "what the next step's batch may be")
            checked = True
        return free, usage

    def _in_place_step(self) -> bool:
        """Schedule the next step, whose batch is the members' alone (`_members_alone`, `members_only`), when
        every due member's event is a KV event that fits (its terminal one: not) - without `schedule()`:
        the same state changes as its `_schedule_lazy` pass (the fit check, then in running order each
        due member's outputs applied, its KV work, its next event), whose `SchedulerOutput` would list no
        row and change nothing (no waiting pass: nobody waits; `_finalise` of no row resets the preempted set
        and the spec tokens, both empty, and hands the finished set over, which `quiet_step` does). (speed:
        `quiet_step` and a window's commit, `quiet_steps`, take most steps with KV events this way.) False: not such a step, nothing changed.
        Raises if a member's event does not leave it implicit (its KV work always does: `advance` finds
        the next event ahead, `_in_place_run`)."""
        lazy = self.lazy
        step = self.current_step
        in_place = {}
        for m in lazy.peek_due(step):
            if m.event >= m.terminal:
                return False  # (its last token or length cap: the normal path)
            in_place[m.request.request_id] = m
        rows = list(in_place.values())
        if len(rows) > 1:  # (speed: no sort for the one member of most such steps)
            order = self.running_order
            rows.sort(key=lambda m: order[m.request.request_id])
        if not self._rows_fit([(m.request, 1) for m in rows], in_place, step, 0):
            return False
        lazy.visit_due(step)  # (`due(step)`: the members of `peek_due`)
        self.current_step += 1
        last_updated = self.last_updated_step
        for m in rows:  # (`_schedule_lazy`'s running pass for a member row)
            request = m.request
            lazy.apply_outputs(m, last_updated)
            self._row_kv_work(request, 1, m.offset + step, True)
            if not lazy.advance(m, step, *self._held_blocks(request.request_id)):
                raise AssertionError(f"implicit decodes: {request.request_id} is not implicit after its KV event at "
                                     f"scheduler step {step}")
        return True

    def _rows_fit(self, rows: list[tuple[Request, int]], in_place: dict, step: int, blocks_needed: int) -> bool:
        """Whether the KV work of the step's rows (`in_place`: the members among them, a token each) fits in the
        free blocks: the eager rows need `blocks_needed`, a member one more when C fills the blocks it holds."""
        if self._group_managers:  # (then blocks_needed counts group 0 only: this check is the whole one)
            return not rows or self._group_rows_fit(rows, in_place, step)  # (no row: nothing to allocate)
        kv = self.kv_cache_manager
        req_to_blocks, block_size = kv.req_to_blocks, self.block_size
        for rid, m in in_place.items():
            if m.offset + step >= len(req_to_blocks[rid]) * block_size:
                blocks_needed += 1
        return blocks_needed <= kv.block_pool.free_block_queue.num_free_blocks

    def _row_kv_work(self, request: Request, n: int, computed: int, member: bool) -> Optional[Sequence[list]]:
        """The KV work of a running row of n tokens from `computed` (a member's: its implicit C), once the fit
        check passed: the core's `allocate_slots`, or its cheaper equivalents - the blocks held suffice (a full
        block registered), new blocks for a row already holding some. Returns its new blocks."""
        kv = self.kv_cache_manager
        rid = request.request_id
        if self._group_managers:  # the core's call for every row (vLLM 0.33 sched: allocate_slots per running request)
            if member:
                return kv.allocate_running_slots(request, n, computed, self.lazy.num_in_flight)
            new_blocks = kv.allocate_slots(request, n)
        else:
            blocks = kv.req_to_blocks.get(rid)
            block_size = self.block_size
            if blocks is not None and computed + n <= len(blocks) * block_size:
                if kv.enable_caching and computed + n >= (kv.num_cached_block.get(rid, 0) + 1) * block_size:
                    kv.cache_blocks(request, min(computed + n, request.num_tokens))
                return []
            if blocks is not None:  # the fit check guarantees these blocks are free
                return kv.allocate_running_slots(request, n, computed)
            new_blocks = kv.allocate_slots(request, n)
        if new_blocks is None:
            raise AssertionError(f"implicit decodes: allocation for {rid} failed after the KV check")
        return new_blocks

    # -- the overridden public methods ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        lazy = self.lazy
        if lazy is None:
            return super().schedule()
        ahead = self._scheduled_ahead
        if ahead is not None:  # scheduled by `quiet_step`, which found rows in it
            self._scheduled_ahead = None
            return ahead
        so = self._schedule_lazy()
        if so is None:
            so = super().schedule()
        num_admitted = len(so.scheduled_new_reqs) + len(so.scheduled_cached_reqs.resumed_req_ids)
        if num_admitted:  # the waiting pass appends the admitted requests to `running`, in order
            nonmembers = lazy.nonmembers
            for r in self.running[len(self.running) - num_admitted:]:
                self._stamp(r)
                nonmembers[r.request_id] = r
        return so

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        lazy = self.lazy
        if lazy is not None and lazy.pending_update:
            scheduler_output, model_runner_output = self._with_pending_outputs(
                scheduler_output, model_runner_output, lazy)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.last_updated_step = scheduler_output.scheduler_step
        if lazy is not None:
            for out in outputs:
                if out.finish_reason is not None:
                    self._forget(out.request_id)
        return outputs

    def finish_requests(self, request_ids: Optional[str | Iterable[str]],
                        finished_status: RequestStatus) -> list[Request]:
        lazy = self.lazy
        if lazy is None:
            return super().finish_requests(request_ids, finished_status)
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = (request_ids,)
        else:
            request_ids = list(request_ids)
        if RequestStatus.is_finished(finished_status):  # (else the core raises, with nothing changed)
            for rid in request_ids:
                m = lazy.members.get(rid)
                if m is not None:  # its exact state first, then the normal path
                    lazy.nonmembers[rid] = lazy.materialise(m, self.current_step, self.last_updated_step)
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:
            self._forget(request.request_id)
        return finished

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if reset_running_requests and self.lazy is not None:
            self._materialise_all()
        return super().reset_prefix_cache(reset_running_requests)

    # -- implicit steady decodes: the step ---------------------------------------------------------
    def _stamp(self, request: Request) -> None:
        self._admissions += 1
        self.running_order[request.request_id] = self._admissions

    def _forget(self, request_id: str) -> None:
        self.lazy.forget(request_id)
        self.running_order.pop(request_id, None)

    def _materialise_all(self) -> None:
        lazy = self.lazy
        for m in list(lazy.members.values()):
            lazy.nonmembers[m.request.request_id] = lazy.materialise(m, self.current_step, self.last_updated_step)

    def _with_pending_outputs(self, so: SchedulerOutput, mro: ModelRunnerOutput,
                              lazy: LazyDecodes) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """This output plus the members materialised since it was scheduled (async: their token of
        this step is still to be applied): one row each, in running order like a normal step's rows."""
        pending = {rid: token for rid, (_, token) in lazy.pending_update.items()}
        lazy.pending_update = {}
        order = self.running_order

        def running_order(item: tuple[str, int]) -> int:
            return order.get(item[0], -1)
        items = sorted([*so.num_scheduled_tokens.items(), *((rid, 1) for rid in pending)], key=running_order)
        req_ids = [*mro.req_ids, *pending]
        index = dict(mro.req_id_to_index)
        base = len(mro.req_ids)
        for i, rid in enumerate(pending):
            index[rid] = base + i
        sampled = [*mro.sampled_token_ids, *([token] for token in pending.values())]
        logprobs = None if mro.logprobs is None else [*mro.logprobs, *([None] * len(pending))]
        merged = ModelRunnerOutput(req_ids, index, sampled, logprobs, mro.prompt_logprobs_dict, mro.timing)
        return _with_rows(so, dict(items)), merged

    def _schedule_lazy(self) -> Optional[SchedulerOutput]:
        """A step with implicit members, or None (after materialising them all) when the core
        scheduler could clip or preempt someone this step (the caller then runs it)."""
        lazy = self.lazy
        step = self.current_step
        last_updated = self.last_updated_step
        in_place = {}  # request id -> member with a KV event this step (its row does the KV work)
        for m in lazy.due(step):
            if m.event < m.terminal:
                in_place[m.request.request_id] = m
            else:  # the last token or the length cap: the normal path
                r = lazy.materialise(m, step, last_updated)
                lazy.nonmembers[r.request_id] = r
        if not lazy.members:
            lazy.nonmembers = {r.request_id: r for r in self.running}
        k = len(lazy.members)
        threshold = self._long_prefill_threshold()
        order = self.running_order
        if lazy.nonmembers:
            eager = sorted(lazy.nonmembers.values(), key=lambda r: order[r.request_id])
            rows, demand, blocks_needed = self._running_demand(eager, threshold)
        else:  # (speed: most cluster steps list no row - every running request is a member)
            rows, demand, blocks_needed = [], 0, 0
        if in_place:  # one token each, counted in k
            rows += [(m.request, 1) for m in in_place.values()]
            rows.sort(key=lambda row: order[row[0].request_id])
        if k + demand > min(self.max_num_scheduled_tokens, self.max_num_batched_tokens) or \
                not self._rows_fit(rows, in_place, step, blocks_needed):
            self._materialise_all()  # their late tokens stay queued for the trace
            return None

        self.current_step += 1
        token_budget = self.max_num_scheduled_tokens - k
        input_budget = self.max_num_batched_tokens - k
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        req_to_new_blocks: dict[str, Optional[Sequence[list]]] = {}
        num_scheduled_tokens: dict[str, int] = {}
        # The core running pass over the non-members, in running order. The checks above guarantee
        # no budget clips anyone and every allocation succeeds (so there is no preemption). A decode
        # row whose KV work (a new block, a block registered) was its only event goes implicit for
        # this very step once that work is done.
        for request, n in rows:
            rid = request.request_id
            m = in_place.get(rid) if in_place else None
            if m is None:
                computed = request.num_computed_tokens
            else:  # its tokens (and so its block hashes) up to date, its C implicit
                lazy.apply_outputs(m, last_updated)
                computed = m.offset + step
            new_blocks = self._row_kv_work(request, n, computed, m is not None)
            if m is not None:  # its token is in k already
                if lazy.advance(m, step, *self._held_blocks(rid)):
                    continue
                lazy.materialise(m, step, last_updated)  # listed after all
                lazy.nonmembers[rid] = request
            else:
                token_budget -= n
                input_budget -= n
                if n == 1 and lazy.try_join(request, step, *self._held_blocks(rid)):
                    del lazy.nonmembers[rid]
                    continue
            scheduled_running_reqs.append(request)
            req_to_new_blocks[rid] = new_blocks
            num_scheduled_tokens[rid] = n
        self._schedule_waiting(threshold, token_budget, input_budget, scheduled_new_reqs,
                               scheduled_resumed_reqs, req_to_new_blocks, num_scheduled_tokens)
        implicit = lazy.step_aggregates(step)
        so = self._finalise(scheduled_new_reqs, scheduled_resumed_reqs, scheduled_running_reqs, [],
                            req_to_new_blocks, num_scheduled_tokens)
        if implicit is not None:
            so.total_num_scheduled_tokens += implicit.num_reqs
            so.implicit_decodes = implicit
        return so

    def _held_blocks(self, rid: str) -> tuple[int, int]:
        """(block table length, blocks through `cache_blocks`) of a running request: the smallest
        over the KV cache groups (they move together; the smallest gives the earliest event)."""
        groups = self._group_managers
        if not groups:
            kv = self.kv_cache_manager
            return len(kv.req_to_blocks[rid]), kv.num_cached_block.get(rid, 0)
        held = cached = -1  # (speed: one loop, no generators; called for every member KV event)
        for g in groups:
            n = len(g.req_to_blocks[rid])
            c = g.num_cached_block.get(rid, 0)
            if held < 0 or n < held:
                held = n
            if cached < 0 or c < cached:
                cached = c
        return held, cached

    def _running_demand(self, requests: list[Request],
                        threshold: int) -> tuple[list[tuple[Request, int]], int, int]:
        """The rows `(request, tokens)` the running pass would schedule with unlimited budget, their
        tokens and the new KV blocks they need."""
        rows = []
        tokens = blocks = 0
        bs = self.block_size
        req_to_blocks = self.kv_cache_manager.req_to_blocks
        for r in requests:
            n = self._running_tokens(r, threshold, self.max_model_len)
            if n > 0:
                rows.append((r, n))
                tokens += n
                held = req_to_blocks.get(r.request_id)
                blocks += max(0, cdiv(r.num_computed_tokens + n, bs) - (len(held) if held else 0))
        return rows, tokens, blocks

    def _group_rows_fit(self, rows: list[tuple[Request, int]], in_place: dict, step: int) -> bool:
        """Several KV cache groups: whether every row's allocation succeeds in the running pass, row by
        row in running order as the core checks it - each row's window frees first (the blocks
        `remove_skipped_blocks` will return to the pool: those no other request holds), then its new
        blocks in every group against the free count."""
        free = self.kv_cache_manager.block_pool.free_block_queue.num_free_blocks
        # (speed: the window frees looked for only when the new blocks alone do not fit)
        return (self._rows_fit_without_frees(rows, in_place, step, free)
                or self._group_rows_fit_by_row(rows, in_place, step, free))

    def _group_rows_fit_by_row(self, rows: list[tuple[Request, int]], in_place: dict, step: int, free: int) -> bool:
        """`_group_rows_fit` with `free` blocks free: row by row, each row's window frees counted."""
        kv = self.kv_cache_manager
        bs = self.block_size
        max_model_len = self.max_model_len
        null = kv.block_pool.null_block
        lazy = self.lazy
        for request, n in rows:
            rid = request.request_id
            m = in_place.get(rid) if in_place else None
            if m is None:
                computed, in_flight = request.num_computed_tokens, request.num_in_flight_tokens
            else:
                computed, in_flight = m.offset + step, lazy.num_in_flight
            need_blocks = cdiv(min(computed + n, max_model_len), bs)
            for g in self._group_managers:
                blocks = g.req_to_blocks.get(rid) or ()
                skipped = g.get_num_skipped_tokens(computed - in_flight) // bs
                i = min(skipped, len(blocks)) - 1
                while i >= 0 and blocks[i] is not null:  # (SingleTypeKVCacheManager.remove_skipped_blocks)
                    if blocks[i].ref_cnt == 1:  # (a shared block stays taken: not counted, to be sure)
                        free += 1
                    i -= 1
                free -= max(0, need_blocks - len(blocks))
            if free < 0:
                return False
        return True

    def _rows_fit_without_frees(self, rows: list[tuple[Request, int]], in_place: dict, step: int, free: int) -> bool:
        """Several KV cache groups: whether every row's new blocks in every group fit in `free` blocks with no
        window frees counted - then `_group_rows_fit`'s row-by-row check passes (the frees only add to the
        count it compares), so it need not find the frees. (speed: the check of a member KV event done in
        place, one row, its window's blocks not walked)"""
        bs = self.block_size
        max_model_len = self.max_model_len
        for request, n in rows:
            rid = request.request_id
            m = in_place.get(rid) if in_place else None
            computed = request.num_computed_tokens if m is None else m.offset + step
            need_blocks = cdiv(min(computed + n, max_model_len), bs)
            for g in self._group_managers:
                blocks = g.req_to_blocks.get(rid)
                new = need_blocks - (len(blocks) if blocks else 0)
                if new > 0:
                    free -= new
                    if free < 0:
                        return False
        return True

    # -- decode fast-forward (servetwin.sim.fast_forward) -----------------------------------------
    def steady_decode_steps(self, limit: int) -> int:
        """How many of the next steps (at most `limit`) are certain to schedule exactly one token for
        every running request, in running order, with no admission, preemption, allocation failure or
        length-capped finish. 0 when the state is not a steady decode (sync scheduling only, and not
        while implicit decodes are on).

        EOS and stop tokens depend on the sampled tokens: ruling them out is the caller's job.
        Sliding-window KV cache groups: their frees are replayed in step order too, and the window
        stops before a step that would free a block another request shares (the step cost reads the
        pool's shared references, which the caller takes as constant over the window).
        """
        running = self.running
        if (limit <= 0 or self.async_scheduling or self.waiting or not running or self.finished_req_ids
                or self.reset_preempted_req_ids or self.lazy is not None
                or not self.lazy_decode_supported()):
            return 0
        if not self.kv_cache_manager.single_full_attention:
            return self._steady_group_steps(limit)
        num = len(running)
        if num > self.max_num_scheduled_tokens or num > self.max_num_batched_tokens:
            return 0
        kv = self.kv_cache_manager
        bs = self.block_size
        caching = kv.enable_caching
        k = limit
        for r in running:
            n_tok = r.num_tokens
            computed = r.num_computed_tokens
            if n_tok - computed != 1 or r.num_output_placeholders or not r.num_output_tokens:
                return 0  # not a decode (a 1-token last prefill chunk is a context request)
            if caching and kv.num_cached_block.get(r.request_id, 0) < min(computed, len(r.block_hashes) * bs) // bs:
                return 0  # registration lags: let a normal step catch it up
            remaining = min(r.max_tokens - r.num_output_tokens, self.max_model_len - n_tok)
            if remaining - 1 < k:
                k = remaining - 1
                if k <= 0:
                    return 0
        free = kv.num_free_blocks
        req_to_blocks = kv.req_to_blocks

        def blocks_needed(steps: int) -> int:
            return sum(max(0, cdiv(r.num_computed_tokens + steps, bs) - len(req_to_blocks[r.request_id]))
                       for r in running)

        return _most_steps_within(k, blocks_needed, free)

    def _steady_group_steps(self, limit: int) -> int:
        """`steady_decode_steps` with several KV cache groups (full attention and sliding windows)."""
        running = self.running
        num = len(running)
        if num > self.max_num_scheduled_tokens or num > self.max_num_batched_tokens:
            return 0
        kv = self.kv_cache_manager
        bs = self.block_size
        caching = kv.enable_caching
        groups = kv.coordinator.single_type_managers
        null = kv.block_pool.null_block
        k = limit
        for r in running:
            rid = r.request_id
            n_tok = r.num_tokens
            computed = r.num_computed_tokens
            if n_tok - computed != 1 or r.num_output_placeholders or not r.num_output_tokens:
                return 0  # not a decode (a 1-token last prefill chunk is a context request)
            registered = min(computed, len(r.block_hashes) * bs) // bs
            if caching and any(g.num_cached_block.get(rid, 0) < registered for g in groups):
                return 0  # registration lags: let a normal step catch it up
            remaining = min(r.max_tokens - r.num_output_tokens, self.max_model_len - n_tok)
            k = min(k, remaining - 1)
            for g in groups:  # the first step at which a window frees a shared block
                if g.kv_cache_spec.type != SLIDING_WINDOW:
                    continue
                w = g.kv_cache_spec.sliding_window
                for i, b in enumerate(g.req_to_blocks[rid]):
                    if b is not null and b.ref_cnt > 1:  # freed once C - W + 1 passes block i
                        k = min(k, max(0, (i + 1) * bs + w - 1 - computed))
            if k <= 0:
                return 0
        free = kv.num_free_blocks

        def blocks_needed(steps: int) -> int:  # (the windows' frees not counted: enough blocks anyway)
            return sum(max(0, cdiv(r.num_computed_tokens + steps, bs) - len(g.req_to_blocks[r.request_id]))
                       for r in running for g in groups)

        return _most_steps_within(k, blocks_needed, free)

    def _window_events(self, k: int, block_tables: list[dict], windows: tuple[int, ...]
                       ) -> tuple[list[tuple[int, int, int]], list[int]]:
        """The KV work of k steady decode steps of the running requests: `(window step, row, kind)`
        sorted (step, then running order, then drop / allocate / cache: the order of the core's
        `allocate_slots` per row), each at most once, and each row's C before the window.
        `block_tables`: each KV cache group's request -> blocks; `windows`: the sliding-window
        groups' W. A row allocates in a group when C fills its blocks, drops when C - W + 1 reaches
        a block boundary (and at step 0: whatever an earlier step left), registers when a block
        fills (prefix caching)."""
        bs = self.block_size
        caching = self.kv_cache_manager.enable_caching
        events: set[tuple[int, int, int]] = set()
        starts = []
        for row, r in enumerate(self.running):
            c0 = r.num_computed_tokens
            starts.append(c0)
            rid = r.request_id
            for table in block_tables:
                events.update((j, row, _ALLOCATE) for j in range(len(table[rid]) * bs - c0, k, bs))
            if windows:
                events.add((0, row, _DROP))
            for w in windows:
                events.update((j, row, _DROP) for j in range((w - 1 - c0) % bs, k, bs))
            if caching:
                events.update((j, row, _CACHE) for j in range((bs - (c0 + 1) % bs) % bs, k, bs))
        return sorted(events), starts

    def fast_forward_decode(self, k: int, tokens: list[list[int]]) -> list[int]:
        """Apply `k` steady decode steps at once (see `steady_decode_steps`); `tokens[i]` are the k
        tokens sampled for `running[i]`. Block allocation and prefix-cache registration happen in the
        exact step-by-step order (step, then running order), so the state equals k normal steps.
        Returns the number of free blocks after each step's scheduling."""
        if not self.kv_cache_manager.single_full_attention:
            return self._fast_forward_groups(k, tokens)
        kv = self.kv_cache_manager
        running = self.running
        req_to_blocks = kv.req_to_blocks
        events, starts = self._window_events(k, [req_to_blocks], ())
        for r, toks in zip(running, tokens):
            r.append_output_token_ids(toks)
        allocs = [0] * k
        pool = kv.block_pool
        for j, row, kind in events:
            r = running[row]
            if kind == _ALLOCATE:
                req_to_blocks[r.request_id].extend(pool.get_new_blocks(1))
                allocs[j] += 1
            else:
                kv.cache_blocks(r, starts[row] + j + 1)
        for r, c0 in zip(running, starts):
            r.num_computed_tokens = c0 + k
        self.current_step += k
        free = pool.get_num_free_blocks() + sum(allocs)
        out = []
        for a in allocs:
            free -= a
            out.append(free)
        return out

    def _fast_forward_groups(self, k: int, tokens: list[list[int]]) -> list[int]:
        """`fast_forward_decode` with several KV cache groups: each row's step does what the core's
        `allocate_slots` does, in its order - the windows drop the blocks out of their window, every
        group allocates, every group caches - at the steps where any of it can do something (a call
        that has nothing to do changes nothing)."""
        kv = self.kv_cache_manager
        coord = kv.coordinator
        running = self.running
        windows = tuple(g.kv_cache_spec.sliding_window for g in coord.single_type_managers
                        if g.kv_cache_spec.type == SLIDING_WINDOW)
        events, starts = self._window_events(k, [g.req_to_blocks for g in coord.single_type_managers], windows)
        for r, toks in zip(running, tokens):
            r.append_output_token_ids(toks)
        pool = kv.block_pool
        out: list[int] = []
        for j, row, kind in events:
            while len(out) < j:  # steps before j are complete
                out.append(pool.get_num_free_blocks())
            r = running[row]
            c = starts[row] + j
            if kind == _DROP:
                coord.remove_skipped_blocks(r.request_id, c)  # (sync: nothing in flight)
            elif kind == _ALLOCATE:
                coord.allocate_new_blocks(r.request_id, min(c + 1, self.max_model_len))
            else:
                coord.cache_blocks(r, c + 1)
        while len(out) < k:
            out.append(pool.get_num_free_blocks())
        for r, c0 in zip(running, starts):
            r.num_computed_tokens = c0 + k
        self.current_step += k
        return out


__all__ = ["SimScheduler"]
