"""Sampler (gpu/sampler.py) and SamplingMetadata (gpu/sampling_metadata.py)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.outputs import Logprobs
from servetwin.core.sampling_params import SamplingParams
from servetwin.gpu.sampler import (Sampler, SamplerOutput, apply_min_p, apply_penalties, apply_top_k_only, apply_top_k_top_p, apply_top_p, compute_prompt_logprobs, gather_logprobs, to_logprobs_list, _top_p_from_candidates, _top_p_sorted)
from servetwin.gpu.sampling_metadata import SamplingMetadata, make_generator, token_counts

NEG_INF = float("-inf")
sampler = Sampler()


def metadata(params, outputs=None, prompts=None, generators=None, vocab=16, **kw):
    n = len(params)
    return SamplingMetadata.from_requests(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[0] for _ in range(n)],
        generators or {},
        vocab,
        **kw,
    )


def sp(**kw) -> SamplingParams:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SamplingParams(**kw)


def full_logprobs(logits, params, **kw):
    """Logprobs over the whole vocab for every row (logprobs=-1)."""
    out = sampler(logits, metadata(params, vocab=logits.shape[1], **kw))
    order = out.logprobs.logprob_token_ids[:, 1:].argsort(dim=1)
    return out, out.logprobs.logprobs[:, 1:].gather(1, order)


# -- greedy / mixed ---------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_greedy_is_argmax(num_reqs, vocab, seed):
    logits = torch.randn(num_reqs, vocab, generator=torch.Generator().manual_seed(seed))
    out = sampler(logits, metadata([sp(temperature=0.0)] * num_reqs, vocab=vocab))
    assert out.sampled_token_ids.dtype == torch.long
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    assert out.logprobs is None


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(0)
    vocab = 8
    logits = torch.randn(4, vocab)
    logits[1] = 0.0  # flat row: random sampling must spread over the vocab
    logits[3] = 0.0
    params = [sp(temperature=0.0), sp(temperature=1.0), sp(temperature=0.0), sp(temperature=1.5)]
    md = metadata(params, vocab=vocab)
    assert not md.all_greedy and not md.all_random
    seen_random = [set(), set()]
    for _ in range(60):
        tokens = sampler(logits, md).sampled_token_ids
        assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
        seen_random[0].add(int(tokens[1]))
        seen_random[1].add(int(tokens[3]))
    assert len(seen_random[0]) >= 4 and len(seen_random[1]) >= 4


def test_sampler_does_not_modify_caller_logits():
    logits = torch.randn(2, 10)
    before = logits.clone()
    params = [sp(temperature=0.7, top_k=2, top_p=0.5, min_p=0.1, repetition_penalty=1.3,
                 extra_args={"logit_bias": {1: -5.0}}), sp(temperature=0.0, min_tokens=2, stop_token_ids=[3])]
    sampler(logits, metadata(params, outputs=[[1], []], vocab=10))
    assert torch.equal(logits, before)


def test_empty_batch():
    out = sampler(torch.empty(0, 5), metadata([], vocab=5))
    assert out.sampled_token_ids.shape == (0,) and out.logprobs is None


# -- exponential race and seeds ---------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_random_sample_follows_the_distribution(temperature):
    """Rows with logits T * log(q) and temperature T must be sampled from q."""
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    rows = 6000
    logits = (probs.log() * temperature).expand(rows, -1).clone()
    params = [sp(temperature=temperature)] * rows
    tokens = sampler(logits, metadata(params, vocab=6)).sampled_token_ids
    freq = torch.bincount(tokens, minlength=6).double() / rows
    assert freq[4] == 0 and freq[5] == 0  # zero-probability tokens never win the race
    sigma = (probs.double() * (1 - probs.double()) / rows).sqrt()
    assert torch.all((freq - probs.double()).abs() <= 5 * sigma + 1e-12), freq


def _run_seeded(seed, position, neighbours, steps=6, vocab=50):
    """Sample `steps` tokens for a seeded request placed at `position` among `neighbours`."""
    target = sp(temperature=0.9, top_p=0.95, seed=seed)
    gens = {"target": make_generator(seed)}
    for j, p in enumerate(neighbours):
        if p.seed is not None:
            gens[j] = make_generator(p.seed)
    logits_gen = torch.Generator().manual_seed(123)  # same logits for the target every step
    tokens = []
    for _ in range(steps):
        target_logits = torch.randn(vocab, generator=logits_gen)
        params = list(neighbours)
        params.insert(position, target)
        rows = [torch.randn(vocab) for _ in neighbours]
        rows.insert(position, target_logits)
        by_row = {}
        for row, _ in enumerate(params):
            key = "target" if row == position else (row if row < position else row - 1)
            if key in gens:
                by_row[row] = gens[key]
        md = metadata(params, generators=by_row, vocab=vocab)
        tokens.append(int(sampler(torch.stack(rows), md).sampled_token_ids[position]))
    return tokens


def test_seeded_sampling_independent_of_batch():
    alone = _run_seeded(7, 0, [])
    crowd_a = _run_seeded(7, 2, [sp(temperature=1.0), sp(temperature=0.0), sp(temperature=1.2, seed=99)])
    crowd_b = _run_seeded(7, 1, [sp(temperature=0.5, seed=3), sp(temperature=1.0, top_k=3)])
    assert alone == crowd_a == crowd_b
    assert _run_seeded(7, 0, []) == alone
    others = [_run_seeded(s, 0, []) for s in (8, 9, 10)]
    assert any(o != alone for o in others)


def test_missing_generator_for_seeded_row_raises():
    with pytest.raises(ValueError, match="generators"):
        metadata([sp(temperature=1.0, seed=5)])
    # greedy rows with a seed need no generator; a stray generator for an unseeded row is ignored
    md = metadata([sp(temperature=0.0, seed=5), sp(temperature=1.0)], generators={1: make_generator(1)})
    assert md.generators == {}


# -- top-k / top-p / min-p masks --------------------------------------------------------------------

row_values = st.lists(st.floats(-6, 6, allow_nan=False, width=32), min_size=2, max_size=24, unique=True)


def _ref_top_k(row: list[float], k: int) -> list[bool]:
    kth = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [v >= kth for v in row]


def _ref_top_p(row: list[float], keep: list[bool], p: float):
    """Keep a token iff the tokens ranked above it hold < p of the mass (None = too close to call)."""
    weights = [math.exp(v) if k else 0.0 for v, k in zip(row, keep)]
    total = sum(weights)
    result = []
    for v, w in zip(row, weights):
        if w == 0.0:
            result.append(False)
            continue
        above = sum(w2 for v2, w2 in zip(row, weights) if v2 > v) / total
        result.append(None if abs(above - p) < 1e-4 else above < p)
    return result


@settings(max_examples=80, deadline=None)
@given(row_values, st.integers(1, 30))
def test_top_k_mask(row, k):
    logits = torch.tensor([row])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([min(k, len(row))]), None)
    kept = (out > NEG_INF)[0].tolist()
    assert kept == _ref_top_k(row, k)
    assert torch.equal(out[0][out[0] > NEG_INF], logits[0][out[0] > NEG_INF])  # kept values untouched


@settings(max_examples=80, deadline=None)
@given(row_values, st.integers(1, 30), st.floats(0.05, 1.0), st.integers(1, 6))
def test_top_k_top_p_mask(row, k, p, num_candidates):
    k = min(k, len(row))
    expected = _ref_top_p(row, _ref_top_k(row, k), p)
    full_sort = apply_top_k_top_p(torch.tensor([row]), torch.tensor([k]), torch.tensor([p]))
    # the partial-top-k path (falls back to the full sort when the nucleus may not fit)
    partial = apply_top_p(apply_top_k_only(torch.tensor([row]), torch.tensor([k])), torch.tensor([p]),
                          num_candidates=min(num_candidates, len(row) - 1))
    for out in (full_sort, partial):
        kept = (out > NEG_INF)[0].tolist()
        assert kept[row.index(max(row))]  # the most likely token always stays
        for got, want in zip(kept, expected):
            if want is not None:
                assert got == want


def test_top_p_candidate_path_matches_full_sort():
    gen = torch.Generator().manual_seed(10)
    peaked = torch.randn(16, 4096, generator=gen) * 4.0  # small nuclei
    flat = torch.randn(4, 4096, generator=gen) * 0.1  # nuclei of thousands of tokens
    p = torch.tensor([0.5, 0.9, 0.95, 1.0] * 4)
    assert _top_p_from_candidates(peaked.clone(), p, 256) is not None
    assert _top_p_from_candidates(flat.clone(), p[:4], 256) is None
    for logits, pp in ((peaked, p), (flat, p[:4])):
        fast = apply_top_p(logits.clone(), pp, num_candidates=256)
        ref = _top_p_sorted(logits.clone(), pp)
        kept_fast, kept_ref = fast > NEG_INF, ref > NEG_INF
        assert torch.equal(fast[kept_fast], logits[kept_fast])
        assert torch.equal(kept_fast[pp < 1.0], kept_ref[pp < 1.0])
        assert kept_fast[pp == 1.0].all()


@settings(max_examples=80, deadline=None)
@given(row_values, st.floats(0.0, 1.0))
def test_min_p_mask(row, min_p):
    out = apply_min_p(torch.tensor([row]), torch.tensor([min_p]))
    probs = torch.tensor(row, dtype=torch.float64).softmax(0)
    threshold = min_p * probs.max()
    kept = (out > NEG_INF)[0]
    for i in range(len(row)):
        if abs(probs[i] - threshold) > 1e-6:
            assert bool(kept[i]) == bool(probs[i] >= threshold)
    assert kept[int(probs.argmax())]


def test_top_p_keeps_at_least_the_most_likely_token():
    torch.manual_seed(9)
    logits = torch.randn(32, 50)
    out = apply_top_k_top_p(logits.clone(), None, torch.full((32,), 1e-9))
    kept = out > NEG_INF
    assert kept.sum(dim=1).tolist() == [1] * 32
    assert torch.equal(kept.float().argmax(dim=1), logits.argmax(dim=1))


def test_top_k_keeps_ties_at_the_kth_value():
    out = apply_top_k_top_p(torch.tensor([[1.0, 0.0, 0.0, 0.0, -1.0]]), torch.tensor([2]), None)
    assert (out > NEG_INF).tolist() == [[True, True, True, True, False]]


def test_rows_without_filters_are_untouched_in_a_filtered_batch():
    torch.manual_seed(2)
    logits = torch.randn(3, 12)
    k = torch.tensor([3, 12, 12])
    p = torch.tensor([1.0, 0.5, 1.0])
    out = apply_top_k_top_p(logits.clone(), k, p)
    assert torch.equal(out[2], logits[2])
    assert int((out[0] > NEG_INF).sum()) == 3
    assert torch.equal(out[0][out[0] > NEG_INF].sort().values, logits[0].topk(3).values.sort().values)


def _sampled_support(logits_row, params, draws=3000):
    logits = logits_row.expand(draws, -1).clone()
    tokens = sampler(logits, metadata([params] * draws, vocab=logits.shape[1])).sampled_token_ids
    return set(tokens.tolist())


def test_sampler_only_samples_allowed_tokens():
    torch.manual_seed(3)
    row = torch.tensor([3.0, 2.9, 2.8, 2.7, 0.0, -1.0, 1.0, 2.0])
    assert _sampled_support(row, sp(temperature=1.0, top_k=3)) == {0, 1, 2}
    probs = row.softmax(0)  # top_p=0.5: tokens 0, 1 hold < 0.5, token 2 is the one that crosses it
    assert probs[:2].sum() < 0.5 < probs[:3].sum()
    assert _sampled_support(row, sp(temperature=1.0, top_p=0.5)) == {0, 1, 2}
    # min_p=0.3: keep p_i >= 0.3 * p_max, i.e. logit >= 3.0 + ln 0.3 = 1.796
    assert _sampled_support(row, sp(temperature=1.0, min_p=0.3)) == {0, 1, 2, 3, 7}
    # min-p runs before top-p (vLLM order): top-p renormalises over the min-p survivors
    assert _sampled_support(row, sp(temperature=1.0, min_p=0.3, top_p=0.7)) == {0, 1, 2}


# -- temperature, penalties, processors, logprobs ---------------------------------------------------

def test_processed_logprobs_include_temperature_and_masks():
    torch.manual_seed(4)
    logits = torch.randn(2, 10)
    params = [sp(temperature=0.5, logprobs=-1, logprobs_mode="processed_logprobs"),
              sp(temperature=0.5, top_k=4, logprobs=-1, logprobs_mode="processed_logprobs")]
    _, lp = full_logprobs(logits, params)
    assert torch.allclose(lp[0], (logits[0] / 0.5).log_softmax(0), atol=1e-6)
    topk = (logits[1] / 0.5).topk(4)
    expected = torch.full((10,), NEG_INF)
    expected[topk.indices] = topk.values.log_softmax(0)
    assert torch.allclose(lp[1], expected, atol=1e-6)


def test_penalties_hand_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    prompt_counts = token_counts([[0, 0]], 5)
    output_counts = token_counts([[1, 1, 3]], 5)
    assert output_counts.tolist() == [[0, 2, 0, 1, 0]]
    out = apply_penalties(logits.clone(), prompt_counts, output_counts, torch.tensor([0.25]),
                          torch.tensor([0.5]), torch.tensor([2.0]))
    # token 0 (prompt, positive): 2 / 2; token 1 (output x2, negative): -1 * 2 - 0.5 * 2 - 0.25;
    # token 2 unseen; token 3 (output x1, positive): 3 / 2 - 0.5 - 0.25; token 4 unseen
    assert torch.allclose(out, torch.tensor([[1.0, -3.25, 0.5, 0.75, 0.0]]))


def test_penalties_through_the_sampler_and_per_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0], [2.0, -1.0, 0.5, 3.0, 0.0]])
    params = [sp(temperature=0.0, presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0,
                 logprobs=-1, logprobs_mode="processed_logprobs"),
              sp(temperature=0.0, logprobs=-1, logprobs_mode="processed_logprobs")]
    out, lp = full_logprobs(logits, params, outputs=[[1, 1, 3], [1, 1, 3]], prompts=[[0, 0], [0]])
    assert torch.allclose(lp[0], torch.tensor([1.0, -3.25, 0.5, 0.75, 0.0]).log_softmax(0), atol=1e-6)
    assert torch.allclose(lp[1], logits[1].log_softmax(0), atol=1e-6)  # no penalties on row 1
    assert out.sampled_token_ids.tolist() == [0, 3]  # penalties flip row 0's argmax from 3 to 0


def test_repetition_penalty_below_one_rewards_seen_tokens():
    out = apply_penalties(torch.tensor([[1.0, -1.0, 1.0]]), token_counts([[0, 1]], 3),
                          token_counts([[]], 3), torch.zeros(1), torch.zeros(1), torch.tensor([0.5]))
    assert torch.allclose(out, torch.tensor([[2.0, -0.5, 1.0]]))


def test_min_tokens_masks_stop_ids_and_eos():
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.5, 8.0, 0.2]])
    params = sp(temperature=0.0, min_tokens=3, stop_token_ids=[4], logprobs=-1,
                logprobs_mode="processed_logprobs")
    params.update_from_generation_config(2)  # EOS = 2
    out, lp = full_logprobs(logits, [params], outputs=[[1]])
    assert out.sampled_token_ids.tolist() == [1]  # 2 and 4 are banned, 1 is the best left
    assert lp[0, 2] == NEG_INF and lp[0, 4] == NEG_INF
    assert torch.isfinite(lp[0, [0, 1, 3, 5]]).all()
    out, _ = full_logprobs(logits, [params], outputs=[[1, 1, 1]])  # min_tokens reached
    assert out.sampled_token_ids.tolist() == [2]


def test_raw_and_processed_logprobs_differ_exactly_where_a_processor_bans():
    torch.manual_seed(5)
    logits = torch.randn(2, 12)
    banned = [3, 7, 8]

    def ban(output_ids, row):
        row[banned] = NEG_INF
        return row

    raw_p = sp(temperature=1.0, logprobs=-1, logits_processors=[ban])
    proc_p = sp(temperature=1.0, logprobs=-1, logits_processors=[ban], logprobs_mode="processed_logprobs")
    _, lp = full_logprobs(logits, [raw_p, proc_p])
    assert torch.allclose(lp[0], logits[0].log_softmax(0), atol=1e-6)  # raw: before processors
    masked = logits[1].clone()
    masked[banned] = NEG_INF
    assert (lp[1][banned] == NEG_INF).all()
    keep = [i for i in range(12) if i not in banned]
    assert torch.isfinite(lp[1][keep]).all()
    assert torch.allclose(lp[1][keep], masked.log_softmax(0)[keep], atol=1e-6)


def test_logit_bias_changes_processed_not_raw_logprobs():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = {"extra_args": {"logit_bias": {0: 5.0, "3": -100.0}}}
    raw_out, raw = full_logprobs(logits, [sp(temperature=0.0, logprobs=-1, **bias)])
    _, processed = full_logprobs(
        logits, [sp(temperature=0.0, logprobs=-1, logprobs_mode="processed_logprobs", **bias)])
    assert raw_out.sampled_token_ids.tolist() == [0]  # 0 + 5 beats 2
    assert torch.allclose(raw[0], logits[0].log_softmax(0), atol=1e-6)
    assert torch.allclose(processed[0], torch.tensor([5.0, 1.0, 2.0, -97.0]).log_softmax(0), atol=1e-5)


def test_logprobs_gathering_and_ranks():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0],
                           [4.0, 3.0, 2.0, 1.0, 0.0],
                           [0.0, 0.0, 0.0, 5.0, 0.0]])
    params = [sp(temperature=0.0, logprobs=2), sp(temperature=0.0, logprobs=3), sp(temperature=0.0)]
    md = metadata(params, vocab=5)
    assert md.max_num_logprobs == 3
    out = sampler(logits, md)
    lt = out.logprobs
    assert lt.logprob_token_ids.shape == (3, 4)
    lsm = logits.log_softmax(1)
    assert lt.topk_token_ids[0].tolist() == [1, 3, 2] and lt.topk_token_ids[1].tolist() == [0, 1, 2]
    assert torch.allclose(lt.topk_logprobs[0], lsm[0, [1, 3, 2]])
    assert lt.selected_token_ranks.tolist() == [1, 1, 1]
    lists = to_logprobs_list(out, [p.logprobs for p in params])
    assert lists[2] is None
    # sampled token first, then the top-k without repeating it
    assert lists[0].token_ids == [1, 3] and lists[0].sampled_rank == 1
    assert lists[1].token_ids == [0, 1, 2]
    assert lists[0].logprobs == pytest.approx(lsm[0, [1, 3]].tolist())


def test_sampled_rank_and_logprob_of_a_non_top_token():
    logprobs = torch.tensor([[-0.5, -1.0, -3.0, -2.0, -4.0]])
    lt = gather_logprobs(logprobs, 2, torch.tensor([3]))
    assert lt.selected_token_ranks.tolist() == [3]
    assert lt.logprob_token_ids.tolist() == [[3, 0, 1]]
    assert lt.sampled_logprobs.tolist() == [-2.0]
    [lp] = to_logprobs_list(SamplerOutput(torch.tensor([3]), lt), [2])
    assert lp == Logprobs(token_ids=[3, 0, 1], logprobs=[-2.0, -0.5, -1.0], sampled_rank=3)


def test_logprobs_zero_and_whole_vocab():
    logits = torch.tensor([[0.0, 2.0, 1.0], [1.0, 0.0, 2.0]])
    params = [sp(temperature=0.0, logprobs=0), sp(temperature=0.0, logprobs=-1)]
    out = sampler(logits, metadata(params, vocab=3))
    lists = to_logprobs_list(out, [0, -1])
    assert lists[0].token_ids == [1] and lists[0].sampled_rank == 1
    assert lists[1].token_ids == [2, 0, 1]
    assert lists[1].logprobs == pytest.approx(logits[1, [2, 0, 1]].log_softmax(0).tolist())


def test_sampled_logprob_is_that_of_the_random_token():
    torch.manual_seed(6)
    logits = torch.full((64, 6), -3.0)
    params = [sp(temperature=1.0, top_k=4, logprobs=1, logprobs_mode="processed_logprobs")] * 64
    logits[:, :4] = torch.tensor([1.0, 0.5, 0.0, -0.5])
    out = sampler(logits, metadata(params, vocab=6))
    expected = torch.tensor([1.0, 0.5, 0.0, -0.5]).log_softmax(0)
    sampled = out.sampled_token_ids
    assert (sampled < 4).all()
    assert torch.allclose(out.logprobs.sampled_logprobs, expected[sampled])
    assert torch.equal(out.logprobs.selected_token_ranks, sampled + 1)


# -- prompt logprobs --------------------------------------------------------------------------------

def test_prompt_logprobs_whole_prompt_and_chunks_agree():
    torch.manual_seed(7)
    prompt = [5, 1, 7, 7, 2, 0]
    logits = torch.randn(len(prompt), 9)
    whole = compute_prompt_logprobs(logits, prompt, 2)
    assert len(whole) == len(prompt) and whole[0] is None
    lsm = logits.log_softmax(1)
    for t in range(1, len(prompt)):
        entry = whole[t]
        assert entry.token_ids[0] == prompt[t]
        assert entry.logprobs[0] == pytest.approx(float(lsm[t - 1, prompt[t]]))
        assert entry.sampled_rank == int((lsm[t - 1] >= lsm[t - 1, prompt[t]]).sum())
        top2 = lsm[t - 1].topk(2).indices.tolist()
        assert entry.token_ids[1:] == [i for i in top2 if i != prompt[t]]
    chunks = (compute_prompt_logprobs(logits[:2], prompt, 2, start_pos=0)
              + compute_prompt_logprobs(logits[2:5], prompt, 2, start_pos=2)
              + compute_prompt_logprobs(logits[5:], prompt, 2, start_pos=5))
    assert chunks == whole
    assert compute_prompt_logprobs(logits[:1], [3], 1) == [None]


# -- the executor's greedy fast path (gpu/step_sampler.py) -------------------------------------------

def _rows(params, outputs_len=0):
    from servetwin.core.engine.runner_state import CachedRequestState, ScheduledRow
    rows = []
    for i, p in enumerate(params):
        st = CachedRequestState(f"r{i}", [5, 6, 7] + [1] * outputs_len, 3, ([0],), p)
        rows.append(ScheduledRow(f"r{i}", st, len(st.token_ids) - 1, 1))
    return rows


def test_plain_greedy_detection():
    from servetwin.gpu.step_sampler import is_plain_greedy
    plain = SamplingParams(temperature=0.0)
    assert is_plain_greedy(_rows([plain])[0])
    not_plain = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, extra_args={"logit_bias": {3: 5.0}}),
        SamplingParams(temperature=0.0, logits_processors=[lambda out, row: row]),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[2]),
    ]
    for p in not_plain:
        assert not is_plain_greedy(_rows([p])[0]), p
    # min_tokens already reached: the min-tokens processor would do nothing
    assert is_plain_greedy(_rows([SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])], 2)[0])


@given(st.integers(1, 9), st.integers(2, 300), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_greedy_fast_path_equals_the_general_sampler(num_reqs, vocab, seed):
    """All-plain-greedy batches skip the metadata and the sampler; the tokens are the same (ties too)."""
    from servetwin.gpu.step_sampler import StepSampler
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, vocab, generator=g)
    logits[:, ::7] = logits.max()  # ties: argmax must pick the first, as the sampler's does
    params = [SamplingParams(temperature=0.0) for _ in range(num_reqs)]
    rows = _rows(params)
    fast, lps = StepSampler(torch.device("cpu"), vocab).sample(rows, logits.clone())
    md = SamplingMetadata.from_requests(params, [[] for _ in rows], [[5, 6, 7] for _ in rows], {}, vocab)
    assert fast == sampler(logits.clone(), md).sampled_token_ids.tolist() and lps is None


def test_greedy_rows_mixed_with_others_take_the_general_path():
    from servetwin.gpu.step_sampler import StepSampler
    logits = torch.tensor([[0.0, 1.0, 0.5], [2.0, 0.0, 1.9]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, extra_args={"logit_bias": {2: 1.0}})]
    toks, _ = StepSampler(torch.device("cpu"), 3).sample(_rows(params), logits)
    assert toks == [1, 2]  # the bias flips row 1's argmax: the fast path must not have been taken


def test_greedy_sampler_does_not_copy_when_nothing_edits_the_logits():
    """The general sampler's all-greedy path skips the float32 copy yet never edits the caller's logits."""
    logits = torch.randn(3, 11)
    before = logits.clone()
    md = metadata([SamplingParams(temperature=0.0)] * 3, vocab=11)
    out = sampler(logits, md)
    assert torch.equal(logits, before) and out.sampled_token_ids.tolist() == before.argmax(-1).tolist()
    md = metadata([SamplingParams(temperature=0.0, logprobs=2, logprobs_mode="processed_logprobs")] * 3, vocab=11)
    out = sampler(logits, md)
    assert torch.equal(logits, before)
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], before.log_softmax(-1).gather(1, out.sampled_token_ids[:, None])[:, 0])
