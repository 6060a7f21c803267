"""Implicit steady decodes: the simulator's exact shortcut for per-row work (O(events) per step).

The bookkeeping of `servetwin.sim.scheduler.SimScheduler`'s implicit members; not vLLM's behaviour.

A running request in steady decode (one token per step, no stop token it could sample, no forced
EOS) changes in a fully predictable way from step to step: C and the output grow by one. While such
a request - a *member* - has no event, the scheduler schedules it *implicitly*: it is counted in the
step's aggregates (`SchedulerOutput.implicit_decodes`: rows, sum and max of computed tokens) but not listed in
`num_scheduled_tokens`, not touched by `update_from_output`, and produces no `EngineCoreOutput`.

A member's next event is the first step at which the normal code could do anything but "+1 token":
it needs a new block, a block of it becomes full (prefix-cache registration), a sliding-window KV
cache group drops a block that fell out of its window (hybrid models such as gpt-oss: the freed block
goes back to the pool at that row's place in the step), or it reaches its length cap. Events are
computed when the request joins (conservatively: an event too early only costs speed). At a KV
event (a new block, a block registered, a block dropped) the member stays implicit: its
outputs so far are applied (the tokens from the executor's per-request token rule, so the block
hashes exist) and its row of the running pass does the KV work in running order with its implicit C,
then its next event is set (`advance`). At its terminal event (the last token, the length cap) - or
whenever anything else needs its exact state - a member is *materialised*: the deferred steps are
applied at once (C, in-flight counters, tokens, block hashes) and the request takes the normal path
(and may join again after its row's KV work, `try_join`). Its tokens reach the trace then, as
`LateTokens` (`TraceRecorder.on_late_tokens` stamps each with its step's end).

Budget and KV checks at the start of every step guarantee that the normal code would schedule every
member one token without clipping or preemption; when they fail, every member is materialised first
and the step runs the normal code. So decisions, block ids and times equal the step-by-step run
(tests/sim/test_sim_lazy_decode.py checks traces for equality with Hypothesis). Only the simulator
turns this on (`Simulation(lazy_decode=True)`, when per-request step rows are not recorded): the rows
of `step_requests` and the per-token outputs of a front end need every row listed.

Step indices here are the scheduler's own (`SchedulerOutput.scheduler_step`). In async scheduling the
output of a member's last implicit step is still pending when it is materialised: its token is
produced then and applied by the next `update_from_output`, in running order (`pending_update`) -
unless the request joins again in the same step: then that output stays implicit too (the member's
outputs start a step before its schedule effects, `out_from = first_step - 1`), since applying it
would only append the token (it cannot stop the request, complete a block or register one).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from servetwin.core.request import Request, RequestStatus
from servetwin.core.sched.output import ImplicitDecodes
from servetwin.core.testbed.trace import LateTokens


class LazyTokenSource(Protocol):
    """The executor side: which requests may go implicit and the tokens they sample meanwhile."""

    def lazy_eligible(self, request: Request) -> bool: ...

    def lazy_tokens(self, request_id: str, n: int) -> list[int]: ...


@dataclass(slots=True)
class _Member:
    request: Request
    first_step: int  # its first implicit step
    offset: int  # C at the first implicit step minus that step: C(step) = offset + step
    event: int  # its next event: a KV event (handled in place) or `terminal`
    terminal: int  # first step at which it must be materialised (last token, length cap)
    seq: int
    out_from: int  # its first step whose output is not applied (first_step, or one less)
    carry: list[int]  # tokens already drawn from the source for steps out_from.. (at most one)
    flush_from: int  # its first step whose token the trace has not been told of (<= out_from)


class LazyDecodes:
    def __init__(self, source: LazyTokenSource, block_size: int, max_model_len: int,
                 async_scheduling: bool, caching: bool, sliding_windows: tuple[int, ...] = ()) -> None:
        """`sliding_windows`: the window W of each sliding-window KV cache group (their out-of-window
        blocks are freed as a member decodes: events too)."""
        self.source = source
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.caching = caching
        self.sliding_windows = tuple(sorted(set(sliding_windows)))
        # tokens in flight when a steady decode row is scheduled (its last step's, in async): a window
        # drops blocks on the tokens processed, C minus these (KVCacheManager.allocate_slots)
        self.num_in_flight = 1 if async_scheduling else 0
        self.members: dict[str, _Member] = {}
        self.nonmembers: dict[str, Request] = {}  # running requests that are not members (valid with members)
        self.sum_offset = 0
        # event step -> members with that event (stale entries - the member left, or its event moved -
        # are skipped): steps are integers visited in order, so buckets replace a heap (no log n, no
        # tuple comparisons per event)
        self._events: dict[int, list[_Member]] = {}
        self._due_from: Optional[int] = None  # the first step `due` has not visited
        self._offsets: list[tuple[int, int, str]] = []  # (-offset, seq, request id): the max C
        # (terminal, seq, request id): the first terminal event (speed: `in_place_run` at every window plan
        # read it from every member)
        self._terminals: list[tuple[int, int, str]] = []
        self._seq = 0
        self.flushed: list[LateTokens] = []
        # async: request id -> (request, token of its pending step), made by `materialise`
        self.pending_update: dict[str, tuple[Request, int]] = {}
        self._eligible: dict[str, bool] = {}  # the source's verdict per running request

    # -- joining -----------------------------------------------------------------------------------
    def try_join(self, r: Request, step: int, kv_blocks: int, num_cached_blocks: int) -> bool:
        """Make `r` a member from `step` on if it is a steady decode (one token per step, nothing in
        flight but its last step's output) whose first event is at least a step away."""
        if r.status != RequestStatus.RUNNING or r.num_stale_output_tokens or not r.num_output_tokens:
            return False  # (a one-token last prefill chunk looks like a decode but is a context row)
        c = r.num_computed_tokens
        n_tok = r.num_tokens
        if self.async_scheduling:
            if c != n_tok or r.num_output_placeholders != 1 or r.num_in_flight_tokens != 1:
                return False
        elif c != n_tok - 1 or r.num_output_placeholders or r.num_in_flight_tokens:
            return False
        rid = r.request_id
        ok = self._eligible.get(rid)
        if ok is None:
            ok = self._eligible[rid] = self.source.lazy_eligible(r)
        if not ok:
            return False
        terminal = min(r.max_tokens - r.num_output_tokens - 1,  # the last token
                       self.max_model_len - 2 - c)  # the length cap
        offset = min(self._kv_offset(c, kv_blocks, num_cached_blocks), terminal)
        if offset < 1:
            return False
        pending = self.pending_update.pop(rid, None) if self.pending_update else None
        if pending is None:
            self.join(r, step, step + offset, step + terminal)
        else:  # materialised this step: its pending output stays implicit (undo what it set up)
            r.num_in_flight_tokens -= 1
            r.num_output_placeholders -= 1
            self.join(r, step, step + offset, step + terminal, out_from=step - 1, carry=[pending[1]])
        return True

    def _kv_offset(self, c: int, kv_blocks: int, num_cached_blocks: int) -> int:
        """Steps from now (C = c, holding `kv_blocks`, `num_cached_blocks` registered) to the
        request's next KV event."""
        bs = self.block_size
        offset = kv_blocks * bs - c  # the step that needs a new block
        if self.caching:
            # A block becomes full (after the row's KV work every block full of known tokens is
            # registered: c // bs <= num_cached_blocks). In async scheduling, when it is the last
            # block held, the allocation of the next block (a step later) registers it: nothing
            # happens for it in between (its update still lacks the KV written by the step in
            # flight), so that allocation is its event.
            if not (self.async_scheduling and kv_blocks == num_cached_blocks + 1):
                full = (num_cached_blocks + 1) * bs - 1 - c
                if full < offset:
                    offset = full
        # A window group frees a block: the row's KV work at C = c (on the c - num_in_flight tokens
        # processed) dropped the blocks wholly before c - num_in_flight - W + 1; the next one goes
        # when that point crosses the next block boundary (SlidingWindowManager.remove_skipped_blocks).
        known = c - self.num_in_flight
        for w in self.sliding_windows:
            dropped = max(0, known - w + 1) // bs
            free = (dropped + 1) * bs + w - 1 - known
            if free < offset:
                offset = free
        return offset

    def advance(self, m: _Member, step: int, kv_blocks: int, num_cached_blocks: int) -> bool:
        """After the member's KV event at `step` (done in place): set its next event, or False when
        it cannot stay implicit past this step (the caller then materialises it)."""
        event = min(step + self._kv_offset(m.offset + step, kv_blocks, num_cached_blocks), m.terminal)
        if event <= step:
            return False
        m.event = event
        self._schedule_event(m)
        return True

    def apply_outputs(self, m: _Member, last_updated: int) -> None:
        """Apply the member's outputs up to step `last_updated` (its tokens and block hashes) and
        keep it implicit."""
        n = last_updated + 1 - m.out_from
        if n <= 0:
            return
        r = m.request
        rid = r.request_id
        tokens = self.source.lazy_tokens(rid, n - len(m.carry))
        if m.carry:
            tokens = m.carry + tokens
            m.carry = []
        r.append_output_token_ids(tokens)  # (the trace hears of these tokens at materialisation)
        m.out_from = last_updated + 1

    def forget(self, request_id: str) -> None:
        """`request_id` left the running list."""
        self.nonmembers.pop(request_id, None)
        self._eligible.pop(request_id, None)

    def join(self, r: Request, step: int, event: int, terminal: int, out_from: Optional[int] = None,
             carry: Optional[list[int]] = None) -> None:
        self._seq += 1
        offset = r.num_computed_tokens - step
        out_from = step if out_from is None else out_from
        m = _Member(r, step, offset, event, terminal, self._seq, out_from, carry or [], out_from)
        self.members[r.request_id] = m
        self.sum_offset += offset
        self._schedule_event(m)
        heapq.heappush(self._offsets, (-offset, m.seq, r.request_id))
        heapq.heappush(self._terminals, (terminal, m.seq, r.request_id))
        if len(self._offsets) > 4 * len(self.members) + 1024:  # drop the entries of past members
            self._offsets = [(-m.offset, m.seq, rid) for rid, m in self.members.items()]
            heapq.heapify(self._offsets)
            self._terminals = [(m.terminal, m.seq, rid) for rid, m in self.members.items()]
            heapq.heapify(self._terminals)

    # -- leaving -----------------------------------------------------------------------------------
    def _schedule_event(self, m: _Member) -> None:
        bucket = self._events.get(m.event)
        if bucket is None:
            self._events[m.event] = [m]
        else:
            bucket.append(m)

    def due(self, step: int) -> list[_Member]:
        """Members whose event is at or before `step`, in no particular order (`step` never decreases;
        every event is scheduled after the step it is set in)."""
        out = self._due(step, self._events.pop)
        self._due_from = step + 1
        return out

    def visit_due(self, step: int) -> None:
        """`due(step)` whose members the caller has from `peek_due(step)` (nothing changed since): the steps up
        to `step` visited, as `due` visits them, without its list (speed: a member KV event done in place)."""
        events = self._events
        k = step if self._due_from is None else self._due_from
        while k <= step:
            events.pop(k, None)
            k += 1
        self._due_from = step + 1

    def peek_due(self, step: int) -> list[_Member]:
        """The members `due(step)` returns, in its order, without visiting the steps (changes nothing)."""
        return self._due(step, self._events.get)

    def _due(self, step: int, bucket_of: Callable[[int, Any], Any]) -> list[_Member]:
        """The due members of the steps not visited up to `step`, each step's bucket read with `bucket_of`
        (`pop`: visited, `get`: left)."""
        out: list[_Member] = []
        members = self.members
        k = step if self._due_from is None else self._due_from
        while k <= step:
            bucket = bucket_of(k, None)
            if bucket is not None:
                out += [m for m in bucket if m.event == k and members.get(m.request.request_id) is m]
            k += 1
        return out

    def materialise(self, m: _Member, next_step: int, last_updated: int) -> Request:
        """Apply the member's deferred steps: schedule effects of steps [first_step, next_step),
        output effects of steps [out_from, last_updated]; an async member's pending output is queued."""
        r = m.request
        rid = r.request_id
        del self.members[rid]
        self.sum_offset -= m.offset
        n_owed = next_step - m.out_from  # outputs of steps out_from .. next_step - 1
        n_out = max(0, min(n_owed, last_updated + 1 - m.out_from))
        pending = n_owed - n_out
        r.num_computed_tokens += next_step - m.first_step
        tokens = self.source.lazy_tokens(rid, n_owed - len(m.carry))
        if m.carry:
            tokens = m.carry + tokens
        if pending:
            r.num_in_flight_tokens += pending
            r.num_output_placeholders += pending
            self.pending_update[rid] = (r, tokens.pop())
        if n_out:
            r.append_output_token_ids(tokens)
        n_told = m.out_from + n_out - m.flush_from  # applied in place before, and now
        if n_told:
            self.flushed.append(LateTokens(rid, m.flush_from, n_told))
        return r

    def max_offset(self) -> int:
        """max over members of C(step) - step (for the step's largest KV length)."""
        return -self._live_top(self._offsets)

    def _live_top(self, heap: list[tuple[int, int, str]]) -> int:
        """The value of the heap's first entry (value, seq, request id) that is a member's own (the entries of
        members gone, or of an earlier membership of the request, popped on the way); a member must exist."""
        members = self.members
        while True:
            value, seq, rid = heap[0]
            m = members.get(rid)
            if m is not None and m.seq == seq:
                return value
            heapq.heappop(heap)

    def step_aggregates(self, step: int) -> Optional[ImplicitDecodes]:
        k = len(self.members)
        if not k:
            return None
        return ImplicitDecodes(k, self.sum_offset + k * step, self.max_offset() + step)

    def members_only(self) -> bool:
        """Whether every running request is a member and nothing was materialised since the last step."""
        return bool(self.members) and not self.nonmembers and not self.pending_update and not self.flushed

    def quiet_step(self, step: int) -> Optional[ImplicitDecodes]:
        """The aggregates of `step` when it can only run the members implicitly - `members_only()`, no
        member event due at it (`due(step)` would return nothing) - and then `due(step)` is done; None
        (nothing changed) otherwise. The caller checks the rest of the scheduler's state
        (`SimScheduler.quiet_step`)."""
        if not self.members_only() or self._due_from != step or step in self._events:
            return None
        self._due_from = step + 1
        k = len(self.members)
        return ImplicitDecodes(k, self.sum_offset + k * step, self.max_offset() + step)

    def quiet_run(self, step: int, limit: int) -> int:
        """How many steps from `step` on (at most `limit`) `quiet_step` would take one after the other:
        `members_only()`, `step` next for `due`, and no event bucket at any of them (a stale one counts, as
        in `quiet_step`). Changes nothing."""
        if not self.members_only() or self._due_from != step:
            return 0
        events = self._events
        n = 0
        while n < limit and step + n not in events:
            n += 1
        return n

    def in_place_run(self, step: int, limit: int) -> int:
        """How many steps from `step` on (at most `limit`) keep every member implicit if each member KV event
        in them is done in place and succeeds (`advance`): `members_only()`, `step` next for `due`, and
        before every member's terminal event. The caller checks that the KV work succeeds
        (`SimScheduler.quiet_run`). Changes nothing."""
        if not self.members_only() or self._due_from != step:
            return 0
        n = self._live_top(self._terminals) - step  # (the members' first terminal event; `members_only`: one is)
        return max(0, n if n < limit else limit)

    def next_event_step(self) -> Optional[int]:
        """The first step from the next one on with an event bucket (a stale one counts; None: none)."""
        events = self._events
        if not events:
            return None
        start = self._due_from
        first = min(events)  # (speed: no list; a step before `start` - none seen - takes the filter below)
        if start is None or first >= start:
            return first
        return min((k for k in events if k >= start), default=None)

    def skip_quiet(self, step: int, n: int) -> None:
        """`quiet_step` of steps step .. step + n - 1, which `quiet_run` found quiet (nothing changed since)."""
        if self._due_from != step:
            raise AssertionError(f"implicit decodes: quiet steps from {step}, but the next step is {self._due_from}")
        self._due_from = step + n

    def take_flushed(self) -> list[LateTokens]:
        out, self.flushed = self.flushed, []
        return out


__all__ = ["LazyDecodes", "LazyTokenSource"]
