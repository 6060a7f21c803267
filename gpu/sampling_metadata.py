"""Batched sampling parameters for one step (vLLM v1 `vllm/v1/sample/metadata.py`).

`SamplingMetadata.from_requests` turns the step's per-request `SamplingParams` (rows in batch order)
into tensors. Seeded requests need a generator that lives as long as the request: create it once
with `make_generator(seed, device)` when the request is added and pass it every step, keyed by the
request's row index in that step, so a seeded request draws the same noise whatever its neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Optional, Sequence

import torch

from servetwin.core.sampling_params import SamplingParams, SamplingType
from servetwin.gpu.logits_processors import BatchUpdate, LogitsProcessors, build_logitsprocs

_SAMPLING_EPS = 1e-5


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator seeded once (draws differ between CPU and CUDA for one seed)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def resolve_num_logprobs(n: Optional[int], vocab_size: int) -> Optional[int]:
    """-1 means the whole vocabulary; larger requests are clipped to it."""
    if n is None:
        return None
    return vocab_size if n == -1 else min(n, vocab_size)


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """`[num_reqs, vocab_size]` int64 occurrence counts (one bincount; ids outside the vocab ignored)."""
    num_reqs = len(token_ids)
    lengths = torch.tensor([len(t) for t in token_ids], dtype=torch.long)
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(num_reqs), lengths)
    valid = (flat >= 0) & (flat < vocab_size)
    counts = torch.bincount(rows[valid] * vocab_size + flat[valid], minlength=num_reqs * vocab_size)
    return counts.view(num_reqs, vocab_size).to(device)


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, row i = request i of the batch."""
    temperature: Optional[torch.Tensor]  # [B] float32; None when all rows are greedy
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]  # [B] float32; None when no row uses top-p (off rows hold 1.0)
    top_k: Optional[torch.Tensor]  # [B] int64; None when no row uses top-k (off rows hold vocab)
    min_p: Optional[torch.Tensor]  # [B] float32; None when no row uses min-p (off rows hold 0.0)
    generators: dict[int, torch.Generator]  # row index -> generator, seeded random rows only
    max_num_logprobs: Optional[int]  # K: max requested across the batch (-1 resolved); None if none
    num_logprobs: list[Optional[int]]  # per row, -1 resolved to vocab_size
    processed_logprobs_mask: Optional[torch.Tensor]  # [B] bool: rows wanting processed logprobs
    any_raw_logprobs: bool  # some row requested logprobs in "raw_logprobs" mode
    no_penalties: bool
    presence_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    prompt_token_counts: Optional[torch.Tensor]  # [B, V] int64; None when no_penalties
    output_token_counts: Optional[torch.Tensor]  # [B, V] int64; None when no_penalties
    output_token_ids: list[list[int]]
    logitsprocs: LogitsProcessors
    vocab_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.output_token_ids)

    @classmethod
    def from_requests(cls, params: list[SamplingParams], output_token_ids: list[list[int]],
                      prompt_token_ids: list[list[int]], generators: dict[int, torch.Generator],
                      vocab_size: int, device: torch.device | str = "cpu",
                      logitsprocs: Optional[LogitsProcessors] = None) -> "SamplingMetadata":
        """Build the step's tensors.

        `generators` maps row index -> the request's persistent generator; every seeded random row
        must have one (others are ignored). `logitsprocs`: persistent processors whose
        `update_state` the caller already ran for this step; when None, fresh built-ins are made
        and fed the whole batch.
        """
        _check_lengths(params, output_token_ids, prompt_token_ids)
        device = torch.device(device)
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        temperature = None if all_greedy else _f32([p.temperature for p in params], device)
        num_logprobs = [resolve_num_logprobs(p.logprobs, vocab_size) for p in params]
        requested = [n for n in num_logprobs if n is not None]
        processed = [n is not None and p.logprobs_mode == "processed_logprobs"
                     for p, n in zip(params, num_logprobs)]
        any_raw = any(n is not None and not pr for n, pr in zip(num_logprobs, processed))
        penalties = _penalty_fields(params, prompt_token_ids, output_token_ids, vocab_size, device)
        if logitsprocs is None:
            logitsprocs = build_logitsprocs(device, vocab_size)
            logitsprocs.update_state(BatchUpdate.from_batch(params, prompt_token_ids, output_token_ids))
        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=_top_p(params, greedy, device),
            top_k=_top_k(params, greedy, vocab_size, device),
            min_p=_min_p(params, greedy, device),
            generators=_seeded_generators(params, generators),
            max_num_logprobs=max(requested) if requested else None,
            num_logprobs=num_logprobs,
            processed_logprobs_mask=torch.tensor(processed, device=device) if any(processed) else None,
            any_raw_logprobs=any_raw,
            output_token_ids=output_token_ids,
            logitsprocs=logitsprocs,
            vocab_size=vocab_size,
            **penalties,
        )


def _check_lengths(params: Sequence[SamplingParams], output_token_ids: Sequence[list[int]],
                   prompt_token_ids: Sequence[list[int]]) -> None:
    if not len(params) == len(output_token_ids) == len(prompt_token_ids):
        raise ValueError(
            "from_requests: params, output_token_ids and prompt_token_ids must have one entry per "
            f"request, got {len(params)}, {len(output_token_ids)} and {len(prompt_token_ids)}.")


def _f32(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _top_p(params: Sequence[SamplingParams], greedy: Sequence[bool],
           device: torch.device) -> Optional[torch.Tensor]:
    values = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
    return _f32(values, device) if any(v < 1.0 for v in values) else None


def _top_k(params: Sequence[SamplingParams], greedy: Sequence[bool], vocab_size: int,
           device: torch.device) -> Optional[torch.Tensor]:
    values = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size)
              for p, g in zip(params, greedy)]
    if all(v == vocab_size for v in values):
        return None
    return torch.tensor(values, dtype=torch.long, device=device)


def _min_p(params: Sequence[SamplingParams], greedy: Sequence[bool],
           device: torch.device) -> Optional[torch.Tensor]:
    values = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
    return _f32(values, device) if any(v > 0.0 for v in values) else None


def _seeded_generators(params: Sequence[SamplingParams],
                       generators: dict[int, torch.Generator]) -> dict[int, torch.Generator]:
    seeded = {i for i, p in enumerate(params) if p.sampling_type == SamplingType.RANDOM_SEED}
    missing = sorted(seeded - generators.keys())
    if missing:
        raise ValueError(
            f"generators: rows {missing} have a seed but no generator; create one per request with "
            "make_generator(seed, device) when it is added and pass it every step.")
    return {i: g for i, g in generators.items() if i in seeded}


def _penalty_fields(params: Sequence[SamplingParams], prompt_token_ids: Sequence[list[int]],
                    output_token_ids: Sequence[list[int]], vocab_size: int,
                    device: torch.device) -> dict:
    presence = [float(p.presence_penalty) for p in params]
    frequency = [float(p.frequency_penalty) for p in params]
    repetition = [float(p.repetition_penalty) for p in params]
    no_penalties = (all(abs(v) < _SAMPLING_EPS for v in presence + frequency)
                    and all(abs(v - 1.0) < _SAMPLING_EPS for v in repetition))
    return dict(
        no_penalties=no_penalties,
        presence_penalties=_f32(presence, device),
        frequency_penalties=_f32(frequency, device),
        repetition_penalties=_f32(repetition, device),
        prompt_token_counts=None if no_penalties else token_counts(prompt_token_ids, vocab_size, device),
        output_token_counts=None if no_penalties else token_counts(output_token_ids, vocab_size, device),
    )
