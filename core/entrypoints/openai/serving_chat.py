"""`POST /v1/chat/completions` (vLLM's `serving_chat.py`): the tokenizer's chat template, text content
parts, `logprobs` + `top_logprobs`, vLLM's `echo` of a trailing assistant message, streaming with usage."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.request_output import RequestOutput
from servetwin.core.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, bad_request_from,
                                                        error_body)
from servetwin.core.entrypoints.openai.serving_engine import (OpenAIServing, chain, check_seqs_per_request,
                                                              common_params, requested_prompt_logprobs,
                                                              engine_error_event, json_encoder, merge_streams,
                                                              prime, sse, token_str, unless_disconnected)


def render_chat(tok: Any, messages: list[Any], add_generation_prompt: bool,
                continue_final_message: bool = False) -> tuple[str, list[int]]:
    """The chat template applied to text-only messages: (prompt text, token ids without added specials)."""
    flat = []
    for msg in messages:
        content = msg.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise APIError(f"messages: content part type {part.get('type')!r} is not supported "
                                   "(only 'text')", "messages")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        flat.append({"role": msg.role, "content": content or ""})
    kwargs = {"continue_final_message": True} if continue_final_message else {}
    try:
        text = tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        ids = list(tok.encode(text, add_special_tokens=False))
    except Exception as e:  # noqa: BLE001 - template errors are the caller's
        raise APIError(f"messages: cannot apply the chat template: {e}", "messages") from None
    return text, ids


_NAMED_TOOL = '{"type": "function", "function": {"name": "my_function"}}'


def check_tool_usage(req: ChatCompletionRequest) -> None:
    """vLLM's `check_tool_usage` (chat_completion/protocol.py:975-1056): tools given as [] or a
    tool_choice without tools, of an unknown value, or naming no given tool, are 400s. servetwin
    generates unconstrained tokens: a valid tool request runs as a plain chat."""
    if req.tools == []:
        raise APIError("tools: must not be an empty array; give at least one tool or omit the field", "tools")
    choice = req.tool_choice
    if choice is None or choice == "none":
        return
    if req.tools is None:
        raise APIError("tool_choice: when using tool_choice, tools must be set", "tool_choice")
    if isinstance(choice, str):
        return  # "auto" / "required" (the schema allows nothing else)
    function = choice.get("function")
    if not isinstance(function, dict):
        raise APIError(f"tool_choice.function: must be an object; correct usage: {_NAMED_TOOL}", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(f"tool_choice.function.name: must be a non-empty string; correct usage: {_NAMED_TOOL}",
                       "tool_choice.function.name")
    if all(tool.function.name != name for tool in req.tools):
        raise APIError("tool_choice: the tool specified in tool_choice does not match any of the specified tools",
                       "tool_choice")


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, raw: dict[str, Any], large: bool, request: Request) -> Response:
        engine = self.state.ready_engine()
        req = await self._parse(ChatCompletionRequest, raw, large)
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
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        check_tool_usage(req)
        params = common_params(req, max_tokens, logprobs, requested_prompt_logprobs(req, self.state.args.max_logprobs),
                               self.state.args.max_logprobs, {"max_tokens": max_tokens_param})
        check_seqs_per_request(1, req.n, self.state.limits.max_seqs_per_request)
        # the chat template and its tokens run in the tokenizer thread: both cost CPU time
        text, ids = await self.state.run_cpu(render_chat, tok, req.messages, req.add_generation_prompt)
        prompts = await self._tokenize(engine, [{"prompt": text, "prompt_token_ids": ids}], params,
                                 max_tokens_param,
                                 {"prompt": "messages"})
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        collectors = self._submit(engine, prompts, params, req.priority, request_id, {"prompt": "messages"})
        created = int(time.time())
        model = req.model or self.state.model_name
        merged = merge_streams([engine.stream(c) for c in collectors])
        first = await prime(request, merged, "messages", {"prompt": "messages"})
        if isinstance(first, Response):
            return first
        outputs = chain(first, merged)
        if req.stream:
            return StreamingResponse(self._chat_stream(req, outputs, request_id, created, model, tok),
                                     media_type="text/event-stream")
        return await unless_disconnected(request, self._chat_full(req, outputs, request_id, created, model, tok))

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
            s = token_str(tok, tid)
            ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": s, "logprob": d.get(tid, float("-inf")), "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": token_str(tok, t), "logprob": lp,
                                              "bytes": list(token_str(tok, t).encode("utf-8"))} for t, lp in ranked]})
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
        return Response(json_encoder.encode(body), media_type="application/json")

    async def _chat_stream(self, req: ChatCompletionRequest, outputs: AsyncIterator[Any], request_id: str,
                           created: int, model: str, tok: Any) -> AsyncIterator[bytes]:
        # the outputs are deltas (RequestOutputKind.DELTA): only what is new since the previous chunk
        sent_tokens: dict[int, int] = {}
        finished: set[int] = set()
        prompt_tokens = 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]]) -> bytes:
            return sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
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
                    delta, new_ids = c.text, c.token_ids
                    if not delta and not new_ids and c.finish_reason is None:
                        continue
                    lp = None
                    if req.logprobs:
                        lp = self._chat_logprobs(None if req.return_tokens_as_token_ids else tok, new_ids,
                                                 c.logprobs or [], req.top_logprobs or 0)
                    sent_tokens[c.index] = sent_tokens.get(c.index, 0) + len(new_ids)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    choices.append({"index": c.index, "delta": {"content": delta} if delta else {},
                                    "logprobs": lp, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})
                if choices:
                    yield chunk(choices)
            if include_usage:
                ct = sum(sent_tokens.values())
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": ct,
                                                     "total_tokens": prompt_tokens + ct}})
        except EngineDeadError as e:  # the engine died, or the server is stopping: an error event, then [DONE]
            yield engine_error_event(e)
        except ValueError as e:
            err = bad_request_from(e, "messages", {"prompt": "messages"})
            yield sse(error_body(err.message, err.param, 400, err.type))
        yield b"data: [DONE]\n\n"



__all__ = ["OpenAIServingChat"]
