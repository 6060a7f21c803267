"""Glue between the executor's rows and the sampler (`gpu/sampler.py`): sampling metadata,
per-request seeded generators, logprobs and prompt logprobs as `servetwin.core.outputs.Logprobs`.

A step whose sampling rows are all plain greedy (`is_plain_greedy`: no logprobs, penalties, logit
bias, per-request processors or pending min_tokens) skips the metadata and the sampler: its tokens
are the argmax of the float32 logits, which is what the sampler returns for such rows.

If `gpu/sampler.py` is absent a minimal greedy / temperature sampler is used (no penalties,
top-k/p or logprobs).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from servetwin.core.outputs import Logprobs
from servetwin.core.engine.runner_state import ScheduledRow
from servetwin.core.sampling_params import SamplingParams, SamplingType
from servetwin.gpu.cpu_kernels import greedy_argmax

logger = logging.getLogger(__name__)

try:
    from servetwin.gpu.logits_processors import _logit_bias_of
    from servetwin.gpu.sampler import Sampler, compute_prompt_logprobs, to_logprobs_list
    from servetwin.gpu.sampling_metadata import SamplingMetadata, make_generator
    HAVE_SAMPLER = True
except ModuleNotFoundError as e:  # only a missing module; a broken sampler must fail loudly
    if e.name not in ("servetwin.gpu.sampler", "servetwin.gpu.sampling_metadata", "servetwin.gpu.logits_processors"):
        raise
    HAVE_SAMPLER = False

_GREEDY = SamplingParams(temperature=0.0)
_EPS = 1e-5


def _params(row: ScheduledRow) -> SamplingParams:
    p = row.state.sampling_params
    return _GREEDY if p is None else p


def is_plain_greedy(row: ScheduledRow) -> bool:
    """Greedy with nothing that could change the argmax or ask for more than the token: no logprobs,
    no penalties, no logit bias, no per-request logits processors, min_tokens reached. For such
    rows the sampler's answer is exactly `logits.argmax(-1)` (its processors and penalties are
    no-ops, and greedy sampling is the argmax of the float32 logits)."""
    p = _params(row)
    if p.sampling_type != SamplingType.GREEDY or p.logprobs is not None or p.logits_processors:
        return False
    if abs(p.presence_penalty) >= _EPS or abs(p.frequency_penalty) >= _EPS or abs(p.repetition_penalty - 1.0) >= _EPS:
        return False
    st = row.state
    if p.min_tokens and len(st.token_ids) - st.num_prompt_tokens < p.min_tokens:
        return False
    return not HAVE_SAMPLER or _logit_bias_of(p) is None


class StepSampler:
    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device, self.vocab_size = device, vocab_size
        self.generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler() if HAVE_SAMPLER else None
        if not HAVE_SAMPLER:
            logger.warning("servetwin.gpu.sampler not found: using the fallback greedy/temperature sampler")

    def forget(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self.generators.pop(rid, None)

    def _generator(self, row: ScheduledRow) -> Optional[torch.Generator]:
        p = _params(row)
        if p.seed is None or p.temperature < 1e-5:
            return None
        gen = self.generators.get(row.req_id)
        if gen is None:
            gen = (make_generator(p.seed, self.device) if HAVE_SAMPLER
                   else torch.Generator(device=self.device).manual_seed(p.seed))
            self.generators[row.req_id] = gen
        return gen

    def sample(self, rows: Sequence[ScheduledRow],
               logits: torch.Tensor) -> tuple[list[int], Optional[list[Optional[Logprobs]]]]:
        """Sample one token per row (rows = the requests that sample this step, logits row-aligned)."""
        if not rows:
            return [], None
        if all(is_plain_greedy(r) for r in rows):  # fast path: no metadata, no copy, no softmax
            return greedy_argmax(logits).tolist(), None
        gens = {i: g for i, r in enumerate(rows) if (g := self._generator(r)) is not None}
        if self.sampler is None:
            return self._fallback(rows, logits, gens), None
        params = [_params(r) for r in rows]
        md = SamplingMetadata.from_requests(
            params, [list(r.state.output_token_ids) for r in rows],
            [r.state.token_ids[:r.state.num_prompt_tokens] for r in rows], gens, logits.shape[1],
            device=logits.device)
        out = self.sampler(logits, md)
        token_ids = out.sampled_token_ids.tolist()
        if out.logprobs is None:
            return token_ids, None
        return token_ids, to_logprobs_list(out, md.num_logprobs)

    @staticmethod
    def _fallback(rows: Sequence[ScheduledRow], logits: torch.Tensor,
                  gens: dict[int, torch.Generator]) -> list[int]:
        out = []
        for i, r in enumerate(rows):
            t = _params(r).temperature
            if t < 1e-5:
                out.append(int(logits[i].argmax()))
            else:
                probs = torch.softmax(logits[i].float() / t, dim=-1)
                out.append(int(torch.multinomial(probs, 1, generator=gens.get(i))))
        return out

    @staticmethod
    def wants_prompt_logprobs(row: ScheduledRow) -> bool:
        return HAVE_SAMPLER and row.is_prefill and _params(row).prompt_logprobs is not None

    @staticmethod
    def prompt_logprobs(row: ScheduledRow, chunk_logits: torch.Tensor) -> list[Optional[Logprobs]]:
        """Entries for this prefill chunk (raw logits of every scheduled position of the chunk)."""
        st = row.state
        return compute_prompt_logprobs(chunk_logits, st.token_ids[:st.num_prompt_tokens],
                                       _params(row).prompt_logprobs, start_pos=row.num_computed_before)
