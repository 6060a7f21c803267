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
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from servetwin.core.entrypoints.openai.protocol import (APIError, DetokenizeRequest, TokenizeChatRequest,
                                                        TokenizeCompletionRequest, bad_request_from_validation)
from servetwin.core.entrypoints.openai.serving_chat import render_chat
from servetwin.core.entrypoints.openai.serving_engine import OpenAIServing


def servetwin_version() -> str:
    try:
        return metadata.version("servetwin")
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown"


class OpenAIServingTokenization(OpenAIServing):
    def _tokenizer(self, engine: Any, field: str) -> Any:
        tok = engine.get_tokenizer()
        if tok is None:
            raise APIError(f"{field}: this server has no tokenizer (started with skip_tokenizer_init)", field)
        return tok

    async def tokenize(self, raw: dict[str, Any]) -> JSONResponse:
        engine = self.state.ready_engine()
        schema = TokenizeChatRequest if "messages" in raw else TokenizeCompletionRequest
        try:
            req = schema.model_validate(raw)
        except ValidationError as e:
            raise bad_request_from_validation(e) from None
        self._check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tok = self._tokenizer(engine, "messages")
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError("continue_final_message: cannot be true together with add_generation_prompt",
                               "continue_final_message")
            text, ids = render_chat(tok, req.messages, req.add_generation_prompt, req.continue_final_message)
            if req.add_special_tokens:
                ids = list(tok.encode(text, add_special_tokens=True))
        else:
            tok = self._tokenizer(engine, "prompt")
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                                "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = list(tok.convert_ids_to_tokens(ids))
        return JSONResponse(body)

    async def detokenize(self, raw: dict[str, Any]) -> JSONResponse:
        engine = self.state.ready_engine()
        try:
            req = DetokenizeRequest.model_validate(raw)
        except ValidationError as e:
            raise bad_request_from_validation(e) from None
        self._check_model(req.model)
        tok = self._tokenizer(engine, "tokens")
        vocab = engine.input_processor.vocab_size or (len(tok) if hasattr(tok, "__len__") else None)
        bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError(f"tokens: token id {bad[0]} is out of vocabulary (size {vocab})", "tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens)})
