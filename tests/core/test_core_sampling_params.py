"""SamplingParams normalisation + validation (docs/scheduler_behaviour.md §B.1) and parallel-sampling fan-out (§B.2)."""
from __future__ import annotations

import math
import warnings

import pytest

from servetwin.core.engine.parallel_sampling import ParentRequest, child_request_id, fan_out
from servetwin.core.sampling_params import RequestOutputKind, SamplingParams, SamplingType

from coretest_utils import create_scheduler, make_request


INVALID = [
    # (kwargs, field named in the error)
    (dict(n=0), "n"),
    (dict(n=16385), "n"),
    (dict(n=1.5), "n"),
    (dict(n=True), "n"),
    (dict(presence_penalty=-2.1), "presence_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(repetition_penalty=math.nan), "repetition_penalty"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=2.5), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-3), "prompt_logprobs"),
    (dict(stop_token_ids=[1, "x"]), "stop_token_ids"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop=["end"], detokenize=False), "stop"),
    (dict(temperature=0.0, n=2), "n"),
    (dict(logprobs_mode="bogus"), "logprobs_mode"),
]


@pytest.mark.parametrize("kwargs,field", INVALID, ids=[f"{f}-{i}" for i, (_, f) in enumerate(INVALID)])
def test_invalid_sampling_params_raise_value_error_naming_field(kwargs, field):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as e:
            SamplingParams(**kwargs)
    assert field in str(e.value)


def test_greedy_n_error_message():
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(temperature=0.0, n=3)


@pytest.mark.parametrize("kwargs", [
    dict(n=16384, temperature=1.0), dict(presence_penalty=-2.0), dict(presence_penalty=2.0),
    dict(frequency_penalty=2.0), dict(repetition_penalty=0.01), dict(temperature=0.0), dict(temperature=2.0),
    dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=-1), dict(top_k=0), dict(top_k=50), dict(min_p=0.0),
    dict(min_p=1.0), dict(max_tokens=None), dict(max_tokens=1), dict(min_tokens=4, max_tokens=4),
    dict(logprobs=-1), dict(logprobs=0), dict(prompt_logprobs=-1), dict(prompt_logprobs=0),
    dict(stop=["a", "bb"]), dict(min_tokens=100, max_tokens=None),
])
def test_valid_sampling_params(kwargs):
    SamplingParams(**kwargs)


def test_defaults():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (sp.max_tokens, sp.min_tokens, sp.ignore_eos, sp.seed) == (16, 0, False, None)
    assert sp.stop == [] and sp.stop_token_ids == []
    assert sp.logprobs is None and sp.prompt_logprobs is None
    assert sp.skip_reading_prefix_cache is False
    assert sp.sampling_type == SamplingType.RANDOM


def test_small_temperature_raised_with_warning():
    with pytest.warns(UserWarning):
        sp = SamplingParams(temperature=0.005)
    assert sp.temperature == 0.01
    assert sp.sampling_type == SamplingType.RANDOM


def test_normalisations():
    sp = SamplingParams(seed=-1, stop="end", stop_token_ids=[5, 3, 5, 7, 3], logprobs=True, prompt_logprobs=True)
    assert sp.seed is None
    assert sp.stop == ["end"]
    assert sp.stop_token_ids == [5, 3, 7]  # de-duplicated, order kept
    assert sp.logprobs == 1 and sp.prompt_logprobs == 1
    assert sp.all_stop_token_ids == {3, 5, 7}
    assert sp.skip_reading_prefix_cache is True  # prompt logprobs requested


def test_output_text_buffer_length():
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0
    assert SamplingParams().output_text_buffer_length == 0


def test_greedy_forces_top_p_top_k_min_p():
    sp = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.3)
    assert (sp.top_p, sp.top_k, sp.min_p) == (1.0, 0, 0.0)
    assert sp.sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_skip_reading_prefix_cache_user_override():
    assert SamplingParams(prompt_logprobs=2, skip_reading_prefix_cache=False).skip_reading_prefix_cache is False
    assert SamplingParams(skip_reading_prefix_cache=True).skip_reading_prefix_cache is True


def test_update_from_generation_config():
    sp = SamplingParams(stop_token_ids=[9])
    sp.update_from_generation_config([2, 3, 9])
    assert sp.eos_token_id == 2
    assert sp.stop_token_ids == [9, 3]  # extra EOS ids merged, no duplicates
    assert sp.all_stop_token_ids == {2, 3, 9}
    ign = SamplingParams(ignore_eos=True, stop_token_ids=[9])
    ign.update_from_generation_config([2, 3])
    assert ign.eos_token_id is None
    assert ign.stop_token_ids == [9]
    assert ign.all_stop_token_ids == {2, 3, 9}  # still masked for min_tokens
    single = SamplingParams()
    single.update_from_generation_config(7)
    assert single.eos_token_id == 7 and single.stop_token_ids == []


def test_verify_against_model():
    SamplingParams(logprobs=20, prompt_logprobs=20).verify(vocab_size=1000)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21).verify(vocab_size=1000)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).verify(vocab_size=1000)  # -1 = whole vocab > 20
    SamplingParams(logprobs=-1).verify(vocab_size=1000, max_logprobs=-1)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[1000]).verify(vocab_size=1000)


def test_clone_is_independent():
    sp = SamplingParams(stop_token_ids=[1])
    c = sp.clone()
    c.stop_token_ids.append(2)
    c.all_stop_token_ids.add(5)
    assert sp.stop_token_ids == [1] and 5 not in sp.all_stop_token_ids


# -- parallel sampling --------------------------------------------------------------------------

def test_fan_out_single():
    sp = SamplingParams(n=1)
    assert fan_out("req", sp) == [("req", sp)]


def test_fan_out_ids_and_seeds():
    sp = SamplingParams(n=3, seed=100, temperature=0.8)
    kids = fan_out("parent", sp)
    assert [cid for cid, _ in kids] == ["0_parent", "1_parent", "2_parent"]
    assert [p.seed for _, p in kids] == [100, 101, 102]
    assert all(p.n == 1 for _, p in kids)
    assert sp.n == 3 and sp.seed == 100  # parent untouched
    assert child_request_id(4, "x") == "4_x"


def test_fan_out_without_seed_shares_child_params():
    sp = SamplingParams(n=4, temperature=0.8)
    kids = fan_out("p", sp)
    assert len({id(p) for _, p in kids}) == 1
    assert kids[0][1].n == 1 and kids[0][1].seed is None


def test_parent_request_aggregation():
    final = ParentRequest("p", SamplingParams(n=2, temperature=1.0, output_kind=RequestOutputKind.FINAL_ONLY))
    assert final.child_ids == ["0_p", "1_p"]
    assert final.observe("1_p", "B", finished=True) is None
    assert not final.finished
    assert final.observe("0_p", "A", finished=True) == ["A", "B"]
    assert final.finished
    stream = ParentRequest("q", SamplingParams(n=2, temperature=1.0))
    assert stream.observe("0_q", "x", finished=False) == ["x"]


def test_children_share_prefix_cache_blocks_in_same_step():
    s = create_scheduler(enable_prefix_caching=True)
    prompt = list(range(40))
    for cid, p in fan_out("par", SamplingParams(n=3, temperature=1.0, seed=1)):
        r = make_request(cid, prompt)
        r.sampling_params = p
        s.add_request(r)
    so = s.schedule()
    assert {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs} == {"0_par": 0, "1_par": 32,
                                                                             "2_par": 32}
