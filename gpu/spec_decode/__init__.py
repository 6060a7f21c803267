"""Speculative decoding in the torch backend: the drafters (n-gram, draft model) and verification."""
from __future__ import annotations

from typing import Any

import torch

from servetwin.core.config_error import ConfigError
from servetwin.core.sched.spec_decode import SpeculativeConfig


def make_drafter(config: SpeculativeConfig, vocab_size: int, max_model_len: int, device: torch.device,
                 dtype: torch.dtype) -> Any:
    """The drafter of `config.method` (an object with `propose(token_ids) -> drafts per request`)."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        from servetwin.gpu.spec_decode.ngram_proposer import NgramProposer  # noqa: PLC0415
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max, max_model_len)
    if config.method == "draft_model":
        from servetwin.gpu.spec_decode.draft_model import DraftModelProposer  # noqa: PLC0415
        return DraftModelProposer(config.model, k, vocab_size, max_model_len, device, dtype)
    raise ConfigError("speculative_config.method", f"the torch backend drafts with ngram or draft_model, not "
                                                   f"{config.method!r} (eagle / mtp need a trained draft head)")
