"""Incremental detokenisation and stop strings, applied on the text in the caller (vLLM 3.2)."""
from __future__ import annotations

from typing import Any, Optional


class IncrementalDetokenizer:
    """Decodes a request's output tokens and checks stop strings on the newly added text only.

    Decoding the whole output each step keeps multi-byte characters right; only the suffix that
    changed is searched (plus `max(len(stop)) - 1` characters of overlap).
    """

    def __init__(self, tokenizer: Any, params: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: Optional[str] = None
        self._max_stop = max((len(s) for s in params.stop), default=0)

    def update(self, new_token_ids: list[int]) -> bool:
        """Add tokens; returns True when a stop string ended the request (text already truncated)."""
        if not new_token_ids:
            return False
        self.token_ids.extend(new_token_ids)
        if not self.params.detokenize or self.tokenizer is None:
            return False
        prev_len = len(self.output_text)
        self.output_text = self.tokenizer.decode(self.token_ids,
                                                 skip_special_tokens=self.params.skip_special_tokens)
        if not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            return False
        return self._check_stop_strings(prev_len)

    def _check_stop_strings(self, prev_len: int) -> bool:
        text = self.output_text
        search_from = max(0, prev_len - self._max_stop + 1)
        best: Optional[tuple[int, str]] = None
        for stop in self.params.stop:
            idx = text.find(stop, search_from)
            if idx != -1 and (best is None or idx + len(stop) < best[0] + len(best[1])):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.output_text = text[:end]
        self.stop_reason = stop
        self._trim_tokens(idx + len(stop))
        return True

    def _trim_tokens(self, text_end: int) -> None:
        """Drop surplus tokens after the one that completed the stop string."""
        for k in range(1, len(self.token_ids) + 1):
            decoded = self.tokenizer.decode(self.token_ids[:k], skip_special_tokens=self.params.skip_special_tokens)
            if len(decoded) >= text_end:
                del self.token_ids[k:]
                return

    def visible_text(self, finished: bool) -> str:
        """Streaming holds back characters that could still become a stop string."""
        if finished or not self.params.stop or self.params.include_stop_str_in_output:
            return self.output_text
        hold = self._max_stop - 1
        return self.output_text[:-hold] if hold > 0 else self.output_text
