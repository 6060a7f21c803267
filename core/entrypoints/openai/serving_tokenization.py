"""`POST /tokenize`, `POST /detokenize` and `GET /version` (vLLM's `serving_tokenization.py` shapes).

- /tokenize, a completion prompt: `{"prompt": str, "add_special_tokens": true, "return_token_strs": false}`,
  or a chat: `{"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
  "add_special_tokens": false}` -> `{"count", "max_model_len", "tokens", "token_strs"}`;
- /detokenize: `{"tokens": [int, ...]}` -> `{"prompt": str}`;
- /version: `{"version": <servetwin's version>}`.
vLLM's benchmark client (`vllm bench serve`) asks /tokenize to align prompt lengths.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any, Optional

from fastapi.responses import Response

from servetwin.core.entrypoints.openai.protocol import (APIError, DetokenizeRequest, TokenizeChatRequest,
                                                        TokenizeCompletionRequest)
from servetwin.core.entrypoints.openai.serving_chat import render_chat
from servetwin.core.entrypoints.openai.serving_engine import OpenAIServing, json_encoder


def servetwin_version() -> str:
    try:
        return metadata.version("servetwin")
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


class OpenAIServingTokenization(OpenAIServing):
    """Both routes tokenise / detokenise in the tokenizer thread (a 4 MB text takes seconds of CPU), so the
    event loop keeps answering. They are not behind `--api-key`, as in vLLM (its key guards `/v1/*`
    only): they cost the caller a request each, like `/health`, and reveal nothing but the tokenizer."""

    def _tokenizer(self, engine: Any, field: str) -> Any:
        tok = engine.get_tokenizer()
        if tok is None:
            raise APIError(f"{field}: this server has no tokenizer (started with skip_tokenizer_init)", field)
        return tok

    async def tokenize(self, raw: dict[str, Any], large: bool = False) -> Response:
        engine = self.state.ready_engine()
        schema = TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest
        req = await self._parse(schema, raw, large)  # lone surrogates: a 400 naming the field
        self._check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tok = self._tokenizer(engine, "messages")
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError("continue_final_message: cannot be true together with add_generation_prompt",
                               "continue_final_message")
        else:
            tok = self._tokenizer(engine, "prompt")
        return Response(await self.state.run_cpu(_tokenize, tok, req, engine.max_model_len),
                        media_type="application/json")

    async def detokenize(self, raw: dict[str, Any], large: bool = False) -> Response:
        engine = self.state.ready_engine()
        req = await self._parse(DetokenizeRequest, raw, large)
        self._check_model(req.model)
        tok = self._tokenizer(engine, "tokens")
        vocab = engine.input_processor.vocab_size or (len(tok) if hasattr(tok, "__len__") else None)
        return Response(await self.state.run_cpu(_detokenize, tok, req.tokens, vocab), media_type="application/json")


def _rust_tokenizer(tok: Any) -> Any:
    """A transformers fast tokenizer's own Rust tokenizer, when calling it directly gives what `tok` gives
    (no truncation or padding configured on it); else None."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    return backend


def encode_text(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`tok.encode(text)`, through the Rust tokenizer's batch call where there is one: it releases the GIL
    while it works (transformers' `encode` held it for 0.6 s at a time on a 4 MB text, stalling the event
    loop even from a thread). transformers' fast `encode` is that same batch call, so the ids are equal."""
    backend = _rust_tokenizer(tok)
    if backend is None:
        return list(tok.encode(text, add_special_tokens=add_special_tokens))
    # encode_batch_fast (tokenizers >= 0.21) skips the character offsets: the same ids, 3x faster on 4 MB
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return encode([text], add_special_tokens=add_special_tokens)[0].ids


def decode_ids(tok: Any, ids: list[int]) -> str:
    """`tok.decode(ids)` the same way (the Rust batch decode releases the GIL), with transformers' clean-up
    of tokenization spaces when the tokenizer asks for it."""
    backend = _rust_tokenizer(tok)
    if backend is None:
        return tok.decode(ids)
    text = backend.decode_batch([ids], skip_special_tokens=False)[0]
    return tok.clean_up_tokenization(text) if getattr(tok, "clean_up_tokenization_spaces", False) else text


def _tokenize(tok: Any, req: Any, max_model_len: int) -> bytes:
    """The /tokenize answer, encoded: runs in the tokenizer thread (encoding 10^6 ids as JSON on the
    loop would stall it as much as tokenising)."""
    if isinstance(req, TokenizeChatRequest):
        text, ids = render_chat(tok, req.messages, req.add_generation_prompt, req.continue_final_message)
        if req.add_special_tokens:
            ids = encode_text(tok, text, True)
    else:
        ids = encode_text(tok, req.prompt, req.add_special_tokens)
    strs = list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
    return json_encoder.encode({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs})


def _detokenize(tok: Any, tokens: list[int], vocab: Optional[int]) -> bytes:
    bad = next((t for t in tokens if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise APIError(f"tokens: token id {bad} is out of vocabulary (size {vocab})", "tokens")
    return json_encoder.encode({"prompt": decode_ids(tok, tokens)})
