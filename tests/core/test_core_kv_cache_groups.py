"""KV cache groups (vLLM 0.33's hybrid KV cache manager): a Hypothesis state machine over random
group mixes driving the scheduler, the manager per attention type on worked examples, the typed
validation of `kv_cache_groups`, and vLLM's grouping rule from per-layer attention types."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_cache_interface import (
    ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec, check_retention_interval,
    parse_kv_cache_groups)
from servetwin.core.kv_cache.kv_cache_manager import KVCacheManager
from servetwin.core.kv_cache.kv_cache_planning import (
    check_or_fit_max_model_len_groups, kv_cache_groups_for_layers, layer_specs, max_blocks_per_request)
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.request import RequestStatus
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.scheduler import Scheduler
from servetwin.core.testbed.scenario import ScenarioError, parse_scenario

from coretest_utils import make_output, make_request

FULL, SW, CL = FullAttentionSpec(), SlidingWindowSpec, ChunkedLocalAttentionSpec


# -- the state machine ----------------------------------------------------------------------------
@st.composite
def group_mixes(draw):
    """1-4 groups: full attention plus sliding windows, or plus chunked local (never both)."""
    other = draw(st.sampled_from(["sliding", "chunked"]))
    n = draw(st.integers(1, 4))
    groups = []
    for _ in range(n):
        kind = draw(st.sampled_from(["full", other]))
        if kind == "full":
            groups.append(FULL)
        elif kind == "sliding":
            groups.append(SW(draw(st.integers(2, 40))))
        else:
            groups.append(CL(draw(st.integers(1, 40))))
    return tuple(groups)


class KVGroupsMachine(RuleBasedStateMachine):
    """Adds, schedules (with the fake model), finishes, aborts and forced preemptions on a scheduler
    with several KV cache groups, checking the pool after every step."""

    @initialize(groups=group_mixes(), block_size=st.sampled_from([1, 2, 4, 8]),
                caching=st.booleans(), async_sched=st.booleans(), num_blocks=st.integers(10, 40),
                retention=st.sampled_from([0, None, "interval"]))
    def setup(self, groups, block_size, caching, async_sched, num_blocks, retention):
        self.groups, self.block_size = groups, block_size
        if retention == "interval":  # one window tail kept per 2 blocks (needs a sliding-window group)
            retention = 2 * block_size if any(isinstance(g, SW) for g in groups) else 0
        self.sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4, max_model_len=64,
                            async_scheduling=async_sched),
            CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=caching,
                        kv_cache_groups=groups, prefix_cache_retention_interval=retention))
        self.kv = self.sched.kv_cache_manager
        self.pending = []  # async: outputs of the previous step, processed one step late
        self.n = 0

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 40), max_tokens=st.integers(1, 30))
    def add(self, prefix, length, max_tokens):
        prompt = [7 + prefix] * (8 * prefix) + [100 + self.n + i for i in range(length)]
        req = make_request(f"r{self.n}", prompt[:60], max_tokens=max_tokens, eos=None)
        self.n += 1
        try:
            self.sched.add_request(req)
        except ConfigError:
            pass  # can never fit this pool (the scheduler's servable check)

    @rule(k=st.integers(1, 6))
    def steps(self, k):
        for _ in range(k):
            self.step()

    def step(self):
        before = {r.request_id: r.num_in_flight_tokens for r in self.sched.running}
        so = self.sched.schedule()
        self._check_pool()
        self._check_window_bound(so, before)
        self.pending.append(so)
        if len(self.pending) > (2 if self.sched.async_scheduling else 1) - 1:
            old = self.pending.pop(0)
            self.sched.update_from_output(old, make_output(self.sched, old))

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.sched.running and not self.pending)
    @rule()
    def preempt_all(self):
        self.sched.reset_prefix_cache(reset_running_requests=True)

    def _held(self) -> dict[int, int]:
        """Block id -> table entries referencing it (every group, every request), null excluded."""
        refs: dict[int, int] = {}
        for m in self.kv.coordinator.single_type_managers:
            for blocks in m.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
        return refs

    def _check_pool(self):
        pool = self.kv.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = [b.block_id for b in free]
        held = self._held()
        assert len(set(free_ids)) == len(free_ids)  # nothing freed twice
        assert pool.null_block.block_id not in free_ids and 0 not in held  # null never handed out
        assert all(b.ref_cnt == 0 for b in free)
        assert set(free_ids).isdisjoint(held)
        assert len(free_ids) + len(held) == pool.num_gpu_blocks - 1  # free + used = pool: no leak
        blocks = pool.blocks
        for bid, n in held.items():
            assert blocks[bid].ref_cnt == n, (bid, blocks[bid].ref_cnt, n)

    def _check_window_bound(self, so, in_flight_before):
        """Steady decode (1 token now, at most 1 in flight before): a sliding-window group holds at
        most ceil(W / B) + 1 blocks of the request."""
        bs = self.block_size
        for rid, n in so.num_scheduled_tokens.items():
            if n != 1 or in_flight_before.get(rid, 0) > 1:
                continue
            for m in self.kv.coordinator.single_type_managers:
                if isinstance(m.kv_cache_spec, SlidingWindowSpec):
                    assert m.num_held_blocks(rid) <= cdiv(m.kv_cache_spec.sliding_window, bs) + 1

    @invariant()
    def tables_cover_computed_tokens(self):
        if not hasattr(self, "sched"):
            return
        for r in self.sched.running:
            for m in self.kv.coordinator.single_type_managers:
                assert len(m.req_to_blocks.get(r.request_id, ())) >= cdiv(r.num_computed_tokens, self.block_size)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        while self.pending:
            old = self.pending.pop(0)
            self.sched.update_from_output(old, make_output(self.sched, old))
        self.sched.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        self._check_pool()
        assert self.kv.num_free_blocks == self.kv.block_pool.num_gpu_blocks - 1


TestKVGroupsMachine = KVGroupsMachine.TestCase
TestKVGroupsMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])


# -- managers on worked examples --------------------------------------------------------------------
def _admit(kv, req, n=None):
    hits, hit_len = kv.get_computed_blocks(req)
    n = req.num_tokens - hit_len if n is None else n
    new = kv.allocate_slots(req, n, hit_len, hits)
    assert new is not None
    req.num_computed_tokens = hit_len + n
    req.status = RequestStatus.RUNNING
    return hit_len


def test_sliding_window_frees_out_of_window_blocks_as_it_decodes():
    kv = KVCacheManager(64, 4, 256, kv_cache_groups=(FULL, SW(8)))
    req = make_request("a", list(range(20)), max_tokens=50, block_size=4)
    _admit(kv, req)
    full, sw = kv.coordinator.single_type_managers
    assert len(full.req_to_blocks["a"]) == len(sw.req_to_blocks["a"]) == 5
    for t in range(12):  # decode: each allocate first frees what left the window
        req.append_output_token_ids(1000 + t)
        kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    # C = 32: skipped(31) = 31 - 8 + 1 = 24 tokens -> 6 whole blocks are null, the table keeps its length
    assert [b.is_null for b in sw.req_to_blocks["a"]] == [True] * 6 + [False] * 2
    assert kv.num_blocks_per_group("a") == [8, 2]
    assert kv.num_free_blocks == 63 - 10


def test_chunked_local_attention_keeps_only_the_current_chunk():
    kv = KVCacheManager(64, 4, 256, kv_cache_groups=(FULL, CL(8)))
    req = make_request("a", list(range(19)), max_tokens=50, block_size=4)
    _admit(kv, req)  # C = 19: the next allocation frees the chunk [0, 16)
    req.append_output_token_ids(5)
    kv.allocate_slots(req, 1)
    assert kv.num_blocks_per_group("a") == [5, 1]


def test_hybrid_hit_is_the_shortest_group_and_pins_the_shared_prefix():
    """Full attention finds 3 blocks; the window needs cdiv(W - 1, B) = 2 consecutive cached blocks,
    which sparse retention kept only at the first prompt's replay boundary."""
    kv = KVCacheManager(64, 4, 256, kv_cache_groups=(FULL, SW(8)))
    a = make_request("a", list(range(13)), max_tokens=4, block_size=4)
    _admit(kv, a)
    # replay boundary of a 13-token prompt: floor(12 / 4) * 4 = 12 -> window blocks 1, 2 are hashed
    sw = kv.coordinator.single_type_managers[1]
    assert [b.block_hash is not None for b in sw.req_to_blocks["a"]] == [False, True, True, False]
    b = make_request("b", list(range(13)) + [99], max_tokens=4, block_size=4)
    hits, hit_len = kv.get_computed_blocks(b)
    assert hit_len == 12 and [x.is_null for x in hits[1]] == [True, False, False]
    c = make_request("c", list(range(10)) + [77] * 8, max_tokens=4, block_size=4)
    hits, hit_len = kv.get_computed_blocks(c)
    # full attention hits 2 blocks (8 tokens); the window has block 1 cached but not block 0: no
    # run of 2, and only a run starting at block 0 counts -> no hit; the junction is pinned
    assert hit_len == 0 and c.shared_prefix_boundary == 8


