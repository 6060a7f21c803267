"""The draft-model drafter (vLLM's `method: "draft_model"`): a small causal LM of the target's
vocabulary proposes k tokens greedily after each request's tokens.

It runs through HF transformers (`AutoModelForCausalLM`), on the target's device and dtype, with a
KV cache across its k steps of one proposal; each proposal re-reads the batch's tokens (no paged
draft cache: the tiny drafts this backend runs on the CPU make that cheap; a draft KV cache that
persists across steps is what vLLM has and this lacks). Any model the registry
resolves works (`tiny-llama`, a local HF directory, `smollm2-135m`); its vocabulary must be the
target's (vLLM's rule for draft models).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from servetwin.core.config_error import ConfigError
from servetwin.gpu.models.registry import resolve_model


class DraftModelProposer:
    def __init__(self, model: str, k: int, vocab_size: int, max_model_len: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        info = resolve_model(model)
        draft_vocab = info.decoder_config.vocab_size
        if draft_vocab != vocab_size:
            raise ConfigError("speculative_config.model", f"draft model {model!r} has a vocabulary of "
                                                          f"{draft_vocab}, the target's is {vocab_size}")
        self.model = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=dtype).to(device).eval()
        self.k, self.max_model_len, self.device = k, max_model_len, device

    @torch.inference_mode()
    def propose(self, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """k greedy tokens after each request's tokens, all requests in one batch (left-padded, with
        an attention mask and positions counted from each request's first real token)."""
        if not token_ids:
            return []
        width = max(len(t) for t in token_ids)
        ids = torch.tensor([[0] * (width - len(t)) + list(t) for t in token_ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in token_ids], device=self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        steps = []
        for j in range(self.k):
            nxt = out.logits[:, -1].argmax(-1)
            steps.append(nxt)
            if j + 1 == self.k:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, cache=out.cache,
                             use_cache=True)
        drafts = torch.stack(steps, dim=1).tolist()
        # no drafts past max_model_len (vLLM's drafters stop there too)
        return [d[:max(0, self.max_model_len - len(t))] for d, t in zip(drafts, token_ids)]
