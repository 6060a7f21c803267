"""Speculative decoding in the shared scheduler (vLLM 0.33's rules) and its scenario keys.

The recorded vLLM scenarios (`tests/core/data/s_*`) prove the behaviour end to end; these tests pin
each rule on its own and check that the scenario keys reject what vLLM's oracle driver rejects.
"""
from __future__ import annotations

import copy

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.scheduler import Scheduler
from servetwin.core.sched.spec_decode import DraftTokenIds, SpecDecodingStats, SpeculativeConfig
from servetwin.core.testbed.scenario import ScenarioError, parse_scenario


def _scheduler(k: int = 3, method: str = "ngram", budget: int = 64, max_model_len: int = 256,
               blocks: int = 100, caching: bool = False, async_scheduling: bool = False) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=min(8, budget), max_num_batched_tokens=budget, max_model_len=max_model_len,
                         async_scheduling=async_scheduling)
    cc = CacheConfig(block_size=16, num_gpu_blocks=blocks, enable_prefix_caching=caching)
    return Scheduler(sc, cc, speculative_config=SpeculativeConfig(k, method))


def _request(rid: str, prompt: list[int], max_tokens: int = 50) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)


def _output(so, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [tokens.get(r, []) for r in ids])


def _step(s: Scheduler, tokens_of) -> object:
    so = s.schedule()
    s.update_from_output(so, _output(so, {r: tokens_of(r, so) for r in so.num_scheduled_tokens}))
    return so


def _decoding(k=3, **kw) -> tuple[Scheduler, Request]:
    """A scheduler with one request past its 20-token prefill."""
    s = _scheduler(k, **kw)
    r = _request("r", list(range(100, 120)))
    s.add_request(r)
    while r.num_output_tokens == 0:  # the prefill, in chunks when the budget is small
        _step(s, lambda rid, so: [] if s.requests[rid].is_prefill_chunk else [1000])
    return s, r


def test_drafts_are_scheduled_and_rejections_roll_back_computed_tokens():
    s, r = _decoding(k=3)
    s.update_draft_token_ids(DraftTokenIds(["r"], [[7, 8, 9]]))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"r": 4} and so.scheduled_spec_decode_tokens == {"r": [7, 8, 9]}
    assert r.spec_token_ids == [] and r.num_computed_tokens == 24
    s.update_from_output(so, _output(so, {"r": [7, 42]}))  # one draft accepted, then the bonus token
    assert r.num_computed_tokens == 22 == r.num_tokens - 1
    assert r.output_token_ids == [1000, 7, 42]
    stats = s.last_spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]
    assert s.make_stats().spec_decoding_stats.num_accepted_tokens == 1
    assert s.make_stats().spec_decoding_stats is None  # read once


def test_drafts_are_cut_by_the_token_budget_and_max_model_len():
    s, r = _decoding(k=4, budget=3)  # a prefill of 20 in chunks of 3
    assert r.num_computed_tokens == 20
    s.update_draft_token_ids(DraftTokenIds(["r"], [[1, 2, 3, 4]]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"r": [1, 2]} and so.num_scheduled_tokens == {"r": 3}
    s2, r2 = _decoding(k=4, max_model_len=24)
    s2.update_draft_token_ids(DraftTokenIds(["r"], [[1, 2, 3, 4]]))
    so2 = s2.schedule()  # max_model_len - num_computed_tokens - 1 = 3 tokens
    assert so2.num_scheduled_tokens == {"r": 3} and so2.scheduled_spec_decode_tokens == {"r": [1, 2]}


def test_stop_inside_accepted_drafts_trims_the_rest():
    s = _scheduler(k=3)
    r = Request("r", list(range(100, 120)), SamplingParams(max_tokens=50, stop_token_ids=[5]), arrival_time=0.0)
    s.add_request(r)
    _step(s, lambda rid, so: [1000])
    s.update_draft_token_ids(DraftTokenIds(["r"], [[5, 6, 7]]))
    so = s.schedule()
    outs = s.update_from_output(so, _output(so, {"r": [5, 6, 7, 8]}))
    assert outs[0].new_token_ids == [5] and outs[0].finish_reason is not None
    assert "r" not in s.requests


def test_lookahead_slots_for_eagle():
    s = _scheduler(k=3, method="eagle")
    r = _request("r", list(range(100, 116)))  # one full block; eagle needs 3 slots past it
    s.add_request(r)
    s.schedule()
    assert s.kv_cache_manager.num_blocks_per_group("r") == [2]
    assert s.spec_decode_step_blocks == 1  # cdiv(1 + 3 + 3, 16)
    ngram = _scheduler(k=3)
    ngram.add_request(_request("r", list(range(100, 116))))
    ngram.schedule()
    assert ngram.kv_cache_manager.num_blocks_per_group("r") == [1]


def test_one_token_admission_is_padded_with_minus_one_drafts():
    s = _scheduler(k=2, caching=True)
    prompt = list(range(100, 133))  # 2 full blocks + 1 token
    s.add_request(_request("a", prompt, max_tokens=30))
    _step(s, lambda rid, so: [1000])
    s.add_request(_request("b", prompt, max_tokens=30))  # hits 32 tokens: needs exactly one
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}
    assert so.scheduled_spec_decode_tokens == {"b": [-1, -1]}
    s.update_from_output(so, _output(so, {"a": [1], "b": [2]}))  # padded drafts accept nothing
    assert s.requests["b"].num_computed_tokens == 33