def test_admission_cap_counts_window_groups_at_most_their_cap():
    kv = KVCacheManager(20, 4, 256, kv_cache_groups=(FULL, SW(8)), max_in_flight_tokens=8)
    sw = kv.coordinator.single_type_managers[1]
    assert sw.max_admission_blocks_per_request == cdiv(8 - 1 + 8, 4) + 1 == 5
    req = make_request("a", list(range(40)), max_tokens=4, block_size=4)  # 10 blocks per group
    # the gate: 10 (full) + 5 (window, capped) = 15 <= 19 free, though 20 > 19 uncapped
    assert kv.allocate_slots(req, 8, full_sequence_must_fit=True) is not None


# -- validation ------------------------------------------------------------------------------------
BAD_GROUPS = {
    "not_a_list": ({"type": "full_attention"}, r"^kv_cache_groups: must be a non-empty list"),
    "empty": ([], r"^kv_cache_groups: must be a non-empty list"),
    "entry_not_object": (["full_attention"], r"^kv_cache_groups\[0\]: must be an object"),
    "unknown_type": ([{"type": "mamba"}], r"^kv_cache_groups\[0\]\.type: unknown KV cache group type"),
    "missing_window": ([{"type": "sliding_window"}], r"^kv_cache_groups\[0\]\.sliding_window: required"),
    "window_too_small": ([{"type": "sliding_window", "sliding_window": 1}],
                         r"^kv_cache_groups\[0\]\.sliding_window: must be an int >= 2"),
    "window_float": ([{"type": "sliding_window", "sliding_window": 8.0}],
                     r"^kv_cache_groups\[0\]\.sliding_window: must be an int"),
    "window_bool": ([{"type": "sliding_window", "sliding_window": True}],
                    r"^kv_cache_groups\[0\]\.sliding_window: must be an int"),
    "chunk_zero": ([{"type": "chunked_local_attention", "attention_chunk_size": 0}],
                   r"^kv_cache_groups\[0\]\.attention_chunk_size: must be an int >= 1"),
    "window_on_full": ([{"type": "full_attention", "sliding_window": 8}],
                       r"^kv_cache_groups\[0\]\.sliding_window: unknown key"),
    "extra_key": ([{"type": "full_attention"}, {"type": "sliding_window", "sliding_window": 8, "w": 1}],
                  r"^kv_cache_groups\[1\]\.w: unknown key"),
    "sliding_and_chunked": ([{"type": "sliding_window", "sliding_window": 8},
                             {"type": "chunked_local_attention", "attention_chunk_size": 8}],
                            r"^kv_cache_groups: sliding_window and chunked_local_attention"),
}


