"""OpenAI-compatible HTTP server over `AsyncLLM` (FastAPI + uvicorn), like `vllm serve`.

Endpoints:
- `POST /v1/completions`, `POST /v1/chat/completions`: streaming (SSE, `data: {...}` lines ending with
  `data: [DONE]`) and not; `n`, `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`
  (at most 4 strings, vLLM's API cap), `stop_token_ids`, `logprobs` (chat: `logprobs` + `top_logprobs`),
  `echo`, `ignore_eos`, `min_tokens`, penalties, `stream_options.include_usage`.
- `GET /v1/models`; `GET /health` (200 only once the engine is ready and alive, else 503);
  `GET /metrics` (Prometheus text, vLLM's metric names, see `servetwin.core.engine.metrics`).

A bad request gets a 400 with an OpenAI-style body naming the field,
`{"error": {"message": ..., "type": "BadRequestError", "param": <field>, "code": 400}}`, and the server
keeps serving. A client that disconnects (mid-stream or while waiting for a non-streamed answer) has
its request aborted in the engine. The engine process is started in the background when the server
starts; requests before it is ready get a 503.

Run it with `servetwin serve --model M --backend torch|sim|fake [engine args] --host H --port P`
(`experiments/serve_cli.py`), or `run_server(EngineArgs(...), host=..., port=...)`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from servetwin.core.engine.async_llm import AsyncLLM
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.request_output import RequestOutput
from servetwin.core.sampling_params import MAX_STOP_STRINGS_API, SamplingParams

logger = logging.getLogger("servetwin.server")

_json = msgspec.json.Encoder()


# -- request schemas ------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: Optional[StrictBool] = False


class _Common(BaseModel):
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


class CompletionRequest(_Common):
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


class ChatCompletionRequest(_Common):
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


# -- the server state ---------------------------------------------------------------------------------
class ServerState:
    def __init__(self, args: EngineArgs, model_name: str, engine_kwargs: dict[str, Any]) -> None:
        self.args = args
        self.model_name = model_name
        self.engine_kwargs = engine_kwargs
        self.engine: Optional[AsyncLLM] = None
        self.startup_error: Optional[BaseException] = None
        self.closing = False
        self.on_startup_failure: Optional[Callable[[BaseException], None]] = None
        self.created = int(time.time())

    async def start_engine(self) -> None:
        try:
            engine = await asyncio.to_thread(AsyncLLM, self.args, model_name=self.model_name, **self.engine_kwargs)
        except asyncio.CancelledError:
            if self.closing:  # the server stopped while the engine was loading: not a start-up failure
                return
            raise
        except BaseException as e:  # noqa: BLE001
            self.startup_error = e
            logger.error("engine start-up failed: %s: %s", type(e).__name__, e)
            if self.on_startup_failure is not None:
                self.on_startup_failure(e)
            return
        if self.closing:
            engine.shutdown()
            return
        self.engine = engine
        logger.info("engine ready (pid %s): %s", engine.client.engine_pid, engine.config)

    def ready_engine(self) -> AsyncLLM:
        if self.engine is None:
            if self.startup_error is not None:
                raise APIError(f"engine failed to start: {self.startup_error}", None, 503, "ServiceUnavailableError")
            raise APIError("the engine is still starting", None, 503, "ServiceUnavailableError")
        if self.engine.errored:
            raise APIError(f"engine is dead: {self.engine.dead_error}", None, 503, "ServiceUnavailableError")
        return self.engine


# -- helpers --------------------------------------------------------------------------------------------
def _sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def _token_str(tokenizer: Any, tid: int) -> str:
    if tokenizer is None:
        return f"token_id:{tid}"
    return tokenizer.decode([tid])


def _common_params(req: _Common, max_tokens: Optional[int], logprobs: Optional[int],
                   prompt_logprobs: Optional[int], max_logprobs: int) -> SamplingParams:
    if req.n < 1:
        raise APIError(f"n: must be >= 1, got {req.n}", "n")
    stop = req.stop
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS_API:
        raise APIError(f"stop: at most {MAX_STOP_STRINGS_API} stop strings are allowed, got {len(stop)}", "stop")
    if req.logit_bias:
        raise APIError("logit_bias: not supported by servetwin", "logit_bias")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and max_logprobs != -1 and value > max_logprobs:
            raise APIError(f"{name}: requested {value} logprobs, more than max_logprobs={max_logprobs}", name)
    kwargs: dict[str, Any] = dict(
        n=req.n, seed=req.seed, stop=stop, stop_token_ids=req.stop_token_ids, max_tokens=max_tokens,
        min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise bad_request_from(e) from None


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams; cancelling the merge cancels (and aborts) them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro: Any) -> Any:
    """Run `coro`; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return Response(status_code=499)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


