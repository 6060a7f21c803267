"""Speculative decoding as vLLM 0.33's scheduler sees it: the config it derives and its statistics.

The scheduler runs no drafter. It only needs what vLLM's `SpeculativeConfig` / `VllmConfig` derive
from the method and `num_speculative_tokens` (k) (vLLM 0.33 `config/vllm.py:612-695`,
`config/speculative.py:2058-2194`):
- `ngram`: no lookahead slots, no prefill lookahead;
- `eagle` / `mtp` (vLLM's `use_eagle()`): `num_lookahead_tokens = k` (the drafter writes KV past the
  verified range), prefill lookahead 1 and, with prefix caching, one lookahead token in every block
  hash (`num_hash_lookahead_tokens`).
`SpecDecodingStats` is vLLM's per-step record (`v1/spec_decode/metrics.py:17-50`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from servetwin.core.config_error import ConfigError

SPEC_METHODS = ("ngram", "eagle", "mtp")
EAGLE_METHODS = ("eagle", "mtp")  # vLLM's use_eagle(): drafting from the target's hidden states


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys the scheduler reads (`method`, `num_speculative_tokens`)."""
    num_speculative_tokens: int
    method: str = "ngram"

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError("num_speculative_tokens", f"must be an integer >= 1, got {k!r}")
        if self.method not in SPEC_METHODS:
            raise ConfigError("method", f"must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")

    @property
    def use_eagle(self) -> bool:
        return self.method in EAGLE_METHODS

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the scheduled tokens (`VllmConfig.num_lookahead_tokens`)."""
        return self.num_speculative_tokens if self.use_eagle else 0

    @property
    def num_prefill_lookahead_tokens(self) -> int:
        """Prefill tokens past the computed range the drafter reads: 1 for the eagle family (a
        single-module MTP included); vLLM's multi-module MTP needs a draft model config we lack."""
        return 1 if self.use_eagle else 0

    def num_hash_lookahead_tokens(self, enable_prefix_caching: bool, has_kv_connector: bool = False) -> int:
        """Tokens after each block that its hash covers (eagle / mtp with prefix caching; a KV
        connector keeps the legacy hashes, config/vllm.py:677-693)."""
        return self.num_prefill_lookahead_tokens if enable_prefix_caching and not has_kv_connector else 0

    def use_eagle_block_drop(self, num_hash_lookahead_tokens: int) -> bool:
        """Whether a prefix-cache hit drops its last block (eagle / mtp, unless hashes look ahead:
        sched:330-345)."""
        return self.use_eagle and not num_hash_lookahead_tokens

    def check(self, max_num_batched_tokens: int, async_scheduling: bool) -> None:
        """vLLM's config-time rejections (`config/vllm.py:1651-1680`; `_set_max_num_scheduled_tokens`)."""
        if self.method == "ngram" and async_scheduling:
            raise ConfigError("method", "vLLM 0.33 rejects async scheduling with ngram speculative decoding "
                              "(V1 model runner); use eagle / mtp or sync scheduling")
        if self.use_eagle and max_num_batched_tokens <= self.num_lookahead_tokens:
            raise ConfigError("num_speculative_tokens", f"{self.num_speculative_tokens} must be below "
                              f"max_num_batched_tokens ({max_num_batched_tokens}) for {self.method}")


@dataclass(slots=True)
class SpecDecodingStats:
    """Drafts verified in one update (vLLM's `SpecDecodingStats`; `num_draft_tokens` counts padded
    -1 drafts too, as vLLM does)."""
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens,
                   num_draft_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        assert num_accepted_tokens <= min(num_draft_tokens, self.num_spec_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
        for i in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[i] += 1

    def merge(self, other: "SpecDecodingStats") -> None:
        """Add another step's counts (the scheduler's stats aggregate the updates since the last read)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n
        for i, n in enumerate(other.num_draft_tokens_per_pos):
            self.num_draft_tokens_per_pos[i] += n

    def to_dict(self) -> dict:
        """The replay's `spec_decoding` record (the oracle's four fields)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}


def spec_decode_step_blocks(num_spec_tokens: int, num_lookahead_tokens: int, block_sizes: list[int]) -> int:
    """Blocks one spec-decode step may need in every group (vLLM's `_spec_decode_step_blocks`,
    sched:371-381; it reserves them when admitting an async KV load)."""
    if not num_spec_tokens:
        return 0
    tokens = 1 + num_spec_tokens + num_lookahead_tokens
    return sum(-(-tokens // bs) for bs in block_sizes)


@dataclass(slots=True)
class DraftTokenIds:
    """A drafter's proposals for the requests of the batch it ran on (vLLM's `v1/outputs.py` struct)."""
    req_ids: list[str]
    draft_token_ids: list[list[int]]
