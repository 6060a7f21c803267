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

Modules (as in vLLM): `protocol` (request schemas, the error shape), `serving_engine` (the server state
and what both endpoints share), `serving_completion`, `serving_chat`, and this one (app, routes,
lifecycle).

Run it with `servetwin serve --model M --backend torch|sim|fake [engine args] --host H --port P`
(`experiments/serve_cli.py`), or `run_server(EngineArgs(...), host=..., port=...)`.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.entrypoints.openai.protocol import APIError, error_response
from servetwin.core.entrypoints.openai.serving_chat import OpenAIServingChat
from servetwin.core.entrypoints.openai.serving_completion import OpenAIServingCompletion
from servetwin.core.entrypoints.openai.serving_engine import ServerState


# -- the app --------------------------------------------------------------------------------------------
def build_app(args: EngineArgs, *, served_model_name: Optional[str] = None, pace: Optional[bool] = None,
              time_scale: float = 1.0, fake_step_time_s: Optional[float] = None,
              startup_timeout_s: Optional[float] = None) -> FastAPI:
    engine_kwargs: dict[str, Any] = {"pace": pace, "time_scale": time_scale, "fake_step_time_s": fake_step_time_s}
    if startup_timeout_s is not None:
        engine_kwargs["startup_timeout_s"] = startup_timeout_s
    state = ServerState(args, served_model_name or args.model, engine_kwargs)
    serving_completion = OpenAIServingCompletion(state)
    serving_chat = OpenAIServingChat(state)

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
        return await serving_completion.create_completion(await _body(request), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serving_chat.create_chat_completion(await _body(request), request)

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


__all__ = ["build_app", "run_server"]