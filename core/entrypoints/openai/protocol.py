"""Request schemas of the OpenAI-compatible server and its error shape (vLLM's `protocol.py`).

Every handler error is `{"error": {"message", "type", "param", "code"}}` (`error_body`): a bad request
is a 400 naming the field (`param`), an unknown model a 404, a server that is not ready a 503.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from typing_extensions import Annotated

from servetwin.core.limits import MAX_NESTING_DEPTH, nesting_depth

# Every integer crosses to the engine as a 64-bit value (msgpack); a larger one is the client's error,
# a 400 naming the field (vLLM bounds `seed` the same way, to torch.long's range).
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
StrictInt = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
# JSON has no NaN / Infinity (Python's json module accepts them: refused when the body is parsed)
# strict: `true` is not 1.0, nor "0.5" 0.5 (vLLM's lax pydantic accepts both)
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]


# -- request schemas ------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: Optional[StrictBool] = False


class ResponseFormat(BaseModel):
    """vLLM's `AnyResponseFormat` (vllm/entrypoints/openai/chat_completion/protocol.py:252): a typed
    object; anything else is a 400 there too. servetwin generates unconstrained tokens for every type."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[dict[str, Any]] = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(BaseModel):
    """vLLM's `ChatCompletionToolsParam` (protocol.py:206)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: ToolFunction


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    n: StrictInt = 1
    temperature: Optional[Float] = None
    top_p: Optional[Float] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Float] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Float] = None
    frequency_penalty: Optional[Float] = None
    repetition_penalty: Optional[Float] = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    logit_bias: Optional[dict[str, Float]] = None
    user: Optional[str] = None
    priority: StrictInt = 0
    return_tokens_as_token_ids: StrictBool = False  # vLLM extension: logprob tokens as "token_id:<id>"
    prompt_logprobs: Optional[StrictInt] = None  # vLLM extension; bounded by max_logprobs (common_params)
    response_format: Optional[ResponseFormat] = None


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
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None


# -- errors ---------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type_


def error_body(message: str, param: Optional[str], status: int, type_: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


_STATUS_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                 404: "NotFoundError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError",
                 413: "RequestTooLargeError", 431: "RequestHeaderFieldsTooLargeError",
                 500: "InternalServerError", 503: "ServiceUnavailableError"}


def status_type(status: int) -> str:
    """The error `type` for an HTTP status (the OpenAI SDK's exception names)."""
    return _STATUS_TYPES.get(status, "APIError")


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped JSON: an error message may quote a client's text, lone surrogates included."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(e: APIError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return ErrorJSONResponse(error_body(e.message, e.param, e.status, e.type), status_code=e.status, headers=headers)


def _find_surrogate(value: Any, path: str) -> Optional[str]:
    """The path of the first string (or key) holding a lone surrogate (valid JSON, not valid text)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _find_surrogate(key, path or "body") or _find_surrogate(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


class _NotJSON:
    """NaN / Infinity / -Infinity in a body (Python's json accepts them): found after parsing, to name
    the field that holds one."""

    def __init__(self, name: str) -> None:
        self.name = name


def _constant_path(value: Any) -> Optional[tuple[str, str]]:
    """(top-level field, the constant) of the first `_NotJSON` in `value`, walked without recursion."""
    stack: list[tuple[Any, str]] = [(v, k) for k, v in value.items()] if isinstance(value, dict) else []
    while stack:
        item, field = stack.pop()
        if isinstance(item, _NotJSON):
            return field, item.name
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((c, field) for c in children)
    return None


def _too_deep() -> APIError:
    return APIError(f"body: the request body is nested more than {MAX_NESTING_DEPTH} levels deep", "body")


def _opening_brackets(raw: bytes) -> int:
    """An upper bound on the body's nesting depth (every `[` / `{`, in strings too), counted in C."""
    return raw.count(b"[") + raw.count(b"{")


def worth_a_thread(raw: bytes, large_bytes: int) -> bool:
    """Parse `raw` in a worker thread rather than on the event loop: a large body, or one with so many
    brackets that checking its depth costs more than a hop to the thread."""
    return len(raw) >= large_bytes or _opening_brackets(raw) > 4096


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (NaN / Infinity, which Python's json accepts, are refused), nested
    at most `MAX_NESTING_DEPTH` deep: every later step (the surrogate scan, pydantic, msgspec) walks it,
    some recursively, and a thread has a smaller stack than the main one."""
    constants: list[_NotJSON] = []

    def constant(name: str) -> _NotJSON:
        constants.append(_NotJSON(name))
        return constants[-1]

    try:
        body = json.loads(raw, parse_constant=constant)
    except RecursionError:
        raise _too_deep() from None
    except ValueError:
        raise APIError("body: the request body is not valid JSON", "body") from None
    if not isinstance(body, dict):
        raise APIError("body: the request body must be a JSON object", "body")
    if _opening_brackets(raw) > MAX_NESTING_DEPTH and nesting_depth(body) > MAX_NESTING_DEPTH:
        raise _too_deep()
    if constants:
        field, name = _constant_path(body) or ("body", constants[0].name)
        raise APIError(f"{field}: {name} is not a JSON number", field)
    return body


def parse_request(cls: type[BaseModel], raw: dict[str, Any]) -> Any:
    """Validate a request body into `cls`: a 400 naming the field for any bad value."""
    where = _find_surrogate(raw, "")
    if where is not None:
        param = re.split(r"[.\[]", where, maxsplit=1)[0] or "body"
        raise APIError(f"{param}: the text is not valid Unicode (a lone surrogate such as \\ud800, at {where})",
                       param)
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise bad_request_from_validation(e) from None


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
           "error_body", "error_response", "status_type", "parse_request", "parse_json_body", "bad_request_from",
           "bad_request_from_validation", "INT64_MIN", "INT64_MAX", "TokenizeCompletionRequest",
           "TokenizeChatRequest", "DetokenizeRequest"]


# -- tokenization (vLLM's /tokenize and /detokenize shapes) ---------------------------------------------
class TokenizeCompletionRequest(BaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: Optional[StrictBool] = False


class TokenizeChatRequest(BaseModel):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: Optional[StrictBool] = False


class DetokenizeRequest(BaseModel):
    model: Optional[str] = None
    tokens: list[StrictInt]
