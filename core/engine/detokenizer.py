"""Incremental detokenisation and stop strings, applied on the text in the caller (vLLM 3.2).

Each new token costs a decode of a short window of ids, not of the whole output (vLLM's incremental
detokenizer, `detokenize_incrementally` with prefix / read offsets): `token_ids[prefix_offset:read_offset]`
is the context already turned into text, `token_ids[prefix_offset:]` the same context plus the tokens
not yet turned into text. The difference of the two decodes is the new text. Decoding with a few
tokens of context keeps what depends on neighbours right (a leading space a tokenizer strips at the
start of a text, spaces cleaned up before punctuation); a window whose text ends in U+FFFD (a
multi-byte character split over tokens) waits for the next token, and the end of the request flushes
what is still waiting. So the text equals `tokenizer.decode(token_ids)` (tested with Hypothesis) at
O(new tokens) per step. Stop strings are searched in the newly added text only (plus
`max(len(stop)) - 1` characters of overlap).
"""
from __future__ import annotations

from typing import Any, Optional

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a request's output tokens and checks stop strings on the newly added text only."""

    def __init__(self, tokenizer: Any, params: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: Optional[str] = None
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self.prefix_offset = 0  # first token of the decode context
        self.read_offset = 0  # tokens before it are in output_text
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _decode_next(self, final: bool = False) -> str:
        """Text that the tokens from read_offset on add (empty while a character is incomplete)."""
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        prefix_len = len(self._prefix_text)
        if not final and (len(new_text) <= prefix_len or new_text.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or a multi-byte character continues in the next token
        delta = new_text[prefix_len:]
        self._prefix_text = self._decode(self.token_ids[self.read_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return delta

    def update(self, new_token_ids: list[int]) -> bool:
        """Add tokens; returns True when a stop string ended the request (text already truncated)."""
        if not new_token_ids:
            return False
        if not self.params.detokenize or self.tokenizer is None:
            self.token_ids.extend(new_token_ids)
            return False
        prev_len = len(self.output_text)
        n_before = len(self.token_ids)
        text_ends: list[int] = []  # output_text length after each new token (to trim after a stop string)
        pieces: list[str] = []
        length = prev_len
        for tid in new_token_ids:
            self.token_ids.append(tid)
            piece = self._decode_next()
            if piece:
                pieces.append(piece)
                length += len(piece)
            text_ends.append(length)
        if pieces:
            self.output_text += "".join(pieces)
        if not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            return False
        return self._check_stop_strings(prev_len, n_before, text_ends)

    def _check_stop_strings(self, prev_len: int, n_before: int, text_ends: list[int]) -> bool:
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
        # drop the surplus tokens after the one that completed the stop string
        stop_end = idx + len(stop)
        for k, text_end in enumerate(text_ends):
            if text_end >= stop_end:
                del self.token_ids[n_before + k + 1:]
                break
        return True

    def flush(self) -> None:
        """At the end of the request: the text of tokens still waiting for a character to complete."""
        if (self.params.detokenize and self.tokenizer is not None and self.stop_reason is None
                and self.read_offset < len(self.token_ids)):
            prev_len = len(self.output_text)
            self.output_text += self._decode_next(final=True)
            # the held-back text may complete a stop string too (`a` of a token decoding to "a\ufffd")
            if self.params.stop and len(self.token_ids) > self.params.min_tokens:
                self._check_stop_strings(prev_len, len(self.token_ids), [])

    def visible_text(self, finished: bool) -> str:
        """Streaming holds back characters that could still become a stop string."""
        if finished:
            self.flush()
            return self.output_text
        if not self.params.stop or self.params.include_stop_str_in_output:
            return self.output_text
        hold = self._max_stop - 1
        return self.output_text[:-hold] if hold > 0 else self.output_text
