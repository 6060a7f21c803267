"""Speculative decoding as vLLM 0.33's scheduler sees it: the config it derives and its statistics.

The scheduler runs no drafter. It only needs what vLLM's `SpeculativeConfig` / `VllmConfig` derive
from the method and `num_speculative_tokens` (k) (vLLM 0.33 `config/vllm.py:612-695`,
`config/speculative.py:2058-2194`):
- `ngram`: no lookahead slots, no prefill lookahead;
- `eagle` / `mtp` (vLLM's `use_eagle()`): `num_lookahead_tokens = k` (the drafter writes KV past the
  verified range), prefill lookahead 1 and, with prefix caching, one lookahead token in every block
  hash (`num_hash_lookahead_tokens`);
- `draft_model` (`uses_draft_model()`): `num_lookahead_tokens = k`, no prefill or hash lookahead
  (config/vllm.py:626-675).
The drafters' own keys (`prompt_lookup_min/max` for ngram, `model` for draft_model) are parsed here
too, with vLLM's defaults (config/speculative.py:1302-1326), and read only by the backends.
`SpecDecodingStats` is vLLM's per-step record (`v1/spec_decode/metrics.py:17-50`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from servetwin.core.config_error import ConfigError

SPEC_METHODS = ("ngram", "eagle", "mtp", "draft_model")
EAGLE_METHODS = ("eagle", "mtp")  # vLLM's use_eagle(): drafting from the target's hidden states
SPECULATIVE_CONFIG_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys: `method` and `num_speculative_tokens` (what the scheduler
    reads), `prompt_lookup_min/max` (ngram) and `model` (draft_model), which only drafters read."""
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not _positive_int(k):
            raise ConfigError("num_speculative_tokens", f"must be an integer >= 1, got {k!r}")
        if self.method not in SPEC_METHODS:
            raise ConfigError("method", f"must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if self.method == "ngram":
            self._ngram_window()
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ConfigError("model", f"draft_model needs the draft model's name or path, got {self.model!r}")

    def _ngram_window(self) -> None:
        """vLLM's defaults: both unset -> 5 and 5; one set -> the other copies it (speculative.py:1302-1326)."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and not _positive_int(v):
                raise ConfigError(name, f"must be an integer >= 1, got {v!r}")
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ConfigError("prompt_lookup_min", f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def from_dict(cls, raw: Any) -> "SpeculativeConfig":
        """Parse vLLM's `speculative_config` dict (LLM(...), --speculative-config JSON, experiment YAML);
        an unknown key or a bad value is a `ConfigError` naming it."""
        if isinstance(raw, cls):
            return raw
        if isinstance(raw, str):  # `--speculative-config '{"method": "ngram", ...}'`, as vLLM's CLI
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError("speculative_config", f"not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError("speculative_config", f"must be a mapping, got {type(raw).__name__}")
        for key in raw:
            if key not in SPECULATIVE_CONFIG_KEYS:
                raise ConfigError(f"speculative_config.{key}",
                                  f"unknown key; allowed: {', '.join(SPECULATIVE_CONFIG_KEYS)}")
        if "num_speculative_tokens" not in raw:
            raise ConfigError("speculative_config.num_speculative_tokens", "required")
        try:
            return cls(**raw)
        except ConfigError as e:
            raise e.within("speculative_config") from None
        except TypeError as e:  # a wrong type reached a comparison
            raise ConfigError("speculative_config", str(e)) from None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def use_eagle(self) -> bool:
        return self.method in EAGLE_METHODS

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the scheduled tokens (`VllmConfig.num_lookahead_tokens`)."""
        return self.num_speculative_tokens if self.use_eagle or self.uses_draft_model else 0

    @property
    def num_prefill_lookahead_tokens(self) -> int:
        """Prefill tokens past the computed range the drafter reads: 1 for the eagle family (a
        single-module MTP included); vLLM's multi-module MTP needs a draft model config we lack."""
        return 1 if self.use_eagle else 0

    def num_hash_lookahead_tokens(self, enable_prefix_caching: bool) -> int:
        """Tokens after each block that its hash covers (eagle / mtp with prefix caching)."""
        return self.num_prefill_lookahead_tokens if enable_prefix_caching else 0

    def check(self, max_num_batched_tokens: int, async_scheduling: bool) -> None:
        """vLLM's config-time rejections (`config/vllm.py:1651-1680`; `_set_max_num_scheduled_tokens`)."""
        if self.method == "ngram" and async_scheduling:
            raise ConfigError("method", "vLLM 0.33 rejects async scheduling with ngram speculative decoding "
                              "(V1 model runner); use eagle / mtp or sync scheduling")
        if self.num_lookahead_tokens and max_num_batched_tokens <= self.num_lookahead_tokens:
            raise ConfigError("num_speculative_tokens", f"{self.num_speculative_tokens} must be below "
                              f"max_num_batched_tokens ({max_num_batched_tokens}) for {self.method}")


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


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
