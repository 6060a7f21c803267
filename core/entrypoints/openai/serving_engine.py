"""What both OpenAI endpoints share (vLLM's `serving_engine.py`): the server state (the engine, loaded in
the background), sampling parameters from a request, tokenisation with the context-length check,
submission, and the stream plumbing (merging n > 1 prompts, disconnect watching, priming the first
output so that a request the engine refuses still gets a proper 400)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

import msgspec
from fastapi import Request
from fastapi.responses import Response

from servetwin.core.engine.async_llm import AsyncLLM
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.request_output import RequestOutput
from servetwin.core.entrypoints.openai.http_limits import ServerLimits
from servetwin.core.entrypoints.openai.protocol import (APIError, CommonRequest, bad_request_from, error_body,
                                                        parse_request)
from servetwin.core.gc_heap import freeze_gc_heap
from servetwin.core.sampling_params import MAX_STOP_STRINGS_API, RequestOutputKind, SamplingParams

logger = logging.getLogger("servetwin.server")

json_encoder = msgspec.json.Encoder()
MAX_N_API = 128


class ServerShuttingDownError(EngineDeadError):
    """Requests in flight when the server stops (SIGTERM / SIGINT): aborted in the engine."""


def engine_error(e: EngineDeadError) -> APIError:
    """What a request learns when the engine went away under it: a 503 while the server shuts down
    (retry elsewhere), a 500 when the engine process died."""
    if isinstance(e, ServerShuttingDownError):
        return APIError(str(e), None, 503, "ServiceUnavailableError")
    return APIError(f"engine is dead: {e}", None, 500, "InternalServerError")


def engine_error_event(e: EngineDeadError) -> bytes:
    err = engine_error(e)
    return sse(error_body(err.message, err.param, err.status, err.type))


# -- the server state ---------------------------------------------------------------------------------
class ServerState:
    def __init__(self, args: EngineArgs, model_name: str, engine_kwargs: dict[str, Any],
                 limits: Optional[ServerLimits] = None) -> None:
        self.args = args
        self.limits = limits or ServerLimits()
        self.model_name = model_name
        self.engine_kwargs = engine_kwargs
        self.engine: Optional[AsyncLLM] = None
        self.startup_error: Optional[BaseException] = None
        self.closing = False  # shutting down: new requests get a 503
        self.engine_died = False  # the engine process died: the server reports it, then exits non-zero
        self.on_startup_failure: Optional[Callable[[BaseException], None]] = None
        self.on_engine_dead: Optional[Callable[[], None]] = None
        self.created = int(time.time())
        # Tokenising a large prompt or applying a chat template takes milliseconds to seconds of CPU: done
        # in one worker thread (as vLLM's server does; HF fast tokenizers are not safe to share between
        # threads), so the event loop keeps streaming and answering /health meanwhile.
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="servetwin-tokenizer")

    async def run_cpu(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run CPU-heavy request preprocessing off the event loop (in the tokenizer thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, functools.partial(fn, *args, **kwargs))

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
        # the start-up heap leaves the garbage collector's full passes (each one stalled the loop)
        frozen = freeze_gc_heap()
        logger.info("engine ready (pid %s, %d start-up objects frozen): %s", engine.client.engine_pid, frozen,
                    engine.config)

    def ready_engine(self) -> AsyncLLM:
        if self.closing:
            raise APIError("the server is shutting down", None, 503, "ServiceUnavailableError")
        if self.engine is None:
            if self.startup_error is not None:
                raise APIError(f"engine failed to start: {self.startup_error}", None, 503, "ServiceUnavailableError")
            raise APIError("the engine is still starting", None, 503, "ServiceUnavailableError")
        if self.engine.errored:
            raise APIError(f"engine is dead: {self.engine.dead_error}", None, 503, "ServiceUnavailableError")
        return self.engine


# -- helpers --------------------------------------------------------------------------------------------
def sse(obj: Any) -> bytes:
    return b"data: " + json_encoder.encode(obj) + b"\n\n"


def token_str(tokenizer: Any, tid: int) -> str:
    if tokenizer is None:
        return f"token_id:{tid}"
    return tokenizer.decode([tid])


def requested_prompt_logprobs(req: CommonRequest, max_logprobs: int) -> Optional[int]:
    """`prompt_logprobs` checked as vLLM checks it (chat_completion/protocol.py:900-911, and the
    processor's max_logprobs bound): >= 0 or -1 (the whole vocabulary), never with a stream."""
    value = req.prompt_logprobs
    if value is None:
        return None
    if value < -1:
        raise APIError(f"prompt_logprobs: must be a positive value or -1, got {value}", "prompt_logprobs")
    if req.stream and value != 0:
        raise APIError("prompt_logprobs: not available when stream=true", "prompt_logprobs")
    if value == -1 and max_logprobs != -1:
        raise APIError(f"prompt_logprobs: requested all (-1) logprobs, more than max_logprobs={max_logprobs}",
                       "prompt_logprobs")
    return value


def common_params(req: CommonRequest, max_tokens: Optional[int], logprobs: Optional[int],
                   prompt_logprobs: Optional[int], max_logprobs: int,
                   aliases: Optional[dict[str, str]] = None) -> SamplingParams:
    """`SamplingParams` from a request; `aliases` renames fields in errors (chat: `max_tokens` given as
    `max_completion_tokens`)."""
    if not 1 <= req.n <= MAX_N_API:  # OpenAI's API bound: n = 10**4 would hold the engine for minutes
        raise APIError(f"n: must be in [1, {MAX_N_API}], got {req.n}", "n")
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
        include_stop_str_in_output=req.include_stop_str_in_output,
        # as vLLM's server: a stream takes only what is new at each step, a full response only the end
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise bad_request_from(e, aliases=aliases) from None


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def unless_disconnected(request: Request, coro: Any) -> Any:
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


async def prime(request: Request, merged: AsyncIterator[tuple[int, RequestOutput]], default_param: str,
                 aliases: Optional[dict[str, str]] = None) -> Any:
    """Wait for the first output, so a request the engine refuses still gets a proper 400."""
    try:
        first = await unless_disconnected(request, _next_or_end(merged))
    except ValueError as e:
        raise bad_request_from(e, default_param, aliases) from None
    if isinstance(first, Response):
        with contextlib.suppress(Exception):
            await merged.aclose()
    return first


async def chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is _END:
        return
    yield first
    async for item in rest:
        yield item

INLINE_TOKENIZE_CHARS = 1024  # a text this short tokenises in well under 0.1 ms with a fast tokenizer
INLINE_CHECK_IDS = 4096  # token ids checked on the loop up to this many (~0.2 ms)


def _cheap_to_tokenize(prompts: list[Any]) -> bool:
    """All of a request's prompts together are short enough to check on the loop (the budget holds for
    the request, not per prompt: 10^5 one-token prompts are as much work as one of 10^5 tokens)."""
    chars = ids = 0
    for prompt in prompts:
        if isinstance(prompt, dict):  # rendered chat: ids already there
            prompt = prompt.get("prompt_token_ids")
        if isinstance(prompt, str):
            chars += len(prompt)
        elif isinstance(prompt, list):  # validated by the input processor
            ids += len(prompt)
        else:
            return False
        if chars > INLINE_TOKENIZE_CHARS or ids > INLINE_CHECK_IDS:
            return False
    return True


def check_seqs_per_request(num_prompts: int, n: int, limit: int) -> None:
    """Prompts x n (the sequences one request creates) within `limit` (`--max-seqs-per-request`): checked
    before anything is tokenised or submitted. Named `prompt` when the prompts are what is many, else `n`."""
    if num_prompts * n <= limit:
        return
    param = "prompt" if num_prompts > 1 else "n"
    raise APIError(f"{param}: {num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences, more than this "
                   f"server's limit of {limit} per request (servetwin serve --max-seqs-per-request)", param)


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def _parse(self, cls: type, raw: dict[str, Any], large: bool) -> Any:
        """`parse_request` (a 400 naming the field), in the tokenizer thread for a large body: a list of
        10^5 prompts costs pydantic and the surrogate scan 100s of ms."""
        if large:
            return await self.state.run_cpu(parse_request, cls, raw)
        return parse_request(cls, raw)

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in (self.state.model_name, self.state.args.model):
            raise APIError(f"The model `{model}` does not exist.", "model", 404, "NotFoundError")

    async def _tokenize(self, engine: AsyncLLM, prompts: list[Any], params: SamplingParams,
                        max_tokens_param: str, aliases: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
        """Tokenise every prompt (in the tokenizer thread) and check that prompt + max_tokens fits
        max_model_len: a 400 like vLLM's server (the offline `LLM` caps the output at max_model_len).

        Prompts given as token ids, and short texts, are checked here on the loop: the hop to the thread
        and back costs the loop more than they do (a burst of 128 such requests spent its time in the
        hops and in the GIL handoffs between the two threads)."""
        if _cheap_to_tokenize(prompts):
            return self._tokenize_sync(engine, prompts, params, max_tokens_param, aliases)
        return await self.state.run_cpu(self._tokenize_sync, engine, prompts, params, max_tokens_param, aliases)

    @staticmethod
    def _tokenize_sync(engine: AsyncLLM, prompts: list[Any], params: SamplingParams, max_tokens_param: str,
                       aliases: Optional[dict[str, str]]) -> list[dict[str, Any]]:
        out = []
        max_len = engine.max_model_len
        for prompt in prompts:
            try:
                text, ids = engine.input_processor.tokenize(prompt)
            except ValueError as e:
                raise bad_request_from(e, "prompt", aliases) from None
            if len(ids) >= max_len:  # also checked in add_request; here it costs the event loop nothing
                param = (aliases or {}).get("prompt", "prompt")
                raise APIError(f"{param}: the prompt is {len(ids)} tokens long; max_model_len is {max_len} and at "
                               "least one output token must fit", param)
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


__all__ = ["ServerShuttingDownError", "engine_error", "engine_error_event", "ServerState", "OpenAIServing", "sse", "token_str", "common_params", "merge_streams",
           "unless_disconnected", "prime", "chain", "json_encoder", "check_seqs_per_request"]
