"""Hypothesis state machine over random speculative-decoding mixes with random acceptance.

Random configs (ngram / eagle / mtp, k, sync or async, tight pools, prefix caching), random arrivals,
aborts, draft lengths and accepted counts go through the shared `Scheduler` with a two-deep batch
queue under async scheduling (as vLLM's EngineCore). After every step:
- free + used = pool, reference counts, free queue and hash map agree (no leak, no double free);
- `num_computed_tokens` never exceeds the tokens whose KV can exist (known tokens plus in-flight
  placeholders, and the slots of the blocks held);
- the acceptance statistics add up: per update, accepted <= drafted, the per-position counts sum to
  the accepted total and never grow with the position, and they equal what the worker accepted.
At the end every request drains and every block is free again.
"""
from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.scheduler import Scheduler
from servetwin.core.sched.spec_decode import DraftTokenIds, SpeculativeConfig

from coretest_utils import check_block_accounting

BASE = [(i * 7 + 3) % 5 + 10 for i in range(96)]
STOP = 3  # a stop token the worker emits now and then
DRAIN_LIMIT = 3000


@st.composite
def configs(draw) -> dict:
    method = draw(st.sampled_from(["ngram", "eagle", "mtp"]))
    k = draw(st.integers(1, 5))
    block_size = draw(st.sampled_from([4, 16]))
    max_num_seqs = draw(st.integers(1, 6))
    return {"method": method, "k": k, "block_size": block_size, "max_num_seqs": max_num_seqs,
            "budget": draw(st.integers(max(max_num_seqs, k + 1), 64)),
            "max_model_len": draw(st.integers(24, 128)),
            "blocks": draw(st.integers(128 // block_size + 2, 400 // block_size)),
            "caching": draw(st.booleans()),
            "async": method != "ngram" and draw(st.booleans()),
            "threshold": draw(st.sampled_from([0, 0, 8]))}


class SpecDecodeMachine(RuleBasedStateMachine):
    @initialize(cfg=configs())
    def setup(self, cfg: dict) -> None:
        self.cfg = cfg
        sc = SchedulerConfig(max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["budget"],
                             max_model_len=cfg["max_model_len"], async_scheduling=cfg["async"],
                             long_prefill_token_threshold=cfg["threshold"])
        cc = CacheConfig(block_size=cfg["block_size"], num_gpu_blocks=cfg["blocks"],
                         enable_prefix_caching=cfg["caching"])
        self.sched = Scheduler(sc, cc, speculative_config=SpeculativeConfig(cfg["k"], cfg["method"]))
        self.queue: deque = deque()  # scheduled, not yet updated (2 deep with async scheduling)
        self.counter = 0
        self.step_no = 0

    @rule(prefix=st.integers(0, 60), suffix=st.lists(st.integers(10, 14), max_size=5),
          max_tokens=st.integers(1, 30))
    def add(self, prefix: int, suffix: list[int], max_tokens: int) -> None:
        prompt = (BASE[:prefix] + suffix) or [10]
        if len(prompt) >= self.cfg["max_model_len"]:
            prompt = prompt[: self.cfg["max_model_len"] - 1]
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP])
        self.counter += 1
        try:
            self.sched.add_request(Request(f"r{self.counter}", prompt, sp, arrival_time=float(self.counter)))
        except ValueError:
            pass  # unservable in this pool (servetwin's documented deviation)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.sched.has_requests() or self.queue)
    @rule(data=st.data())
    def step(self, data) -> None:
        self._step(lambda n: data.draw(st.integers(0, n)), lambda: data.draw(st.integers(0, 9)) == 0)

    def _step(self, accept, stop) -> None:
        sched = self.sched
        if sched.has_requests():
            so = sched.schedule()
            self._check_output(so)
            self.queue.appendleft((so, self._sample(so, accept, stop)))
            if self.cfg["async"] and len(self.queue) < 2:
                return
        so, mro = self.queue.pop()
        expected = self._verifications(so, mro)
        sched.update_from_output(so, mro)
        self._check_stats(expected)
        if not self.cfg["async"] and so.total_num_scheduled_tokens:
            self._propose(so, accept)
        self.step_no += 1

    def _sample(self, so, accept, stop) -> ModelRunnerOutput:
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            if self.sched.requests[rid].is_prefill_chunk:
                sampled.append([])
                continue
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            padded = not self.cfg["async"] and -1 in drafts  # padding can never be accepted
            a = 0 if padded else accept(len(drafts))
            sampled.append([STOP if stop() else 20 + j for j in range(a + 1)])
        return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)

    def _propose(self, so, accept) -> None:
        ids = list(so.num_scheduled_tokens)
        drafts = [[30 + j for j in range(accept(self.cfg["k"]))] for _ in ids]
        self.sched.update_draft_token_ids(DraftTokenIds(ids, drafts))

    # -- checks ---------------------------------------------------------------------------------
    def _check_output(self, so) -> None:
        k = self.cfg["k"]
        assert so.total_num_scheduled_tokens <= self.cfg["budget"]
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            n = so.num_scheduled_tokens[rid]
            assert 0 < len(drafts) <= k and len(drafts) < n  # drafts ride along with one real token
            req = self.sched.requests[rid]
            assert req.num_computed_tokens <= self.cfg["max_model_len"] - 1  # room for the sampled one

    def _verifications(self, so, mro) -> list[tuple[int, int]]:
        """(drafts, accepted) of the rows whose update will verify drafts (the request still alive)."""
        out = []
        for rid, toks in zip(mro.req_ids, mro.sampled_token_ids):
            req = self.sched.requests.get(rid)
            if toks and rid in so.scheduled_spec_decode_tokens and req is not None and not req.is_finished():
                out.append((len(so.scheduled_spec_decode_tokens[rid]), len(toks) - 1))
        return out

    def _check_stats(self, expected: list[tuple[int, int]]) -> None:
        stats = self.sched.last_spec_decoding_stats
        if not expected:
            assert stats is None
            return
        assert stats.num_drafts == len(expected)
        assert stats.num_draft_tokens == sum(m for m, _ in expected)
        assert stats.num_accepted_tokens == sum(a for _, a in expected) <= stats.num_draft_tokens
        per_pos = stats.num_accepted_tokens_per_pos
        assert sum(per_pos) == stats.num_accepted_tokens
        assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # position i needs all before it
        assert sum(stats.num_draft_tokens_per_pos) == stats.num_draft_tokens

    @invariant()
    def blocks_add_up(self) -> None:
        if not hasattr(self, "sched"):
            return
        kv = self.sched.kv_cache_manager
        check_block_accounting(kv)
        assert kv.num_free_blocks + sum(1 for b in kv.block_pool.blocks if not b.is_null and b.ref_cnt) \
            == kv.block_pool.num_gpu_blocks - 1

    @invariant()
    def computed_tokens_have_kv(self) -> None:
        if not hasattr(self, "sched"):
            return
        kv, bs = self.sched.kv_cache_manager, self.cfg["block_size"]
        for req in self.sched.running:
            known = req.num_tokens + req.num_output_placeholders + len(req.spec_token_ids)
            assert req.num_computed_tokens <= known
            assert req.num_computed_tokens <= len(kv.req_to_blocks.get(req.request_id, ())) * bs
            if not self.queue:  # nothing in flight: what is computed is known
                assert req.num_computed_tokens <= req.num_tokens

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(DRAIN_LIMIT):
            if not (self.sched.has_requests() or self.queue):
                break
            self._step(lambda n: n // 2, lambda: False)
            self.blocks_add_up()
            self.computed_tokens_have_kv()
        else:
            raise AssertionError("no quiescence")
        kv = self.sched.kv_cache_manager
        assert kv.num_free_blocks == kv.block_pool.num_gpu_blocks - 1  # nothing leaked


TestSpecDecodeMachine = SpecDecodeMachine.TestCase
TestSpecDecodeMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
