"""`POST /v1/completions` (vLLM's `serving_completion.py`): prompts as text, token ids or lists of
either; `echo`, `logprobs` (with the prompt's when echoing), `n`, streaming with usage."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from servetwin.core.engine.async_llm import AsyncLLM
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.request_output import RequestOutput
from servetwin.core.entrypoints.openai.protocol import (APIError, CompletionRequest, bad_request_from,
                                                        error_body)
from servetwin.core.entrypoints.openai.serving_engine import (OpenAIServing, chain, check_seqs_per_request,
                                                              common_params, requested_prompt_logprobs,
                                                              engine_error_event, json_encoder, merge_streams,
                                                              prime, sse, token_str, unless_disconnected)


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
        s = token_str(tokenizer, tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(d.get(tid))
        ranked = sorted(d.items(), key=lambda kv: -kv[1])
        top = dict((token_str(tokenizer, t), lp) for t, lp in ranked[:max(top_n, 0)])
        if tid in d:
            top.setdefault(s, d[tid])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, raw: dict[str, Any], large: bool, request: Request) -> Response:
        engine = self.state.ready_engine()
        prompt = raw.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            # before validation: pydantic holds the GIL for its whole pass over 10^5 prompts, even in a thread
            check_seqs_per_request(len(prompt), 1, self.state.limits.max_seqs_per_request)
        req = await self._parse(CompletionRequest, raw, large)
        self._check_model(req.model)
        if req.suffix is not None:
            raise APIError("suffix: not supported by servetwin", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(f"best_of: only best_of == n is supported, got best_of={req.best_of}, n={req.n}",
                           "best_of")
        if req.logprobs is not None and req.logprobs < 0:
            raise APIError(f"logprobs: must be >= 0, got {req.logprobs}", "logprobs")
        prompts = _completion_prompts(req)
        prompt_lps = requested_prompt_logprobs(req, self.state.args.max_logprobs)
        if prompt_lps is None and req.echo and req.logprobs is not None:
            prompt_lps = req.logprobs
        params = common_params(req, req.max_tokens, req.logprobs, prompt_lps, self.state.args.max_logprobs)
        check_seqs_per_request(len(prompts), req.n, self.state.limits.max_seqs_per_request)
        prompts = await self._tokenize(engine, prompts, params, "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        collectors = self._submit(engine, prompts, params, req.priority, request_id)
        created = int(time.time())
        model = req.model or self.state.model_name
        tok = engine.get_tokenizer()
        merged = merge_streams([engine.stream(c) for c in collectors])
        first = await prime(request, merged, "prompt")
        if isinstance(first, Response):
            return first
        outputs = chain(first, merged)
        if req.stream:
            gen = self._completion_stream(engine, req, outputs, request_id, created, model, tok)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await unless_disconnected(
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
        return Response(json_encoder.encode(body), media_type="application/json")

    async def _completion_stream(self, engine: AsyncLLM, req: CompletionRequest, outputs: AsyncIterator[Any],
                                 request_id: str, created: int, model: str, tok: Any) -> AsyncIterator[bytes]:
        # the outputs are deltas (RequestOutputKind.DELTA): only what is new since the previous chunk
        sent_tokens: dict[tuple[int, int], int] = {}  # a key is here once its first chunk went out
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
                    first = key not in sent_tokens
                    delta, new_ids = c.text, c.token_ids
                    if first and req.echo:
                        delta = self._echo_text(tok, out) + delta
                    if not delta and not new_ids and c.finish_reason is None and not first:
                        continue
                    lp = None
                    if req.logprobs is not None:
                        prefix = self._echo_logprob_prefix(out) if (first and req.echo) else None
                        lp = _completion_logprobs(None if req.return_tokens_as_token_ids else tok, new_ids,
                                                  c.logprobs or [], req.logprobs,
                                                  text_offset.get(key, 0), prefix)
                        if lp["tokens"]:
                            text_offset[key] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    sent_tokens[key] = sent_tokens.get(key, 0) + len(new_ids)
                    if c.finish_reason is not None:
                        finished.add(key)
                    choices.append({"index": i * req.n + c.index, "text": delta, "logprobs": lp,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if choices:
                    yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                                "choices": choices})
            if include_usage:
                p, ct = sum(prompt_tokens.values()), sum(sent_tokens.values())
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": ct,
                                                     "total_tokens": p + ct}})
        except EngineDeadError as e:  # the engine died, or the server is stopping: an error event, then [DONE]
            yield engine_error_event(e)
        except ValueError as e:
            err = bad_request_from(e, "prompt")
            yield sse(error_body(err.message, err.param, 400, err.type))
        yield b"data: [DONE]\n\n"


__all__ = ["OpenAIServingCompletion"]
