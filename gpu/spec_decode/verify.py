"""The verify step of one batch: each drafting row's k+1 scheduled tokens went through the paged model
in the step's one forward; here the logits at the drafts' positions decide which drafts stand."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from servetwin.core.engine.runner_state import ScheduledRow
from servetwin.gpu.spec_decode.rejection_sampler import greedy_verify, random_verify, target_probs
from servetwin.gpu.step_sampler import is_plain_greedy

GREEDY_TEMPERATURE = 1e-5  # servetwin.core.sampling_params: below this, sampling is greedy


def can_verify(row: ScheduledRow) -> bool:
    """Whether this backend verifies the row's drafts: greedy rows the sampler answers with the argmax
    (`is_plain_greedy`), and random rows shaped by temperature, top-k and top-p alone (no seed,
    logprobs, penalties, min_p, min_tokens pending, logits processors or extra args). Any other row
    rejects its drafts unseen and samples at its first draft position with the full sampler, as it
    would without speculation (`first_positions`)."""
    p = row.state.sampling_params
    if p is None or is_plain_greedy(row):
        return True
    if p.temperature < GREEDY_TEMPERATURE or p.seed is not None or p.logprobs is not None or p.min_p > 0:
        return False
    if p.logits_processors or p.extra_args:
        return False
    if abs(p.presence_penalty) > 0 or abs(p.frequency_penalty) > 0 or p.repetition_penalty != 1.0:
        return False
    return not p.min_tokens or len(row.state.output_token_ids) >= p.min_tokens


def first_positions(rows: Sequence[ScheduledRow], logits_indices: np.ndarray) -> np.ndarray:
    """`logits_indices` with each drafting row this backend does not verify moved back to the token
    before its drafts (where decoding without drafts samples)."""
    out = logits_indices.copy()
    for i, r in enumerate(rows):
        if r.spec_token_ids and not can_verify(r):
            out[i] -= len(r.spec_token_ids)
    return out


def draft_positions(rows: Sequence[ScheduledRow], sample_idx: Sequence[int], logits_indices) -> list[int]:
    """Flat token indices whose logits verify the drafts: for row i with m drafts, the m tokens
    before its last scheduled token (the last one's logits give the bonus token)."""
    out = []
    for i in sample_idx:
        m = len(rows[i].spec_token_ids) if can_verify(rows[i]) else 0
        last = int(logits_indices[i])
        out.extend(range(last - m, last))
    return out


def verify_rows(rows: Sequence[ScheduledRow], sample_idx: Sequence[int], bonus_tokens: Sequence[int],
                draft_logits: Optional[torch.Tensor], generator: Optional[torch.Generator] = None) -> list[list[int]]:
    """Tokens each sampling row emits (row order of `sample_idx`): accepted drafts + one more."""
    out, at = [], 0
    for j, i in enumerate(sample_idx):
        row, bonus = rows[i], bonus_tokens[j]
        drafts = row.spec_token_ids
        if not drafts or not can_verify(row):  # sampled before its drafts (first_positions)
            out.append([int(bonus)])
            continue
        logits = draft_logits[at:at + len(drafts)]
        at += len(drafts)
        p = row.state.sampling_params
        if p is None or is_plain_greedy(row):
            out.append(greedy_verify(drafts, logits.argmax(dim=-1).tolist(), bonus))
        else:
            probs = target_probs(logits, p.temperature, p.top_k, p.top_p)
            out.append(random_verify(drafts, probs, bonus, generator))
    return out
