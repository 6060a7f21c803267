"""`ToyTokenizer`: a deterministic stand-in tokenizer for the `fake` and `sim` backends.

Those backends produce token ids but ship no vocabulary. The toy tokenizer makes their output
readable and lets text prompts, chat messages and stop strings work end to end (e.g. in
`servetwin serve --backend sim`). Token id `i` decodes to the piece `" i"`; encoding splits text on
whitespace and maps a decimal word below `vocab_size` to that id and any other word to a stable hash
(crc32) in `[10, vocab_size)`. So `decode(encode(" 12 7")) == " 12 7"`. Chat prompts are rendered as
`"<role>: <content>\\n"` lines followed by `"assistant:"`.
"""
from __future__ import annotations

import re
import zlib
from typing import Any, Optional

_WORD = re.compile(r"\S+")


class ToyTokenizer:
    name_or_path = "toy"
    eos_token_id: Optional[int] = None
    chat_template = "toy"

    def __init__(self, vocab_size: int = 1024) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def _word_id(self, word: str) -> int:
        if word.isdigit() and int(word) < self.vocab_size:
            return int(word)
        return 10 + zlib.crc32(word.encode("utf-8")) % (self.vocab_size - 10)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # finditer, not findall: one findall over megabytes holds the GIL for 100s of ms, and the server
        # tokenises in a thread so that its event loop keeps running meanwhile
        return [self._word_id(m.group()) for m in _WORD.finditer(text)]

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return "".join(f" {int(t)}" for t in token_ids)

    def convert_ids_to_tokens(self, token_ids: Any) -> Any:
        if isinstance(token_ids, int):
            return f" {token_ids}"
        return [f" {int(t)}" for t in token_ids]

    def apply_chat_template(self, conversation: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True, **kwargs: Any) -> Any:
        lines = [f"{msg.get('role', 'user')}: {msg.get('content', '')}\n" for msg in conversation]
        text = "".join(lines) + ("assistant:" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text