@pytest.mark.parametrize("case", sorted(BAD_GROUPS))
def test_bad_kv_cache_groups_name_the_field(case):
    raw, match = BAD_GROUPS[case]
    with pytest.raises(ConfigError, match=match):
        parse_kv_cache_groups(raw)


def test_scenario_errors_name_the_settings_field():
    base = {"settings": {"max_num_seqs": 2, "max_num_batched_tokens": 16, "num_gpu_blocks": 16},
            "requests": [{"id": "a", "prompt_token_ids": [1, 2, 3]}]}
    base["settings"]["kv_cache_groups"] = [{"type": "sliding_window"}]
    with pytest.raises(ScenarioError, match=r"^settings\.kv_cache_groups\[0\]\.sliding_window"):
        parse_scenario(base)
    base["settings"]["kv_cache_groups"] = None  # present but null: not "absent"
    with pytest.raises(ScenarioError, match=r"^settings\.kv_cache_groups: must be a non-empty list"):
        parse_scenario(base)
    base["settings"]["kv_cache_groups"] = [{"type": "full_attention"}]
    for bad in (-1, 1.5, "0", 24):  # 24: no sliding-window group for a positive interval
        base["settings"]["prefix_cache_retention_interval"] = bad
        with pytest.raises(ScenarioError, match=r"^settings\.prefix_cache_retention_interval"):
            parse_scenario(base)
    base["settings"]["prefix_cache_retention_interval"] = None  # dense
    assert parse_scenario(base).cache_config.prefix_cache_retention_interval is None