def test_drafts_for_a_prefilling_request_are_ignored_and_preemption_drops_drafts():
    s = _scheduler(k=2, budget=8)
    r = _request("r", list(range(100, 120)))
    s.add_request(r)
    s.schedule()
    assert r.is_prefill_chunk
    s.update_draft_token_ids(DraftTokenIds(["r", "gone"], [[1, 2], [3]]))
    assert r.spec_token_ids == []
    s2, r2 = _decoding(k=2)
    s2.update_draft_token_ids(DraftTokenIds(["r"], [[1, 2]]))
    s2.running.remove(r2)
    s2._preempt_request(r2)
    assert r2.spec_token_ids == []


def test_async_scheduling_places_draft_placeholders():
    s = _scheduler(k=2, method="eagle", async_scheduling=True)
    r = _request("r", list(range(100, 120)))
    s.add_request(r)
    so0 = s.schedule()  # the prefill samples: 1 placeholder, then 2 placeholder drafts
    assert r.num_output_placeholders == 1 and r.spec_token_ids == [-1, -1]
    so1 = s.schedule()  # 1 + 2 tokens; 1 + 2 more placeholders
    assert so1.scheduled_spec_decode_tokens == {"r": [-1, -1]} and r.num_output_placeholders == 4
    s.update_from_output(so0, _output(so0, {"r": [1000]}))
    s.update_from_output(so1, _output(so1, {"r": [1001]}))  # both drafts rejected
    assert r.num_output_placeholders == 0 and r.num_computed_tokens == r.num_tokens - 1


def test_config_rejections():
    with pytest.raises(ConfigError, match="async"):
        _scheduler(k=2, method="ngram", async_scheduling=True)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        _scheduler(k=8, method="mtp", budget=8)
    with pytest.raises(ConfigError, match="method"):
        SpeculativeConfig(2, "medusa")


def test_spec_decoding_stats_merge_adds_up():
    a, b = SpecDecodingStats.new(3), SpecDecodingStats.new(3)
    a.observe_draft(3, 2)
    b.observe_draft(2, 1)
    b.observe_draft(3, 0)
    a.merge(b)
    assert a.to_dict() == {"num_drafts": 3, "num_draft_tokens": 8, "num_accepted_tokens": 3,
                           "num_accepted_tokens_per_pos": [2, 1, 0]}


# -- scenario keys: the oracle driver (validate_spec_settings, validate_connector_request_fields,
# build_scheduler) rejects exactly these -------------------------------------------------------------
BASE = {"settings": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_gpu_blocks": 64, "block_size": 16,
                     "speculative": {"num_speculative_tokens": 2, "method": "ngram"}},
        "requests": [{"id": "r0", "prompt_token_ids": [101, 102, 103], "max_tokens": 2}]}


def _bad(mutate) -> dict:
    d = copy.deepcopy(BASE)
    mutate(d)
    return d


