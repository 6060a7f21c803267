"""The n-gram (prompt lookup) drafter, as vLLM 0.33's `NgramProposer` (v1/spec_decode/ngram_proposer.py).

For each request that sampled this step, the longest suffix of its tokens of length in
[`prompt_lookup_min`, `prompt_lookup_max`] that occurs earlier in the same tokens is found (a KMP
pass over the reversed sequence), and the (up to) k tokens that followed that earlier occurrence
are the drafts. Among matches of the longest length the earliest occurrence wins, as in vLLM
(`_find_longest_matched_ngram_and_propose_tokens`: `prev_lps >= longest_ngram` keeps moving back).
No drafts when the request is at `max_model_len` or nothing matches.
"""
from __future__ import annotations

from collections.abc import Sequence


def find_longest_matched_ngram(tokens: Sequence[int], min_n: int, max_n: int, max_model_len: int,
                               k: int) -> list[int]:
    """The drafts for one request's tokens (vLLM's function of the same purpose, line for line)."""
    total = len(tokens)
    if total < min_n:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n  # KMP failure function of the reversed sequence, first max_n entries
    longest, position, prev_lps, i = 0, 0, 0, 1
    while i < total:
        if rev[prev_lps] == rev[i]:
            prev_lps += 1
            if prev_lps >= longest:  # a match ending at reversed position i (earlier in the original)
                longest, position = prev_lps, i
            if i < max_n:
                lps[i] = prev_lps
            if prev_lps == max_n:  # never longer than max_n: fall back as if mismatching
                prev_lps = lps[max_n - 1]
            i += 1
        elif prev_lps:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return list(tokens[start:start + min(k, total - start)])


class NgramProposer:
    def __init__(self, k: int, prompt_lookup_min: int, prompt_lookup_max: int, max_model_len: int) -> None:
        self.k, self.min_n, self.max_n, self.max_model_len = k, prompt_lookup_min, prompt_lookup_max, max_model_len

    def propose(self, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Drafts for each request, given its tokens (prompt + every accepted output token)."""
        return [find_longest_matched_ngram(list(t), self.min_n, self.max_n, self.max_model_len, self.k)
                for t in token_ids]
