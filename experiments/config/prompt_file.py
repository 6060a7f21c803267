"""`workload.prompts`: a JSONL file of real prompts, tokenized with the model's own tokenizer.

One JSON object per line (blank lines and lines starting with `#` are skipped):

    {"id": "q1", "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "max_tokens": 96}
    {"prompt": "Once upon a time", "max_tokens": 32}

- `messages`: a chat, rendered with the tokenizer's chat template (`add_generation_prompt`), then tokenized
  without adding special tokens again - what vLLM's chat endpoint does;
- `prompt`: raw text, tokenized with the tokenizer's defaults (BOS where the model adds one) - what vLLM's
  completion endpoint does;
- `max_tokens`: the output length (>= 1), or the workload's constant `output_tokens` when the line has none;
- `id`: optional (default `p<line>`), unique.

Every request runs to its `max_tokens` (`ignore_eos`), so the simulator and the real backend schedule
the same steps; the report shows each answer up to its first end-of-sequence token.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import printable, read_text

MAX_PROMPT_FILE_BYTES = 64 * 1024 * 1024
LINE_KEYS = ("id", "messages", "prompt", "max_tokens")


@dataclass(slots=True, frozen=True)
class PromptRecord:
    id: str
    max_tokens: int
    prompt: Optional[str] = None
    messages: Optional[tuple[tuple[str, str], ...]] = None  # (role, content)

    def text_for_report(self) -> str:
        """The request as a person reads it: the last user message, or the prompt."""
        if self.messages is not None:
            return self.messages[-1][1]
        return self.prompt or ""


def load_prompt_file(path: str, default_max_tokens: Optional[int] = None,
                     where: str = "workload.prompts") -> list[PromptRecord]:
    """The file's records, every field checked; errors name the file, the line and the field."""
    text = read_text(path, where, MAX_PROMPT_FILE_BYTES)
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        at = f"{path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(where, f"{at}: not valid JSON ({e.msg} at column {e.colno})") from None
        rec = _record(obj, at, f"p{n}", default_max_tokens, where)
        if rec.id in seen:
            raise ConfigError(where, f"{at}: id {printable(rec.id, 60)!r} is used by an earlier line")
        seen.add(rec.id)
        records.append(rec)
    if not records:
        raise ConfigError(where, f"{path}: no prompts (one JSON object per line)")
    return records


def _record(obj: Any, at: str, default_id: str, default_max_tokens: Optional[int], where: str) -> PromptRecord:
    if not isinstance(obj, dict):
        raise ConfigError(where, f"{at}: each line must be a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in LINE_KEYS]
    if unknown:
        raise ConfigError(where, f"{at}: unknown key {printable(str(unknown[0]), 40)!r} "
                                 f"(allowed: {', '.join(LINE_KEYS)})")
    if ("messages" in obj) == ("prompt" in obj):
        raise ConfigError(where, f"{at}: give exactly one of 'messages' (a chat) or 'prompt' (text)")
    rid = obj.get("id", default_id)
    if not isinstance(rid, str) or not rid:
        raise ConfigError(where, f"{at}.id: must be a non-empty string")
    max_tokens = obj.get("max_tokens", default_max_tokens)
    if max_tokens is None:
        raise ConfigError(where, f"{at}.max_tokens: missing (or set workload.output_tokens to a constant)")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(where, f"{at}.max_tokens: must be an integer >= 1, got {printable(repr(max_tokens), 40)}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ConfigError(where, f"{at}.prompt: must be a non-empty string")
        return PromptRecord(rid, max_tokens, prompt=obj["prompt"])
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ConfigError(where, f"{at}.messages: must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(msgs):
        if (not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["role"], str)
                or not isinstance(m["content"], str)):
            raise ConfigError(where, f"{at}.messages[{i}]: must be an object with string 'role' and 'content'")
        out.append((m["role"], m["content"]))
    return PromptRecord(rid, max_tokens, messages=tuple(out))


def tokenize_prompts(records: list[PromptRecord], tokenizer: Any, where: str = "workload.prompts") -> list[list[int]]:
    """Each record's prompt token ids, as vLLM's chat (template, no extra special tokens) or completion
    (the tokenizer's defaults) endpoint would build them."""
    out = []
    for rec in records:
        if rec.messages is not None:
            chat = [{"role": r, "content": c} for r, c in rec.messages]
            try:
                text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001  (a tokenizer without a template raises ValueError or others)
                raise ConfigError(where, f"request {rec.id!r}: the model's tokenizer cannot render a chat "
                                         f"({type(e).__name__}: {printable(str(e), 160)}); use 'prompt' lines") from None
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(rec.prompt)["input_ids"]
        if not ids:
            raise ConfigError(where, f"request {rec.id!r}: the prompt tokenizes to no tokens")
        out.append([int(t) for t in ids])
    return out


def model_tokenizer(model: str, where: str = "workload.prompts") -> Any:
    """The tokenizer of `model` (a built-in model or a local directory with tokenizer files)."""
    from servetwin.core.config_error import ModelNotFoundError  # noqa: PLC0415
    from servetwin.gpu.models.registry import load_tokenizer, resolve_model  # noqa: PLC0415

    try:
        return load_tokenizer(resolve_model(model))
    except (ModelNotFoundError, OSError, ValueError) as e:
        raise ConfigError(where, f"text prompts need the tokenizer of model {model!r}, which is not available "
                                 f"here ({printable(str(e), 200)})") from None


def answer_text(tokenizer: Any, token_ids: list[int], eos_token_ids: list[int]) -> tuple[str, bool]:
    """(the answer up to its first end-of-sequence token, decoded; whether an EOS was met)."""
    cut = next((i for i, t in enumerate(token_ids) if t in eos_token_ids), None)
    ids = token_ids if cut is None else token_ids[:cut]
    return tokenizer.decode(ids, skip_special_tokens=True), cut is not None
