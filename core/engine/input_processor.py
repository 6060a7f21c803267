"""Prompt handling and request validation done in the caller, as vLLM's input processor does."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from servetwin.core.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]
NO_LOGPROBS_BACKENDS = ("fake", "sim")


def check_priority(priority: Any, policy: str) -> None:
    """vLLM refuses a request priority the scheduler would ignore (policy 'fcfs')."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority: got {priority} but the engine schedules {policy!r}; priorities need "
                         "policy='priority' (servetwin serve --policy priority)")


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: Optional[int],
                 eos_token_ids: Optional[list[int]] = None, max_logprobs: int = 20,
                 logprobs_backend: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids or []
        self.max_logprobs = max_logprobs
        # the `fake` and `sim` executors sample fake tokens without logits: asking them for logprobs
        # is refused rather than answered with empty lists
        self.no_logprobs_backend = logprobs_backend if logprobs_backend in NO_LOGPROBS_BACKENDS else None

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer and this engine has none "
                                 "(skip_tokenizer_init=True, or a model without tokenizer files): give token "
                                 "ids, or a tokenizer=...")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt: must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in ids):
            raise ValueError("prompt_token_ids: must be a list of integers")
        if self.vocab_size is None:  # a backend without a vocabulary (fake, sim): ids are still >= 0
            bad = next((t for t in ids if t < 0), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids: token id {bad} is negative")
        else:
            for t in ids:
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt_token_ids: token id {t} is out of vocabulary "
                                     f"(size {self.vocab_size})")
        return list(ids)

    def process(self, prompt: PromptType, params: Optional[SamplingParams]) -> ProcessedPrompt:
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: the prompt is {len(ids)} tokens long; max_model_len is "
                             f"{self.max_model_len} and at least one output token must fit")
        params = (params or SamplingParams()).clone()
        if self.no_logprobs_backend is not None:
            for name in ("logprobs", "prompt_logprobs"):
                if getattr(params, name) is not None:
                    raise ValueError(f"{name}: the {self.no_logprobs_backend} backend samples fake tokens and "
                                     "computes no logprobs (use the torch backend)")
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
            if params.min_tokens > params.max_tokens:
                raise ValueError(f"min_tokens: {params.min_tokens} exceeds the {params.max_tokens} tokens "
                                 "left after the prompt")
        params.update_from_generation_config(self.eos_token_ids)
        if self.vocab_size is not None:
            params.verify(self.vocab_size, self.max_logprobs)
        return ProcessedPrompt(text, ids, params)
