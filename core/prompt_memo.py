"""`PromptMemo`: values computed from a prompt's token list, found again by the list's identity.

(speed: a workload sends the same prompt again as the same list object - the simulator's generator makes
each distinct prompt once, sim/workload.py - and a `Request` keeps the caller's list, as vLLM does; so what
is a pure function of the prompt's tokens (its full blocks' hashes, the simulator's token salt) is computed
once per distinct prompt: a lookup by `id()` instead of a pass over thousands of tokens.)

Exact as long as a prompt list is not changed in place once sent (vLLM treats `prompt_token_ids` as read
only; the memo checks the length, which an append or a slice deletion changes). An entry holds its list,
so no other list can take its `id` while the entry lives. Entries are never evicted: once `max_tokens`
prompt tokens are held, new prompts are computed and not stored - a workload that cycles through more
prompts than fit keeps the hits of those stored instead of thrashing, and a server that sees only new
prompts holds at most `max_tokens` tokens' worth of its first prompts. Who keeps one: each simulated engine's
scheduler (`SimScheduler`, its block hasher's) and executor (`SimExecutor`, the token salt's), for that run
only; a real engine's scheduler keeps none (a server would hold its prompts).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Optional

DEFAULT_MAX_TOKENS = 1 << 23  # prompt tokens held per memo (8.4M; the 16-instance ladder's 750 prompts: 4.9M)


class PromptMemo:
    __slots__ = ("max_tokens", "num_tokens", "_entries")

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0  # tokens of the prompts held
        # (id(prompt), tag) -> (prompt, its length when stored, value)
        self._entries: dict[tuple[int, Hashable], tuple[Sequence[int], int, Any]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prompt: Sequence[int], tag: Hashable = None) -> Optional[Any]:
        """The value stored for this very list (and `tag`: what else the value depends on), else None."""
        entry = self._entries.get((id(prompt), tag))
        if entry is not None and entry[0] is prompt and entry[1] == len(prompt):
            return entry[2]
        return None

    def put(self, prompt: Sequence[int], value: Any, tag: Hashable = None) -> None:
        """Store `value` (not None) for this list and `tag` while fewer than `max_tokens` tokens are held."""
        key = (id(prompt), tag)
        old = self._entries.pop(key, None)
        if old is not None:  # (the list changed length since)
            self.num_tokens -= old[1]
        n = len(prompt)
        if self.num_tokens + n <= self.max_tokens:
            self._entries[key] = (prompt, n, value)
            self.num_tokens += n

    def clear(self) -> None:
        self._entries.clear()
        self.num_tokens = 0
