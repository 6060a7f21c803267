"""The sampler of the torch backend (vLLM v1 `vllm/v1/sample/sampler.py` semantics, own code).

One call, for `[num_reqs, vocab]` logits (the last position of each sampling request):

1. Raw logprobs = log_softmax(logits) if any row asked for logprobs in "raw_logprobs" mode.
2. Logits to float32 (a copy, so the caller's tensor is never modified; skipped when every row is
   greedy and no penalty or active processor edits the logits: that path never writes to them).
3. Non-argmax-invariant logits processors, in order: min-tokens (stop ids and EOS -> -inf while
   `len(output) < min_tokens`), logit bias, per-request callables, then custom ones.
4. Penalties: repetition (tokens seen in prompt or output: positive logits divided, negative
   multiplied), then frequency (- f * output count) and presence (- p * [count > 0]) on outputs.
5. Greedy rows: argmax of these logits. If every row is greedy, processed logprobs are
   log_softmax of these logits and sampling stops here.
6. Temperature (greedy rows divide by 1), min-p, argmax-invariant custom processors, then top-k
   and top-p (sorted cumulative mass, at least one token kept).
7. Processed logprobs = log_softmax of the logits of step 6 (greedy rows: unchanged by step 6).
8. Random rows: exponential race `argmax(probs / q)`, `q ~ Exp(1)`; seeded rows draw their row of
   `q` from their own generator, the others from the default generator.
9. Top-K logprobs (K = max requested in the batch), the sampled token's logprob and its rank.

This is vLLM v1's order: penalties come *after* the logits processors, min-p *before* top-k/top-p,
and "processed_logprobs" for random rows include temperature, min-p and top-k/top-p (vLLM's
documented meaning of "processed": after all processing, temperature and top-k/top-p included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from servetwin.core.outputs import Logprobs
from servetwin.gpu.cpu_kernels import greedy_argmax
from servetwin.gpu.logits_processors import (AdapterLogitsProcessor, LogitBiasLogitsProcessor, LogitsProcessor, MinTokensLogitsProcessor)
from servetwin.gpu.sampling_metadata import _SAMPLING_EPS, SamplingMetadata, resolve_num_logprobs


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled (or prompt) token, columns 1..K the top-K, best first."""
    logprob_token_ids: torch.Tensor  # [N, K + 1] int64
    logprobs: torch.Tensor  # [N, K + 1] float32
    selected_token_ranks: torch.Tensor  # [N] int64, 1 = most likely (ties count as better)

    @property
    def sampled_logprobs(self) -> torch.Tensor:
        return self.logprobs[:, 0]

    @property
    def topk_token_ids(self) -> torch.Tensor:
        return self.logprob_token_ids[:, 1:]

    @property
    def topk_logprobs(self) -> torch.Tensor:
        return self.logprobs[:, 1:]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: Optional[LogprobsTensors]


# -- ops --------------------------------------------------------------------------------------------

def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def apply_penalties(logits: torch.Tensor, prompt_token_counts: torch.Tensor,
                    output_token_counts: torch.Tensor, presence_penalties: torch.Tensor,
                    frequency_penalties: torch.Tensor,
                    repetition_penalties: torch.Tensor) -> torch.Tensor:
    """In place: repetition on prompt|output tokens, then frequency and presence on outputs."""
    output_mask = output_token_counts > 0
    seen = (prompt_token_counts > 0) | output_mask
    penalties = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits.mul_(torch.where(logits > 0, 1.0 / penalties, penalties))
    logits.sub_(frequency_penalties.unsqueeze(1) * output_token_counts)
    logits.sub_(presence_penalties.unsqueeze(1) * output_mask)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor, all_random: bool) -> torch.Tensor:
    """In place; greedy rows (temperature < 1e-5) are divided by 1."""
    if not all_random:
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drop tokens whose probability is below `min_p * max probability`."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """In place: keep logits >= the k-th largest of their row (ties at the k-th value kept)."""
    vocab = logits.shape[1]
    off = k >= vocab
    k = k.clamp(min=1).masked_fill(off, 1)  # rows without top-k: gather anything, then ignore
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_(off.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: Optional[torch.Tensor],
                      p: Optional[torch.Tensor]) -> torch.Tensor:
    """Top-k, then top-p over the survivors. Top-p drops a token when the tokens ranked above it
    already hold >= p of the mass (vLLM: ascending cumulative mass <= 1 - p); the most likely token
    always stays. May edit `logits` in place."""
    if k is not None:
        logits = apply_top_k_only(logits, k)
    if p is None:
        return logits
    return apply_top_p(logits, p)


_TOP_P_CANDIDATES = 1024


def apply_top_p(logits: torch.Tensor, p: torch.Tensor,
                num_candidates: Optional[int] = None) -> torch.Tensor:
    """Top-p. On CPU it first tries the `num_candidates` best tokens of each row (a partial top-k
    instead of a full-vocabulary sort); if some row's nucleus does not fit, it sorts everything."""
    num_candidates = _TOP_P_CANDIDATES if num_candidates is None else num_candidates
    if logits.device.type == "cpu" and num_candidates < logits.shape[1]:
        out = _top_p_from_candidates(logits, p, num_candidates)
        if out is not None:
            return out
    return _top_p_sorted(logits, p)