_END = object()


async def _next_or_end(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return _END


async def _prime(request: Request, merged: AsyncIterator[tuple[int, RequestOutput]], default_param: str,
                 aliases: Optional[dict[str, str]] = None) -> Any:
    """Wait for the first output, so a request the engine refuses still gets a proper 400."""
    try:
        first = await _unless_disconnected(request, _next_or_end(merged))
    except ValueError as e:
        raise bad_request_from(e, default_param, aliases) from None
    if isinstance(first, Response):
        with contextlib.suppress(Exception):
            await merged.aclose()
    return first


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is _END:
        return
    yield first
    async for item in rest:
        yield item


# -- completions ----------------------------------------------------------------------------------------
def _completion_prompts(req: CompletionRequest) -> list[Any]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError("prompt: the prompt is empty", "prompt")
    if isinstance(p[0], int):
        return [list(p)]
    return list(p)


def _completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]],
                         top_n: int, offset0: int,
                         prefix: Optional[list[tuple[int, Optional[dict[int, float]]]]] = None) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = offset0
    pairs = list(prefix or []) + list(zip(token_ids, logprobs))
    for tid, d in pairs:
        s = _token_str(tokenizer, tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(d.get(tid))
        ranked = sorted(d.items(), key=lambda kv: -kv[1])
        top = dict((_token_str(tokenizer, t), lp) for t, lp in ranked[:max(top_n, 0)])
        if tid in d:
            top.setdefault(s, d[tid])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in (self.state.model_name, self.state.args.model):
            raise APIError(f"The model `{model}` does not exist.", "model", 404, "NotFoundError")

    def _tokenize(self, engine: AsyncLLM, prompts: list[Any], params: SamplingParams, max_tokens_param: str,
                  aliases: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
        """Tokenise every prompt and check that prompt + max_tokens fits max_model_len: a 400 like vLLM's
        server (the offline `LLM` caps the output at max_model_len instead)."""
        out = []
        for prompt in prompts:
            try:
                text, ids = engine.input_processor.tokenize(prompt)
            except ValueError as e:
                raise bad_request_from(e, "prompt", aliases) from None
            max_len = engine.max_model_len
            if params.max_tokens is not None and 0 < len(ids) < max_len and len(ids) + params.max_tokens > max_len:
                raise APIError(f"{max_tokens_param}: '{max_tokens_param}' is too large: {params.max_tokens}. This "
                               f"model's maximum context length is {max_len} tokens and your request has "
                               f"{len(ids)} input tokens ({params.max_tokens} > {max_len} - {len(ids)}).",
                               max_tokens_param)
            out.append({"prompt": text, "prompt_token_ids": ids})
        return out

    def _submit(self, engine: AsyncLLM, prompts: list[Any], params: SamplingParams, priority: int,
                base_id: str, aliases: Optional[dict[str, str]] = None) -> list[Any]:
        collectors = []
        try:
            with engine.client.batched():  # every prompt of the request reaches the engine together
                for i, prompt in enumerate(prompts):
                    collectors.append(engine.add_request(f"{base_id}-{i}", prompt, params, priority=priority))
        except ValueError as e:
            for c in collectors:
                engine.abort(c.request_id)
            raise bad_request_from(e, "prompt", aliases) from None
        except Exception:
            for c in collectors:
                engine.abort(c.request_id)
            raise
        return collectors

    # -- /v1/completions ----------------------------------------------------------------------------
    async def completions(self, raw: dict[str, Any], request: Request) -> Response:
        engine = self.state.ready_engine()
        try:
            req = CompletionRequest.model_validate(raw)
        except ValidationError as e:
            raise bad_request_from_validation(e) from None
        self._check_model(req.model)
        if req.suffix is not None:
            raise APIError("suffix: not supported by servetwin", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(f"best_of: only best_of == n is supported, got best_of={req.best_of}, n={req.n}",
                           "best_of")
        if req.logprobs is not None and req.logprobs < 0:
            raise APIError(f"logprobs: must be >= 0, got {req.logprobs}", "logprobs")
        prompts = _completion_prompts(req)
        prompt_lps = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = _common_params(req, req.max_tokens, req.logprobs, prompt_lps, self.state.args.max_logprobs)
        prompts = self._tokenize(engine, prompts, params, "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        collectors = self._submit(engine, prompts, params, req.priority, request_id)
        created = int(time.time())
        model = req.model or self.state.model_name
        tok = engine.get_tokenizer()
        merged = _merge([engine.stream(c) for c in collectors])
        first = await _prime(request, merged, "prompt")
        if isinstance(first, Response):
            return first
        outputs = _chain(first, merged)
        if req.stream:
            gen = self._completion_stream(engine, req, outputs, request_id, created, model, tok)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await _unless_disconnected(
            request, self._completion_full(req, outputs, request_id, created, model, tok))

    def _echo_text(self, tok: Any, final: RequestOutput) -> str:
        if final.prompt is not None:
            return final.prompt
        return tok.decode(final.prompt_token_ids) if tok is not None else ""

    def _echo_logprob_prefix(self, final: RequestOutput) -> list[tuple[int, Optional[dict[int, float]]]]:
        plps = final.prompt_logprobs or []
        ids = final.prompt_token_ids
        return [(tid, plps[i] if i < len(plps) else None) for i, tid in enumerate(ids)]

    async def _completion_full(self, req: CompletionRequest, outputs: AsyncIterator[Any], request_id: str,
                               created: int, model: str, tok: Any) -> Response:
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in outputs:
                finals[i] = out
        except ValueError as e:
            raise bad_request_from(e, "prompt") from None
        choices = []
        prompt_tokens = completion_tokens = 0
        for i in sorted(finals):
            final = finals[i]
            prompt_tokens += len(final.prompt_token_ids)
            echo = self._echo_text(tok, final) if req.echo else ""
            for c in final.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = _completion_logprobs(None if req.return_tokens_as_token_ids else tok, c.token_ids,
                                              c.logprobs or [], req.logprobs, 0,
                                              self._echo_logprob_prefix(final) if req.echo else None)
                choices.append({"index": i * req.n + c.index, "text": echo + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}
        return Response(_json.encode(body), media_type="application/json")

    async def _completion_stream(self, engine: AsyncLLM, req: CompletionRequest, outputs: AsyncIterator[Any],
                                 request_id: str, created: int, model: str, tok: Any) -> AsyncIterator[bytes]:
        sent_text: dict[tuple[int, int], int] = {}
        sent_tokens: dict[tuple[int, int], int] = {}
        text_offset: dict[tuple[int, int], int] = {}
        finished: set[tuple[int, int]] = set()
        prompt_tokens: dict[int, int] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            async for i, out in outputs:
                prompt_tokens[i] = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    key = (i, c.index)
                    if key in finished:
                        continue
                    first = key not in sent_text
                    n_text, n_tok = sent_text.get(key, 0), sent_tokens.get(key, 0)
                    delta = c.text[n_text:]
                    new_ids = c.token_ids[n_tok:]
                    if first and req.echo:
                        delta = self._echo_text(tok, out) + delta
                    if not delta and not new_ids and c.finish_reason is None and not first:
                        continue
                    lp = None
                    if req.logprobs is not None:
                        prefix = self._echo_logprob_prefix(out) if (first and req.echo) else None
                        lp = _completion_logprobs(None if req.return_tokens_as_token_ids else tok, new_ids,
                                                  (c.logprobs or [])[n_tok:], req.logprobs,
                                                  text_offset.get(key, 0), prefix)
                        if lp["tokens"]:
                            text_offset[key] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    sent_text[key], sent_tokens[key] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(key)
                    choices.append({"index": i * req.n + c.index, "text": delta, "logprobs": lp,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if choices:
                    yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                                "choices": choices})
            if include_usage:
                p, ct = sum(prompt_tokens.values()), sum(sent_tokens.values())
                yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": ct,
                                                     "total_tokens": p + ct}})
        except EngineDeadError as e:
            yield _sse(error_body(f"engine is dead: {e}", None, 500, "InternalServerError"))
        except ValueError as e:
            err = bad_request_from(e, "prompt")
            yield _sse(error_body(err.message, err.param, 400, err.type))
        yield b"data: [DONE]\n\n"

    # -- /v1/chat/completions -----------------------------------------------------------------------
    async def chat(self, raw: dict[str, Any], request: Request) -> Response:
        engine = self.state.ready_engine()
        try:
            req = ChatCompletionRequest.model_validate(raw)
        except ValidationError as e:
            raise bad_request_from_validation(e) from None
        self._check_model(req.model)
        tok = engine.get_tokenizer()
        if tok is None or not hasattr(tok, "apply_chat_template"):
            raise APIError("messages: chat needs a tokenizer with a chat template (the server was started "
                           "with skip_tokenizer_init)", "messages")
        top = req.top_logprobs
        if top is not None and (top < 0 or top > 20):
            raise APIError(f"top_logprobs: must be in [0, 20], got {top}", "top_logprobs")
        if top is not None and top > 0 and not req.logprobs:
            raise APIError("top_logprobs: requires logprobs to be true", "top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _common_params(req, max_tokens, logprobs, None, self.state.args.max_logprobs)
        messages = []
        for msg in req.messages:
            content = msg.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text":
                        raise APIError(f"messages: content part type {part.get('type')!r} is not supported "
                                       "(only 'text')", "messages")
                    parts.append(str(part.get("text", "")))
                content = "".join(parts)
            messages.append({"role": msg.role, "content": content or ""})
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt)
            ids = list(tok.encode(text, add_special_tokens=False))
        except Exception as e:  # noqa: BLE001 - template errors are the caller's
            raise APIError(f"messages: cannot apply the chat template: {e}", "messages") from None
        prompts = self._tokenize(engine, [{"prompt": text, "prompt_token_ids": ids}], params,
                                 "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                                 {"prompt": "messages"})
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        collectors = self._submit(engine, prompts, params, req.priority, request_id, {"prompt": "messages"})
        created = int(time.time())
        model = req.model or self.state.model_name
        merged = _merge([engine.stream(c) for c in collectors])
        first = await _prime(request, merged, "messages", {"prompt": "messages"})
        if isinstance(first, Response):
            return first
        outputs = _chain(first, merged)
        if req.stream:
            return StreamingResponse(self._chat_stream(req, outputs, request_id, created, model, tok),
                                     media_type="text/event-stream")
        return await _unless_disconnected(request, self._chat_full(req, outputs, request_id, created, model, tok))

    @staticmethod
    def _chat_echo(req: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: prepend the last message when it is the assistant's (a continuation)."""
        last = req.messages[-1]
        if not req.echo or last.role != "assistant" or not isinstance(last.content, str):
            return ""
        return last.content

    def _chat_logprobs(self, tok: Any, token_ids: list[int], logprobs: list[dict[int, float]],
                       top_n: int) -> dict[str, Any]:
        content = []
        for tid, d in zip(token_ids, logprobs):
            s = _token_str(tok, tid)
            ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": s, "logprob": d.get(tid, float("-inf")), "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": _token_str(tok, t), "logprob": lp,
                                              "bytes": list(_token_str(tok, t).encode("utf-8"))} for t, lp in ranked]})
        return {"content": content}

    async def _chat_full(self, req: ChatCompletionRequest, outputs: AsyncIterator[Any], request_id: str,
                         created: int, model: str, tok: Any) -> Response:
        final: Optional[RequestOutput] = None
        try:
            async for _, out in outputs:
                final = out
        except ValueError as e:
            raise bad_request_from(e, "messages", {"prompt": "messages"}) from None
        assert final is not None
        choices = []
        completion_tokens = 0
        echo = self._chat_echo(req)
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            lp_tok = None if req.return_tokens_as_token_ids else tok
            lp = self._chat_logprobs(lp_tok, c.token_ids, c.logprobs or [], req.top_logprobs or 0) if req.logprobs else None
            choices.append({"index": c.index, "message": {"role": "assistant", "content": echo + c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        p = len(final.prompt_token_ids)
        body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": {"prompt_tokens": p, "completion_tokens": completion_tokens,
                                              "total_tokens": p + completion_tokens}}
        return Response(_json.encode(body), media_type="application/json")

    async def _chat_stream(self, req: ChatCompletionRequest, outputs: AsyncIterator[Any], request_id: str,
                           created: int, model: str, tok: Any) -> AsyncIterator[bytes]:
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        prompt_tokens = 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]]) -> bytes:
            return _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": choices})

        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": self._chat_echo(req)},
                          "logprobs": None, "finish_reason": None} for i in range(req.n)])
            async for _, out in outputs:
                prompt_tokens = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    if c.index in finished:
                        continue
                    n_text, n_tok = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                    delta, new_ids = c.text[n_text:], c.token_ids[n_tok:]
                    if not delta and not new_ids and c.finish_reason is None:
                        continue
                    lp = None
                    if req.logprobs:
                        lp = self._chat_logprobs(None if req.return_tokens_as_token_ids else tok, new_ids,
                                                 (c.logprobs or [])[n_tok:], req.top_logprobs or 0)
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    choices.append({"index": c.index, "delta": {"content": delta} if delta else {},
                                    "logprobs": lp, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})
                if choices:
                    yield chunk(choices)
            if include_usage:
                ct = sum(sent_tokens.values())
                yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": ct,
                                                     "total_tokens": prompt_tokens + ct}})
        except EngineDeadError as e:
            yield _sse(error_body(f"engine is dead: {e}", None, 500, "InternalServerError"))
        except ValueError as e:
            err = bad_request_from(e, "messages", {"prompt": "messages"})
            yield _sse(error_body(err.message, err.param, 400, err.type))
        yield b"data: [DONE]\n\n"


