"""Hypothesis stateful tests: random configs and random add / abort / step sequences through
`EngineCore` + `FakeExecutor`, with the scheduler and block-pool invariants checked after every
operation (docs/scheduler_behaviour.md §2.4, §4.9, §4.10, §8), a final drain, and a determinism re-run of the same operations."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.executor import FakeExecutor
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams

from coretest_utils import GID, check_block_accounting

# two fixed token sequences over a small alphabet: prompts are a prefix of one of them plus a short
# random suffix, so requests share prefixes (and prefix-cache blocks) often, for every block size
BASES = [[(i * 7 + 3) % 5 for i in range(64)], [(i * 3 + 1) % 4 for i in range(64)]]
DRAIN_LIMIT = 4000


@dataclass(frozen=True)
class Cfg:
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked: bool
    caching: bool
    policy: str
    async_scheduling: bool
    threshold: int
    adaptive: bool
    max_num_active_seqs: Optional[int]
    reserve_full_isl: bool

    def build(self) -> EngineCore:
        sc = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=self.chunked,
            long_prefill_token_threshold=self.threshold,
            long_prefill_token_threshold_adaptive=self.adaptive, policy=self.policy,
            async_scheduling=self.async_scheduling, max_num_active_seqs=self.max_num_active_seqs,
            scheduler_reserve_full_isl=self.reserve_full_isl)
        cc = CacheConfig(block_size=self.block_size, num_gpu_blocks=self.num_blocks,
                         enable_prefix_caching=self.caching)
        return EngineCore(sc, cc, FakeExecutor())


@st.composite
def configs(draw) -> Cfg:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    usable_tokens = draw(st.integers(16, 128))
    num_blocks = cdiv(usable_tokens, block_size) + 1
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 6))
    max_model_len = draw(st.integers(12, 96))
    if chunked:
        budget = draw(st.integers(max_num_seqs, 64))
    else:  # SchedulerConfig requires max_num_batched_tokens >= max_model_len without chunking
        budget = draw(st.integers(max(max_num_seqs, max_model_len), max_model_len + 32))
    threshold = draw(st.one_of(st.just(0), st.integers(1, max_model_len)))
    active = draw(st.one_of(st.none(), st.integers(1, max_num_seqs)))
    return Cfg(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=budget, max_model_len=max_model_len, chunked=chunked,
               caching=draw(st.booleans()), policy=draw(st.sampled_from(["fcfs", "priority"])),
               async_scheduling=draw(st.booleans()), threshold=threshold, adaptive=draw(st.booleans()),
               max_num_active_seqs=active, reserve_full_isl=draw(st.booleans() | st.just(True)))


request_specs = st.fixed_dictionaries({
    "base": st.integers(0, 1),
    "prefix": st.integers(0, 36),
    "suffix": st.lists(st.integers(0, 3), max_size=6),
    "max_tokens": st.integers(1, 8),
    "priority": st.integers(0, 3),
    "stop": st.one_of(st.none(), st.integers(10, 40)),
})


class Harness:
    """Runs operations on one engine, records a trace, checks per-step properties."""

    def __init__(self, cfg: Cfg) -> None:
        self.cfg = cfg
        self.engine = cfg.build()
        self.sched = self.engine.scheduler
        self.trace: list = []
        self.accepted: set[str] = set()
        self.rejected: set[str] = set()
        self.finished: dict[str, object] = {}
        self.reqs: dict[str, Request] = {}
        self.emitted: dict[str, list[int]] = {}
        self.counter = 0
        self.broken = False

    # -- operations -----------------------------------------------------------------------
    def add(self, spec: dict) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        prompt = BASES[spec["base"]][: spec["prefix"]] + list(spec["suffix"])
        if not prompt:
            prompt = [0]
        sp = SamplingParams(max_tokens=spec["max_tokens"],
                            stop_token_ids=[spec["stop"]] if spec["stop"] is not None else None)
        req = Request(rid, prompt, sp, arrival_time=float(self.counter), priority=spec["priority"])
        try:
            self.engine.add_request(req)
        except ValueError:
            self.rejected.add(rid)
            event("request rejected as unservable")
            self.trace.append(("rejected", rid))
            return
        self.accepted.add(rid)
        self.reqs[rid] = req
        self.emitted[rid] = []
        self.trace.append(("add", rid))

    def abort(self, rid: str) -> None:
        done = self.engine.abort_requests([rid])
        for r in done:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.request_id not in self.finished
            self.finished[r.request_id] = "abort"
        self.trace.append(("abort", rid, [r.request_id for r in done]))

    def step(self) -> None:
        try:
            self._step()
        except BaseException:
            self.broken = True
            raise

    def _step(self) -> None:
        pre_running = list(self.sched.running)
        pre_waiting = list(self.sched.waiting)
        pre_n = {r.request_id: r.num_tokens + r.num_output_placeholders for r in pre_running}
        pre_n.update({r.request_id: r.num_tokens for r in pre_waiting})
        res = self.engine.step()
        so = res.scheduled
        rec: list = ["step"]
        if so is not None:
            self._check_scheduler_output(so)
            self._check_order(so, pre_running, pre_waiting, pre_n, res.stats.num_free_blocks)
            rec += [list(so.num_scheduled_tokens.items()),
                    [(n.req_id, n.num_computed_tokens, list(n.block_ids[0])) for n in so.scheduled_new_reqs],
                    sorted(so.scheduled_cached_reqs.resumed_req_ids), list(so.preempted_order)]
        for o in res.outputs:
            rec.append((o.request_id, list(o.new_token_ids), o.finish_reason, o.stop_reason))
            self.emitted[o.request_id].extend(o.new_token_ids)
            req = self.reqs[o.request_id]
            assert self.emitted[o.request_id] == req.output_token_ids  # nothing lost or duplicated
            assert req.num_output_tokens <= req.max_tokens
            assert req.num_tokens <= self.cfg.max_model_len
            if o.finish_reason is not None:
                self._check_finish(req, o)
                assert o.request_id not in self.finished, f"{o.request_id} finished twice"
                self.finished[o.request_id] = o.finish_reason
                event(f"finish reason {o.finish_reason!s}")
        self.trace.append(tuple(map(repr, rec)))

    def drain(self) -> None:
        for _ in range(DRAIN_LIMIT):
            if not self.engine.has_work():
                break
            self.step()
            self.check()
        else:
            raise AssertionError(f"no quiescence after {DRAIN_LIMIT} steps: "
                                 f"running={[r.request_id for r in self.sched.running]} "
                                 f"waiting={[r.request_id for r in self.sched.waiting]}")
        for res in self.engine.drain():
            for o in res.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
        self.check()

    # -- checks ---------------------------------------------------------------------------
    def _check_finish(self, req: Request, o) -> None:
        last = req.output_token_ids[-1]
        stops = req.sampling_params.stop_token_ids
        if str(o.finish_reason) == "stop":
            assert last in stops and o.stop_reason == last
        else:
            assert str(o.finish_reason) == "length"
            assert last not in stops
            assert req.num_output_tokens == req.max_tokens or req.num_tokens == self.cfg.max_model_len
        assert not any(t in stops for t in req.output_token_ids[:-1])

    def _check_scheduler_output(self, so) -> None:
        cfg, B = self.cfg, self.cfg.block_size
        nst = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(nst.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert all(n > 0 for n in nst.values())
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        if so.preempted_order:  # no admission in a step that preempted
            event("step with preemption")
            assert not so.scheduled_new_reqs and not resumed
        assert len(set(so.preempted_order)) == len(so.preempted_order)
        for rid in so.preempted_order:
            assert rid not in nst
        for n in so.scheduled_new_reqs:
            hit, N = n.num_computed_tokens, len(n.prompt_token_ids)
            assert hit % B == 0 and hit <= N - 1
            if hit:
                event("prefix hit at admission")
            if not cfg.caching:
                assert hit == 0
            assert len(n.block_ids) == 1  # one KV cache group
            assert len(n.block_ids[0]) == cdiv(min(hit + nst[n.req_id], cfg.max_model_len), B)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in resumed:
                hit = cached.num_computed_tokens[i]
                assert hit % B == 0 and hit <= len(cached.all_token_ids[rid]) - 1
                event("resumed request" + (" with prefix hit" if hit else ""))
                if not cfg.caching:
                    assert hit == 0
        for rid in nst:
            req = self.sched.requests.get(rid)  # (gone if it finished in this step's update)
            if req is not None:
                assert req.num_computed_tokens <= cfg.max_model_len - 1

    def _check_order(self, so, pre_running: list[Request], pre_waiting: list[Request],
                     pre_n: dict[str, int], free_after_schedule: int) -> None:
        """Victims, scheduling order and admission order follow the policy (docs/scheduler_behaviour.md §2.2, §2.3, §2.5)."""
        victims = list(so.preempted_order)
        if self.cfg.policy == "fcfs":
            # victims are taken from the tail of `running`
            assert victims == [r.request_id for r in reversed(pre_running)][: len(victims)]
            if victims and not self.cfg.async_scheduling:
                # ... and go to the waiting front keeping their admission order
                assert [r.request_id for r in self.sched.waiting][: len(victims)] == victims[::-1]
        else:
            pool = list(pre_running)
            for v in victims:
                expected = max(pool, key=lambda r: (r.priority, r.arrival_time))
                assert v == expected.request_id
                pool.remove(expected)
        order = list(so.num_scheduled_tokens)
        pre_ids = [r.request_id for r in pre_running]
        k = sum(1 for rid in order if rid in pre_ids)
        running_part, admitted = order[:k], order[k:]
        assert all(rid in pre_ids for rid in running_part)
        assert running_part == [rid for rid in pre_ids if rid in running_part]  # running-list order
        # admissions come from the head of the waiting queue, in queue order
        assert admitted == [r.request_id for r in pre_waiting][: len(admitted)]
        new_ids = [n.req_id for n in so.scheduled_new_reqs]
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        assert sorted(new_ids + list(resumed)) == sorted(admitted)
        for rid in new_ids:
            assert self.reqs[rid].num_preemptions == 0
        for rid in resumed:
            assert self.reqs[rid].num_preemptions > 0
        # exact token counts (docs/scheduler_behaviour.md §2.2, §2.3), re-derived from the pre-step state
        cfg = self.cfg
        eligible = len(pre_running) + len(pre_waiting)
        T = cfg.threshold if eligible > 1 else 0
        if T and cfg.adaptive:
            T = max(T, cfg.max_num_batched_tokens // eligible)
        nst = so.num_scheduled_tokens
        if T:
            assert all(n <= T for n in nst.values())
        if cfg.policy == "priority" and victims:
            return  # un-scheduling a victim restores budget consumed before later requests were sized
        budget = cfg.max_num_batched_tokens
        for rid in running_part:
            before = so.num_computed_before[rid]
            want = pre_n[rid] - before
            if T:
                want = min(want, T)
            want = min(want, budget, cfg.max_model_len - 1 - before)
            assert nst[rid] == want, (rid, nst[rid], want)
            budget -= want
        for rid in admitted:
            hit = so.num_computed_before[rid]
            want = pre_n[rid] - hit
            if T:
                want = min(want, T)
            if not cfg.chunked:
                assert want <= budget  # a prompt that does not fit ends admission (head-of-line)
            want = min(want, budget)
            assert nst[rid] == want, (rid, nst[rid], want)
            budget -= want
        # the waiting head was left behind only for a reason (docs/scheduler_behaviour.md §2.3): budget, admission cap,
        # head-of-line without chunking, or not enough free blocks for its (full) sequence
        if len(pre_waiting) > len(admitted) and not victims:
            head = pre_waiting[len(admitted)]
            if head.request_id not in self.sched.requests or budget <= 0:
                return
            if len(pre_running) + len(admitted) >= (cfg.max_num_active_seqs or cfg.max_num_seqs):
                return
            N = pre_n[head.request_id]
            hits, hit_len = self.sched.kv_cache_manager.get_computed_blocks(head)
            n = N - hit_len
            if T:
                n = min(n, T)
            if not cfg.chunked and n > budget:
                return
            n = min(n, budget)
            need_tokens = N if cfg.reserve_full_isl else hit_len + n
            required = cdiv(min(need_tokens, cfg.max_model_len), cfg.block_size)
            # `required` bounds the real demand (new blocks + evictable hits) from above
            assert required > free_after_schedule, (head.request_id, required, free_after_schedule)
            event("waiting head blocked by KV capacity")

    def check(self) -> None:
        try:
            self._check()
        except BaseException:
            self.broken = True
            raise

    def _check(self) -> None:
        cfg, sched = self.cfg, self.sched
        kv = sched.kv_cache_manager
        B = cfg.block_size
        running = sched.running
        assert len(running) <= cfg.max_num_seqs
        assert len(running) <= (cfg.max_num_active_seqs or cfg.max_num_seqs)
        check_block_accounting(kv)
        running_ids = [r.request_id for r in running]
        waiting_ids = [r.request_id for r in sched.waiting]
        assert len(set(running_ids)) == len(running_ids)
        assert len(set(waiting_ids)) == len(waiting_ids)
        assert set(running_ids).isdisjoint(waiting_ids)
        assert set(running_ids) | set(waiting_ids) == set(sched.requests)
        for rid, req in sched.requests.items():
            C = req.num_computed_tokens
            extra = req.num_output_placeholders if cfg.async_scheduling else 0
            assert 0 <= C <= req.num_tokens + extra
            if req.status == RequestStatus.RUNNING:
                assert rid in running_ids
                blocks = kv.req_to_blocks.get(rid, [])
                assert len(blocks) == cdiv(C, B), (rid, C, len(blocks))
                ncached = kv.num_cached_block.get(rid, 0)
                assert ncached * B <= C
                if not cfg.caching:  # nothing registered (vLLM keeps a 0 entry per running request)
                    assert ncached == 0
                for i in range(ncached):  # cached blocks hold exactly the request's content
                    assert blocks[i].block_hash == req.block_hashes[i] + GID
            else:
                assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req
                assert rid in waiting_ids
                assert not kv.req_to_blocks.get(rid)
                assert rid not in kv.num_cached_block
                if req.status == RequestStatus.WAITING:
                    assert C == 0 and req.num_output_tokens == 0
                else:
                    assert C == 0
        for rid in kv.req_to_blocks:
            assert rid in sched.requests
        # no request lost
        live = set(sched.requests)
        fin = set(self.finished)
        assert live.isdisjoint(fin)
        assert live | fin == self.accepted
        assert not (self.rejected & (live | fin))

    def final_check(self) -> None:
        sched = self.sched
        kv = sched.kv_cache_manager
        assert not sched.requests and not sched.running and len(sched.waiting) == 0
        assert set(self.finished) == self.accepted
        assert not kv.req_to_blocks and not kv.num_cached_block
        pool = kv.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)


def run_ops(cfg: Cfg, ops: list) -> list:
    h = Harness(cfg)
    for op in ops:
        if op[0] == "add":
            h.add(op[1])
        elif op[0] == "abort":
            h.abort(op[1])
        else:
            h.step()
    h.drain()
    return h.trace


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h: Optional[Harness] = None
        self.ops: list = []

    @initialize(cfg=configs())
    def setup(self, cfg: Cfg) -> None:
        self.h = Harness(cfg)

    @rule(spec=request_specs)
    def add(self, spec) -> None:
        self.ops.append(("add", spec))
        self.h.add(spec)

    @rule(specs=st.lists(request_specs, min_size=2, max_size=4))
    def add_many(self, specs) -> None:
        for spec in specs:
            self.ops.append(("add", spec))
            self.h.add(spec)

    @precondition(lambda self: self.h is not None and bool(self.h.sched.requests))
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.h.sched.requests)))
        self.ops.append(("abort", rid))
        self.h.abort(rid)

    @rule()
    def step(self) -> None:
        self.ops.append(("step",))
        self.h.step()

    @rule(n=st.integers(2, 6))
    def steps(self, n) -> None:
        for _ in range(n):
            self.ops.append(("step",))
            self.h.step()
            self.h.check()

    @invariant()
    def invariants(self) -> None:
        if self.h is not None:
            self.h.check()

    def teardown(self) -> None:
        if self.h is None or self.h.broken:
            return  # a rule already failed: don't pile a second failure on top while shrinking
        self.h.drain()
        self.h.final_check()
        # determinism: the same operations on a fresh engine give the same trace
        assert run_ops(self.h.cfg, self.ops) == self.h.trace


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CORE_STATEFUL_EXAMPLES", "300")), stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
TestSchedulerStateful = SchedulerMachine.TestCase
