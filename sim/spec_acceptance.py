"""How many drafts a simulated verify step accepts: per-position acceptance rates.

`AcceptanceModel.rates[i]` is the probability that draft i is accepted given that drafts 0..i-1 were
(the last rate repeats for later positions), so a verify step with m drafts accepts a prefix of them:
`P(a >= i) = rates[0] * ... * rates[i-1]`. This is what vLLM's spec-decode metrics measure:
`vllm:spec_decode_num_accepted_tokens_per_pos[i] / vllm:spec_decode_num_drafts` estimates
`P(a > i)`, so `from_spec_decode_metrics` fits a model from a real run's counters.

Draws are deterministic: the same seed, request id and step give the same count (a sha256, as the
recorded oracle's `{"seed": S}` acceptance does), so simulated runs are reproducible. The simulator
never reads the host clock or a global RNG for them.

Defaults (`DEFAULT_ACCEPTANCE`), from published measurements; each is a fit, not a law - acceptance
depends on the model pair, the data and the temperature, so measure and fit where you can:
- `mtp`: DeepSeek-V3's MTP module accepts the second token 85-90% of the time (DeepSeek-V3
  Technical Report, arXiv:2412.19437, section 5.4.3): rates[0] = 0.875. Reused for later positions
  its acceptance falls; the original DeepSeek-V3-0324 MTP module reaches a mean acceptance length
  tau = 3.20 with K = 7 at temperature 0 over MT-bench, HumanEval and GSM8K (model card of
  nebius/MTP-DeepSeek-V3-0324, "Original MTP"), which a constant later rate of 0.616 reproduces.
- `eagle3`: the public EAGLE-3 head for Llama-3.1-8B-Instruct (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)
  reaches tau = 2.77 with K = 7 at temperature 1 on MT-bench (comparison table in the model card of
  nebius/EAGLE3-Llama-3.3-70B-Instruct); a constant rate of 0.651 reproduces it. The EAGLE-3 paper
  (arXiv:2503.01840) reports longer accepted lengths with tree drafting, which vLLM's chain
  drafting does not do.
- `ngram`: no per-position measurement was found. Prompt-lookup decoding (A. Saxena, 2023,
  github.com/apoorvumang/prompt-lookup-decoding) reports 2-4x speedups on input-grounded tasks
  (summarisation, document QA, code editing) and little on open chat. The default, a constant 0.5
  (tau = 1.875 at k = 3), is a placeholder for a moderately grounded workload: set your own.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

from servetwin.core.config_error import ConfigError


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    rates: tuple[float, ...]  # P(draft i accepted | drafts before it accepted); the last one repeats
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates:
            raise ConfigError("rates", "must list at least one acceptance rate")
        for i, r in enumerate(self.rates):
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
                raise ConfigError(f"rates[{i}]", f"must be a probability in [0, 1], got {r!r}")

    def rate(self, position: int) -> float:
        return self.rates[min(position, len(self.rates) - 1)]

    def prob_at_least(self, i: int) -> float:
        """P(a >= i): the first i drafts are all accepted."""
        p = 1.0
        for j in range(i):
            p *= self.rate(j)
        return p

    def expected_accepted(self, num_drafts: int) -> float:
        return sum(self.prob_at_least(i) for i in range(1, num_drafts + 1))

    def mean_acceptance_length(self, num_drafts: int) -> float:
        """Tokens a verify step with `num_drafts` drafts yields on average (the accepted ones + 1)."""
        return 1.0 + self.expected_accepted(num_drafts)

    def num_accepted(self, request_id: str, step: int, num_drafts: int) -> int:
        """The accepted count of one verify step: a prefix, drawn from a stable hash."""
        digest = hashlib.sha256(f"{self.seed}:{request_id}:{step}".encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2**64
        a = 0
        while a < num_drafts and u < self.prob_at_least(a + 1):
            a += 1
        return a

    @classmethod
    def from_spec_decode_metrics(cls, num_drafts: int, num_accepted_tokens_per_pos: Sequence[int],
                                 seed: int = 0) -> "AcceptanceModel":
        """Fit from vLLM's counters (`vllm:spec_decode_num_drafts`,
        `vllm:spec_decode_num_accepted_tokens_per_pos`): rate i = accepted at i / accepted at i-1."""
        if num_drafts <= 0 or not num_accepted_tokens_per_pos:
            raise ConfigError("num_drafts", "needs at least one draft and one position")
        rates, before = [], num_drafts
        for i, n in enumerate(num_accepted_tokens_per_pos):
            if n < 0 or n > before:
                raise ConfigError(f"num_accepted_tokens_per_pos[{i}]", f"{n} is outside [0, {before}] "
                                  "(a position is accepted only after every one before it)")
            rates.append(n / before if before else 0.0)
            before = n
        return cls(tuple(rates), seed)


def constant_rate_for(tau: float, num_drafts: int, first: Optional[float] = None) -> float:
    """The constant rate r for which the model `(first, r, r, ...)` - `(r, r, ...)` without `first` -
    has mean acceptance length `tau` with `num_drafts` drafts (bisection; how the defaults were fitted)."""
    def tau_of(r: float) -> float:
        rates = (r,) if first is None else (first, r)
        return AcceptanceModel(rates).mean_acceptance_length(num_drafts)

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_of(mid) < tau else (lo, mid)
    return (lo + hi) / 2


DEFAULT_ACCEPTANCE: dict[str, AcceptanceModel] = {
    "mtp": AcceptanceModel((0.875, 0.616)),
    "eagle3": AcceptanceModel((0.651,)),
    "eagle": AcceptanceModel((0.651,)),  # vLLM's "eagle" method with an EAGLE-3 head: the same fit
    "ngram": AcceptanceModel((0.5,)),
}
