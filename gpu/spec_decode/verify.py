"""The verify step of one batch: each drafting row's k+1 scheduled tokens went through the paged model
in the step's one forward; here the logits at the drafts' positions decide which drafts stand."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from servetwin.core.engine.runner_state import ScheduledRow
from servetwin.gpu.spec_decode.rejection_sampler import greedy_verify, random_verify, target_probs
from servetwin.gpu.step_sampler import is_plain_greedy


def draft_positions(rows: Sequence[ScheduledRow], sample_idx: Sequence[int], logits_indices) -> list[int]:
    """Flat token indices whose logits verify the drafts: for row i with m drafts, the m tokens
    before its last scheduled token (the last one's logits give the bonus token)."""
    out = []
    for i in sample_idx:
        m = len(rows[i].spec_token_ids)
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
        if not drafts:
            out.append([int(bonus)])
            continue
        logits = draft_logits[at:at + len(drafts)]
        at += len(drafts)
        p = row.state.sampling_params
        if p is None or is_plain_greedy(row) or p.temperature < 1e-5:
            out.append(greedy_verify(drafts, logits.argmax(dim=-1).tolist(), bonus))
        else:
            probs = target_probs(logits, p.temperature, p.top_k, p.top_p)
            out.append(random_verify(drafts, probs, bonus, generator))
    return out