# -- the app --------------------------------------------------------------------------------------------
def build_app(args: EngineArgs, *, served_model_name: Optional[str] = None, pace: Optional[bool] = None,
              time_scale: float = 1.0, fake_step_time_s: Optional[float] = None,
              startup_timeout_s: Optional[float] = None) -> FastAPI:
    engine_kwargs: dict[str, Any] = {"pace": pace, "time_scale": time_scale, "fake_step_time_s": fake_step_time_s}
    if startup_timeout_s is not None:
        engine_kwargs["startup_timeout_s"] = startup_timeout_s
    state = ServerState(args, served_model_name or args.model, engine_kwargs)
    serving = OpenAIServing(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starter = asyncio.ensure_future(state.start_engine())
        app.state.starter = starter
        try:
            yield
        finally:
            state.closing = True
            if state.engine is not None:
                state.engine.shutdown()
            if not starter.done():
                # the engine is still loading in a worker thread: it shuts itself down when done
                await asyncio.wait({starter}, timeout=1.0)

    app = FastAPI(title="servetwin OpenAI-compatible server", lifespan=lifespan)
    app.state.servetwin = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(APIError(f"engine is dead: {e}", None, 500, "InternalServerError"))

    async def _body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001
            raise APIError("body: the request body is not valid JSON", "body") from None
        if not isinstance(body, dict):
            raise APIError("body: the request body must be a JSON object", "body")
        return body

    @app.get("/health")
    async def health() -> Response:
        if state.engine is not None and not state.engine.errored:
            return Response(status_code=200)
        if state.engine is None and state.startup_error is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        reason = state.startup_error or (state.engine.dead_error if state.engine else None)
        return JSONResponse({"status": "error", "message": str(reason)}, status_code=503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        max_len = state.engine.max_model_len if state.engine is not None else None
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "servetwin",
            "root": state.args.model, "parent": None, "max_model_len": max_len}]})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if state.engine is None:
            from servetwin.core.engine.metrics import ServingMetrics  # noqa: PLC0415

            text = ServingMetrics(state.model_name).render()
        else:
            text = state.engine.metrics.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(await _body(request), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serving.chat(await _body(request), request)

    return app


def run_server(args: EngineArgs, *, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: Optional[str] = None, pace: Optional[bool] = None, time_scale: float = 1.0,
               fake_step_time_s: Optional[float] = None, log_level: str = "warning",
               startup_timeout_s: Optional[float] = None) -> None:
    """Serve until SIGINT / SIGTERM. Raises the engine's start-up error if it fails to start."""
    import uvicorn  # noqa: PLC0415

    app = build_app(args, served_model_name=served_model_name, pace=pace, time_scale=time_scale,
                    fake_step_time_s=fake_step_time_s, startup_timeout_s=startup_timeout_s)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3,
                            access_log=False)
    server = uvicorn.Server(config)
    state: ServerState = app.state.servetwin

    def _failed(e: BaseException) -> None:
        server.should_exit = True

    state.on_startup_failure = _failed
    server.run()
    if state.startup_error is not None:
        raise state.startup_error


__all__ = ["build_app", "run_server", "APIError", "CompletionRequest", "ChatCompletionRequest"]