def test_retention_interval_must_be_a_block_multiple():
    assert check_retention_interval(32, (FULL, SW(8)), 16) == 32
    with pytest.raises(ConfigError, match="multiple of block_size"):
        check_retention_interval(24, (FULL, SW(8)), 16)


# -- grouping rule and pool sizing ------------------------------------------------------------------
def test_gpt_oss_alternating_layers_give_sliding_then_full():
    specs = layer_specs(24, ["sliding_attention", "full_attention"] * 12, sliding_window=128)
    plan = kv_cache_groups_for_layers(specs)
    assert plan.kv_cache_groups == (SW(128), FULL) and plan.group_size == 12
    assert plan.layer_to_group == (0, 1) * 12
    # a pool block is one page of 12 layers: twice the blocks of the all-full model
    all_full = kv_cache_groups_for_layers(layer_specs(24))
    assert all_full.kv_cache_groups == (FULL,) and all_full.group_size == 24
    assert plan.num_blocks(24_000, 10) == 2 * all_full.num_blocks(24_000, 10) == 200


def test_gemma3_five_to_one_and_the_group_size_rule():
    pattern = (["sliding_attention"] * 5 + ["full_attention"]) * 4  # 20 sliding, 4 full
    plan = kv_cache_groups_for_layers(layer_specs(24, pattern, sliding_window=512))
    assert plan.kv_cache_groups == (SW(512),) * 5 + (FULL,) and plan.group_size == 4
    # 12 sliding + 13 full: 13 < 1.5 x 12, so the group size is the largest bucket (one padded group each)
    plan = kv_cache_groups_for_layers(layer_specs(25, ["sliding_attention"] * 12 + ["full_attention"] * 13,
                                                  sliding_window=128))
    assert plan.kv_cache_groups == (SW(128), FULL) and plan.group_size == 13


def test_chunked_local_needs_the_env_flag_and_disable_promotes_to_full():
    pattern = (["chunked_attention"] * 3 + ["full_attention"]) * 2
    specs = layer_specs(8, pattern, attention_chunk_size=8192)
    assert kv_cache_groups_for_layers(specs, allow_chunked_local=False).kv_cache_groups == (FULL,)
    assert kv_cache_groups_for_layers(specs, allow_chunked_local=True).kv_cache_groups == (CL(8192),) * 3 + (FULL,)
    gpt = layer_specs(4, ["sliding_attention", "full_attention"] * 2, sliding_window=128)
    assert kv_cache_groups_for_layers(gpt, disable_hybrid_kv_cache_manager=True).kv_cache_groups == (FULL,)
    # an all-sliding model keeps its one sliding-window group either way
    mistral = layer_specs(4, ["sliding_attention"] * 4, sliding_window=4096)
    assert kv_cache_groups_for_layers(mistral, True).kv_cache_groups == (SW(4096),)
    with pytest.raises(ConfigError, match=r"^layer_types\[1\]: unknown attention type"):
        layer_specs(2, ["full_attention", "linear_attention"])
    with pytest.raises(ConfigError, match=r"^sliding_window"):
        layer_specs(1, ["sliding_attention"])


def test_startup_check_sums_per_request_blocks_over_groups():
    groups = (SW(128), FULL)
    # max_model_len 1024, block 16: full 64 blocks + window min(64, cdiv(127 + 256, 16) + 1 = 25)
    assert max_blocks_per_request(groups, 16, 1024, 256, 1024) == 64 + 25
    assert check_or_fit_max_model_len_groups(90, groups, 16, 1024, 4096, 256) == 1024
    with pytest.raises(ConfigError, match=r"^max_model_len: 1024 tokens need 89 blocks"):
        check_or_fit_max_model_len_groups(89, groups, 16, 1024, 4096, 256)
    fitted = check_or_fit_max_model_len_groups(89, groups, 16, -1, 4096, 256)
    assert max_blocks_per_request(groups, 16, fitted, 256, fitted) <= 88 < \
        max_blocks_per_request(groups, 16, fitted + 1, 256, fitted + 1)
