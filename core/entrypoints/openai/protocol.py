"""Request schemas of the OpenAI-compatible server and its error shape (vLLM's `protocol.py`).

Every handler error is `{"error": {"message", "type", "param", "code"}}` (`error_body`): a bad request
is a 400 naming the field (`param`), an unknown model a 404, a server that is not ready a 503.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError


# -- request schemas ------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: Optional[StrictBool] = False


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    n: StrictInt = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    priority: StrictInt = 0
    return_tokens_as_token_ids: StrictBool = False  # vLLM extension: logprob tokens as "token_id:<id>"


class CompletionRequest(CommonRequest):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = 16
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True
    echo: StrictBool = False


# -- errors ---------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_


def error_body(message: str, param: Optional[str], status: int, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.param, e.status, e.type), status_code=e.status)


_PARAM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::|\s)")
_PARAM_ALIASES = {"prompt_token_ids": "prompt", "request_id": None, "extra_args": None}


def bad_request_from(e: Exception, default_param: Optional[str] = None,
                     aliases: Optional[dict[str, str]] = None) -> APIError:
    """A 400 from a `ValueError` whose message starts with the field name (servetwin's convention)."""
    msg = str(e)
    match = _PARAM_RE.match(msg)
    param = match.group(1) if match else default_param
    if param is not None:
        param = (aliases or {}).get(param, _PARAM_ALIASES.get(param, param))
    return APIError(msg, param)


def bad_request_from_validation(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    param = loc[0] if loc else None  # the request's top-level field (pydantic adds union branches, indices)
    where = ".".join(loc)
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return APIError(f"{param}: {err.get('msg', 'invalid value')} (at {where}, got {got})", param)


__all__ = ["StreamOptions", "CommonRequest", "CompletionRequest", "ChatMessage", "ChatCompletionRequest", "APIError",
           "error_body", "error_response", "bad_request_from", "bad_request_from_validation"]
