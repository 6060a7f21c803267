"""The torch backend's drafters and verification, one rule at a time (no model)."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from servetwin.gpu.spec_decode.ngram_proposer import NgramProposer, find_longest_matched_ngram
from servetwin.gpu.spec_decode.rejection_sampler import greedy_verify, random_verify, target_probs


def brute_force_ngram(tokens: list[int], lo: int, hi: int, max_model_len: int, k: int) -> list[int]:
    """The definition vLLM's KMP pass computes: the longest suffix (length in [lo, hi]) that also
    occurs earlier, ending before the last token; among equals the earliest occurrence; the k
    tokens after it (k cut by max_model_len)."""
    total = len(tokens)
    k = min(k, max_model_len - total)
    if total < lo or k <= 0:
        return []
    for n in range(min(hi, total - 1), lo - 1, -1):
        suffix = tokens[total - n:]
        for s in range(0, total - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=30), lo=st.integers(1, 3), extra=st.integers(0, 3),
       k=st.integers(1, 5), room=st.integers(0, 3))
def test_ngram_proposer_is_the_longest_earliest_suffix_match(tokens, lo, extra, k, room):
    hi = lo + extra
    mml = len(tokens) + room
    assert find_longest_matched_ngram(tokens, lo, hi, mml, k) == brute_force_ngram(tokens, lo, hi, mml, k)


def test_ngram_proposer_examples():
    p = NgramProposer(k=3, prompt_lookup_min=2, prompt_lookup_max=3, max_model_len=100)
    # suffix [5, 6] first occurs at 0: the drafts are what followed it
    assert p.propose([[5, 6, 7, 8, 9, 5, 6]]) == [[7, 8, 9]]
    assert p.propose([[1, 2, 3, 4]]) == [[]]  # no earlier occurrence
    assert p.propose([[7, 7, 7]]) == [[7]]  # the drafts stop at the sequence's end


def test_greedy_verify_accepts_the_matching_prefix():
    assert greedy_verify([4, 5, 6], [4, 5, 9], bonus_token=1) == [4, 5, 9]
    assert greedy_verify([4, 5, 6], [4, 5, 6], bonus_token=1) == [4, 5, 6, 1]
    assert greedy_verify([-1, -1], [0, 0], bonus_token=3) == [0]  # padded drafts are never accepted


def test_random_verify_keeps_the_target_distribution():
    """One draft, target p = [0.5, 0.3, 0.2], the draft is token 0 (one-hot q): the first emitted
    token is distributed as p (accepted w.p. p[0], else drawn from p without token 0)."""
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    g = torch.Generator().manual_seed(0)
    n = 6000
    counts = torch.zeros(3)
    for _ in range(n):
        counts[random_verify([0], probs, bonus_token=2, generator=g)[0]] += 1
    assert torch.allclose(counts / n, probs[0], atol=0.03)


def test_target_probs_applies_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.allclose(target_probs(logits, 1.0), torch.softmax(logits, -1))
    assert (target_probs(logits, 1.0, top_k=2)[0, 2:] == 0).all()
    p = target_probs(logits, 1.0, top_p=0.5)  # the top token alone holds >= 0.5 of the mass
    assert p[0, 0] == 1.0