def _spec(**kw):
    return lambda d: d["settings"]["speculative"].update(kw)


BAD = {
    "spec_unknown_key": (_bad(_spec(prompt_lookup_max=3)), r"settings\.speculative\.prompt_lookup_max"),
    "spec_not_object": (_bad(lambda d: d["settings"].update(speculative=2)), r"settings\.speculative"),
    "spec_k_zero": (_bad(_spec(num_speculative_tokens=0)), r"settings\.speculative\.num_speculative_tokens"),
    "spec_k_bool": (_bad(_spec(num_speculative_tokens=True)), r"settings\.speculative\.num_speculative_tokens"),
    "spec_k_missing": (_bad(lambda d: d["settings"]["speculative"].pop("num_speculative_tokens")),
                       r"settings\.speculative\.num_speculative_tokens"),
    "spec_method": (_bad(_spec(method="medusa")), r"settings\.speculative\.method"),
    "spec_acceptance_word": (_bad(_spec(acceptance="some")), r"settings\.speculative\.acceptance"),
    "spec_acceptance_seed": (_bad(_spec(acceptance={"seed": -1})), r"settings\.speculative\.acceptance"),
    "spec_acceptance_both": (_bad(_spec(acceptance={"seed": 1, "pattern": [1]})),
                             r"settings\.speculative\.acceptance"),
    "spec_acceptance_empty": (_bad(_spec(acceptance={"pattern": []})), r"settings\.speculative\.acceptance"),
    "spec_ngram_async": (_bad(lambda d: d["settings"].update(async_scheduling=True)), r"settings\.speculative"),
    "spec_eagle_budget": (_bad(lambda d: (d["settings"].update(max_num_batched_tokens=4, max_num_seqs=2),
                                          d["settings"]["speculative"].update(method="eagle", num_speculative_tokens=4))),
                          r"settings\.speculative\.num_speculative_tokens"),
    "draft_lengths_no_spec": (_bad(lambda d: (d["settings"].pop("speculative"),
                                              d["requests"][0].update(draft_lengths=[1]))),
                              r"requests\[0\]\.draft_lengths"),
    "accept_pattern_no_spec": (_bad(lambda d: (d["settings"].pop("speculative"),
                                               d["requests"][0].update(accept_pattern=[1]))),
                               r"requests\[0\]\.accept_pattern"),
    "draft_lengths_above_k": (_bad(lambda d: d["requests"][0].update(draft_lengths=[1, 3])),
                              r"requests\[0\]\.draft_lengths"),
    "draft_lengths_empty": (_bad(lambda d: d["requests"][0].update(draft_lengths=[])), r"requests\[0\]\.draft_lengths"),
    "draft_lengths_negative": (_bad(lambda d: d["requests"][0].update(draft_lengths=[-1])),
                               r"requests\[0\]\.draft_lengths"),
    "accept_pattern_str": (_bad(lambda d: d["requests"][0].update(accept_pattern="1")),
                           r"requests\[0\]\.accept_pattern"),
    "draft_lengths_async": (_bad(lambda d: (d["settings"].update(async_scheduling=True),
                                            d["settings"]["speculative"].update(method="eagle"),
                                            d["requests"][0].update(draft_lengths=[1]))),
                            r"requests\[0\]\.draft_lengths"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_speculative_scenario_names_the_field(case):
    data, field = BAD[case]
    with pytest.raises(ScenarioError, match=field) as info:
        parse_scenario(data)
    assert str(info.value).startswith(info.value.path + ":")


def test_base_speculative_scenario_parses():
    sc = parse_scenario(copy.deepcopy(BASE))
    assert sc.speculative.config == SpeculativeConfig(2, "ngram") and sc.speculative.acceptance == "all"
    d = copy.deepcopy(BASE)
    d["settings"]["speculative"].update(acceptance={"pattern": [0, 2]}, method="mtp")
    d["requests"][0].update(draft_lengths=[0, 2], accept_pattern=[1])
    sc = parse_scenario(d)
    assert sc.speculative.acceptance == ("pattern", [0, 2])
    assert sc.requests[0].draft_lengths == [0, 2] and sc.requests[0].accept_pattern == [1]
