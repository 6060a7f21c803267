"""Verification of a row's drafts against the target model's logits (vLLM 0.33
v1/sample/rejection_sampler.py), for drafters that give no draft probabilities (ngram, and our
greedy draft model: vLLM passes `draft_probs=None` for both, i.e. a one-hot draft distribution).

- greedy rows: draft j is accepted while it equals the target's argmax at its position; the first
  mismatch emits the target's argmax there; all accepted: the bonus token (sampled at the last
  position by the ordinary sampler) follows. Outputs are exactly those of decoding without drafts.
- random rows: draft j is accepted with probability p_j(d_j) (min(1, p/q) with q one-hot); at the
  first rejection a recovered token is drawn from max(p_j - q_j, 0) normalised (p_j without d_j);
  all accepted: the bonus token follows. The output distribution is the target's.
A padded -1 draft is never accepted.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch


def greedy_verify(drafts: Sequence[int], target_argmax: Sequence[int], bonus_token: int) -> list[int]:
    """Tokens a greedy row emits: the accepted drafts, then the target's token at the first mismatch
    (or the bonus token when every draft matched)."""
    out = []
    for d, t in zip(drafts, target_argmax):
        if d != t:
            return out + [int(t)]
        out.append(int(d))
    return out + [int(bonus_token)]


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Per-position target distributions [m, V] after temperature, top-k and top-p, as vLLM applies
    them before rejection sampling (`apply_sampling_constraints`)."""
    logits = logits.float() / max(temperature, 1e-5)
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.softmax(logits, dim=-1)


def random_verify(drafts: Sequence[int], probs: torch.Tensor, bonus_token: int,
                  generator: Optional[torch.Generator] = None) -> list[int]:
    """Tokens a random row emits (`probs`: [len(drafts), V] target distributions at the drafts'
    positions); the bonus token comes from the ordinary sampler at the last position."""
    out = []
    for j, d in enumerate(drafts):
        p = probs[j]
        u = torch.rand((), generator=generator, device=p.device)
        if d >= 0 and float(u) < float(p[d]):
            out.append(int(d))
            continue
        residual = p.clone()
        if d >= 0:
            residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # the draft held all the mass: p itself (vLLM's clamp)
            residual = p
        return out + [int(torch.multinomial(residual, 1, generator=generator))]
    return out + [int(bonus_token)]
