"""`SamplingParams` with vLLM 0.33.0's normalisation and validation (docs/scheduler_behaviour.md §B.1).

Every validation error is a `ValueError` naming the field and the bad value.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Optional, Union

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2
MAX_LOGPROB_TOKEN_IDS = 128
MAX_N_SEQUENCES = 16384
MAX_STOP_STRINGS_API = 4  # OpenAI-compatible layer cap (VLLM_MAX_STOP_STRINGS)


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs"
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_reading_prefix_cache: Optional[bool] = None
    logits_processors: Optional[list[Any]] = None  # per-request callables (vLLM adapter shape)
    extra_args: Optional[dict[str, Any]] = None
    # derived
    output_text_buffer_length: int = field(default=0, init=False)
    _eos_token_id: Optional[int] = field(default=None, init=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        if self.temperature is not None and 0 < self.temperature < _MAX_TEMP:
            warnings.warn(f"temperature {self.temperature} is below {_MAX_TEMP}; set to {_MAX_TEMP}",
                          stacklevel=3)
            self.temperature = _MAX_TEMP
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n != 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got n={self.n}.")
        self._all_stop_token_ids.update(self.stop_token_ids)
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None

    def _verify_args(self) -> None:
        def bad(name: str, value: Any, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {name}={value!r}.")

        if not _is_int(self.n):
            raise bad("n", self.n, "must be an int")
        if not 1 <= self.n <= MAX_N_SEQUENCES:
            raise bad("n", self.n, f"must be in [1, {MAX_N_SEQUENCES}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise bad(name, v, "must be in [-2, 2]")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0.0:
            raise bad("repetition_penalty", rp, "must be a finite number > 0")
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or not 0.0 <= t <= 2.0:
            raise bad("temperature", t, "must be a finite number in [0, 2]")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an int >= -1 (0 or -1 disables it)")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an int >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got min_tokens={self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or (v < 0 and v != -1)):
                raise bad(name, v, "must be -1 (whole vocabulary) or an int >= 0")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", self.seed, "must be an int")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):  # token ids are never negative
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of ints >= 0")
        if not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", self.stop, "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise bad("stop", self.stop, "cannot contain an empty string")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True, "
                             f"got stop={self.stop!r} with detokenize=False.")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise bad("logprobs_mode", self.logprobs_mode,
                      "must be 'raw_logprobs' or 'processed_logprobs'")

    # -- derived views -------------------------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @all_stop_token_ids.setter
    def all_stop_token_ids(self, ids: set[int]) -> None:
        """Restore the set computed in another process (`servetwin.core.engine.messages`)."""
        self._all_stop_token_ids = set(ids)

    def update_from_generation_config(self, eos_token_ids: Optional[list[int] | int]) -> None:
        """Apply the model's EOS ids (primary first), as vLLM's input processor does."""
        if eos_token_ids is None:
            return
        ids = [eos_token_ids] if _is_int(eos_token_ids) else list(eos_token_ids)
        if not ids:
            return
        primary, extra = ids[0], ids[1:]
        if not self.ignore_eos:
            self._eos_token_id = primary
        self._all_stop_token_ids.add(primary)
        for t in extra:
            self._all_stop_token_ids.add(t)
            if not self.ignore_eos and t not in self.stop_token_ids:
                self.stop_token_ids.append(t)

    def verify(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Checks that need the model (vLLM's input processor)."""
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v == -1:
                v = vocab_size
            if v is not None and v > limit:
                raise ValueError(f"{name}: requested {v} logprobs, more than max_logprobs={limit}.")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids: token id {t} is out of vocabulary (size {vocab_size}).")

    def clone(self) -> "SamplingParams":
        new = copy.copy(self)
        new._all_stop_token_ids = set(self._all_stop_token_ids)
        new.stop_token_ids = list(self.stop_token_ids)
        return new