def _top_p_sorted(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    top_p_mask = cum_probs <= 1.0 - p.unsqueeze(1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits.scatter_(1, logits_idx, logits_sort)


def _top_p_from_candidates(logits: torch.Tensor, p: torch.Tensor,
                           num_candidates: int) -> Optional[torch.Tensor]:
    """Same mask as `_top_p_sorted` (up to float rounding) when every nucleus lies within the top
    `num_candidates`; None otherwise. Rows with p >= 1 are left as they are."""
    values, indices = logits.topk(num_candidates, dim=-1)  # sorted, best first
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
    mass_above = probs.cumsum(dim=-1) - probs
    keep = mass_above < p.unsqueeze(1)
    keep[:, 0] = True
    active = p < 1.0
    if bool((keep[:, -1] & active).any()):
        return None  # some nucleus may reach past the candidates
    values.masked_fill_(~keep, float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter_(1, indices, values)
    return torch.where(active.unsqueeze(1), out, logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(probs / q), q ~ Exp(1); the same as sampling from `probs`."""
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for i, gen in generators.items():
        q[i].exponential_(generator=gen)
    q.clamp_(min=torch.finfo(q.dtype).tiny)  # never divide by 0 (0/0 would be NaN)
    return probs.div_(q).argmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Top-`num_logprobs` of each row plus the logprob and rank of `token_ids` (int64)."""
    topk_logprobs, topk_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat((token_ids, topk_ids), dim=1),
        logprobs=torch.cat((token_logprobs, topk_logprobs), dim=1),
        selected_token_ranks=ranks,
    )


# -- the sampler ------------------------------------------------------------------------------------

class Sampler:
    """`Sampler()(logits, metadata) -> SamplerOutput`; logits `[num_reqs, vocab]`, row i = request i."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, metadata)

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != md.num_reqs:
            raise ValueError(f"logits must be [num_reqs={md.num_reqs}, vocab], got {tuple(logits.shape)}.")
        if md.num_reqs == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.long, device=logits.device), None)
        wants_logprobs = md.max_num_logprobs is not None
        raw_logprobs = compute_logprobs(logits) if wants_logprobs and md.any_raw_logprobs else None
        if md.all_greedy and md.no_penalties and not _edits_logits(md.logitsprocs.non_argmax_invariant):
            # greedy, nothing edits the logits (the greedy path is in-place free): no float32 copy
            logits = logits.to(torch.float32)
        else:
            logits = logits.to(torch.float32, copy=True)
        logits = self.apply_logits_processors(logits, md)
        sampled, processed_logprobs = self.sample(logits, md)
        if not wants_logprobs:
            return SamplerOutput(sampled, None)
        logprobs = _merge_logprobs(raw_logprobs, processed_logprobs, md.processed_logprobs_mask)
        return SamplerOutput(sampled, gather_logprobs(logprobs, md.max_num_logprobs, sampled))

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        for proc in md.logitsprocs.non_argmax_invariant:
            logits = proc.apply(logits)
        if not md.no_penalties:
            logits = apply_penalties(logits, md.prompt_token_counts, md.output_token_counts,
                                     md.presence_penalties, md.frequency_penalties,
                                     md.repetition_penalties)
        return logits

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns (sampled ids int64, processed logprobs or None)."""
        wants_processed = md.processed_logprobs_mask is not None
        greedy_sampled = None if md.all_random else greedy_argmax(logits)
        if md.all_greedy:
            return greedy_sampled, compute_logprobs(logits) if wants_processed else None
        logits = apply_temperature(logits, md.temperature, md.all_random)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        for proc in md.logitsprocs.argmax_invariant:
            logits = proc.apply(logits)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        processed = compute_logprobs(logits) if wants_processed else None
        random_sampled = random_sample(logits.softmax(dim=-1, dtype=torch.float32), md.generators)
        if greedy_sampled is None:
            return random_sampled, processed
        return torch.where(md.temperature < _SAMPLING_EPS, greedy_sampled, random_sampled), processed


def _edits_logits(procs: Sequence[LogitsProcessor]) -> bool:
    """Whether any of these processors would change the logits this step (unknown kinds: assume so)."""
    for proc in procs:
        if isinstance(proc, MinTokensLogitsProcessor):
            active = bool(proc.min_toks)
        elif isinstance(proc, LogitBiasLogitsProcessor):
            active = bool(proc.biases)
        elif isinstance(proc, AdapterLogitsProcessor):
            active = bool(proc.req_info)
        else:
            active = True
        if active:
            return True
    return False


def _merge_logprobs(raw: Optional[torch.Tensor], processed: Optional[torch.Tensor],
                    processed_rows: Optional[torch.Tensor]) -> torch.Tensor:
    if processed is None:
        return raw
    if raw is None:
        return processed
    return torch.where(processed_rows.unsqueeze(1), processed, raw)


# -- to servetwin.core.outputs.Logprobs -----------------------------------------------------------------------

def _row_to_logprobs(ids: list[int], lps: list[float], rank: int, n: int) -> Logprobs:
    """Sampled token first, then the top-n without repeating it (vLLM's dict, as lists)."""
    token_ids, logprobs = [ids[0]], [lps[0]]
    for tok, lp in zip(ids[1:n + 1], lps[1:n + 1]):
        if tok != ids[0]:
            token_ids.append(tok)
            logprobs.append(lp)
    return Logprobs(token_ids=token_ids, logprobs=logprobs, sampled_rank=rank)


def logprobs_tensors_to_list(tensors: LogprobsTensors,
                             num_logprobs_per_row: Sequence[Optional[int]]) -> list[Optional[Logprobs]]:
    width = tensors.logprob_token_ids.shape[1] - 1
    ids = tensors.logprob_token_ids.tolist()
    lps = tensors.logprobs.tolist()
    ranks = tensors.selected_token_ranks.tolist()
    out: list[Optional[Logprobs]] = []
    for i, n in enumerate(num_logprobs_per_row):
        if n is None:
            out.append(None)
            continue
        n = width if n == -1 else min(n, width)
        out.append(_row_to_logprobs(ids[i], lps[i], ranks[i], n))
    return out


def to_logprobs_list(output: SamplerOutput,
                     num_logprobs_per_req: Sequence[Optional[int]]) -> list[Optional[Logprobs]]:
    """Per request: None if it asked for no logprobs, else `Logprobs` with `token_ids[0]` = the
    sampled token, then its top-k (k = its own `logprobs`; -1 = all K gathered) without repeating
    the sampled token; `sampled_rank` is 1-based. So k or k + 1 entries, like vLLM's dict."""
    if output.logprobs is None:
        return [None] * len(num_logprobs_per_req)
    return logprobs_tensors_to_list(output.logprobs, num_logprobs_per_req)


# -- prompt logprobs --------------------------------------------------------------------------------

def compute_prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int], num_logprobs: int,
                            start_pos: int = 0) -> list[Optional[Logprobs]]:
    """Prompt logprobs of one request from raw logits (vLLM computes them before any processing).

    `logits[j]` are the logits at prompt position `start_pos + j` (a whole prompt or one prefill
    chunk). Entry for prompt token t (t >= 1) comes from the logits at position t - 1: the logprob
    of `prompt_token_ids[t]`, its rank and the top-`num_logprobs` (-1 = whole vocabulary). The
    first prompt token has no entry, so the result starts with None when `start_pos == 0`;
    positions whose next token is not in the prompt (the last one) are skipped. Concatenating the
    chunks' results gives vLLM's list of len(prompt) entries.
    """
    num_prompt = len(prompt_token_ids)
    num_valid = max(0, min(logits.shape[0], num_prompt - 1 - start_pos))
    head: list[Optional[Logprobs]] = [None] if start_pos == 0 and num_prompt > 0 else []
    if num_valid == 0:
        return head
    k = resolve_num_logprobs(num_logprobs, logits.shape[1])
    targets = torch.tensor(prompt_token_ids[start_pos + 1:start_pos + 1 + num_valid],
                           dtype=torch.long, device=logits.device)
    tensors = gather_logprobs(compute_logprobs(logits[:num_valid]), k, targets)
    return head + logprobs_tensors_to_list(tensors, [k] * num_valid)


__all__ = [
    "LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "apply_min_p",
    "apply_penalties", "apply_temperature", "apply_top_k_only", "apply_top_k_top_p", "apply_top_p",
    "compute_logprobs", "compute_prompt_logprobs", "gather_logprobs", "logprobs_tensors_to_list",
    "random_sample", "to_logprobs_list",
]
