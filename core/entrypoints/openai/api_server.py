"""OpenAI-compatible HTTP server over `AsyncLLM` (FastAPI + uvicorn), like `vllm serve`.

Endpoints:
- `POST /v1/completions`, `POST /v1/chat/completions`: streaming (SSE, `data: {...}` lines ending with
  `data: [DONE]`) and not; `n`, `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`
  (at most 4 strings, vLLM's API cap), `stop_token_ids`, `logprobs` (chat: `logprobs` + `top_logprobs`),
  `echo`, `ignore_eos`, `min_tokens`, penalties, `stream_options.include_usage`.
- `POST /tokenize`, `POST /detokenize`, `GET /version` (vLLM's shapes, `serving_tokenization`);
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
(`experiments/serve/serve_cli.py`), or `run_server(EngineArgs(...), host=..., port=...)`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import os
import sys
from typing import Any, AsyncIterator, Coroutine, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.metrics import render_engine_health
from servetwin.core.entrypoints.openai.http_limits import ServerLimits, limited_http_protocol
from servetwin.core.entrypoints.openai.middleware import APIKeyAuth, RequestSizeLimit
from servetwin.core.entrypoints.openai.protocol import (APIError, error_response, parse_json_body, status_type,
                                                        worth_a_thread)
from servetwin.core.entrypoints.openai.serving_chat import OpenAIServingChat
from servetwin.core.entrypoints.openai.serving_completion import OpenAIServingCompletion
from servetwin.core.entrypoints.openai.serving_engine import ServerShuttingDownError, ServerState, engine_error
from servetwin.core.entrypoints.openai.serving_tokenization import OpenAIServingTokenization, servetwin_version

logger = logging.getLogger("servetwin.server")


LARGE_BODY_BYTES = 256 * 1024
ENGINE_DEAD_LINGER_S = 2.0  # after the engine died: streams end with their error event, /metrics says so
SHUTDOWN_GRACE_S = 1  # uvicorn's wait for connections after SIGTERM (the streams are aborted at once)


async def _watch_engine(state: ServerState) -> None:
    """When the engine process dies, stop the server (vLLM does the same): an orchestrator restarts it."""
    while not state.closing and (state.engine is None or not state.engine.errored):
        if state.startup_error is not None:
            return
        await asyncio.sleep(0.1)
    if state.closing:
        return
    state.engine_died = True
    logger.error("the engine died (%s); the server stops in %.0f s", state.engine.dead_error, ENGINE_DEAD_LINGER_S)
    await asyncio.sleep(ENGINE_DEAD_LINGER_S)
    if state.on_engine_dead is not None:
        state.on_engine_dead()


# -- the app --------------------------------------------------------------------------------------------
def build_app(args: EngineArgs, *, served_model_name: Optional[str] = None, pace: Optional[bool] = None,
              time_scale: float = 1.0, fake_step_time_s: Optional[float] = None,
              startup_timeout_s: Optional[float] = None, limits: Optional[ServerLimits] = None,
              api_key: Optional[str] = None, profiler_dir: Optional[str] = None) -> FastAPI:
    """The app; `limits` bound request bodies and prompts per request (`ServerLimits`, defaults when
    None), `api_key` guards `/v1/*`; `profiler_dir`: vLLM's `POST /start_profile` and `/stop_profile`
    write the steps in between there (the torch backend: a torch.profiler trace; the simulator: its
    predicted steps in the same shape)."""
    limits = limits or ServerLimits()
    engine_kwargs: dict[str, Any] = {"pace": pace, "time_scale": time_scale, "fake_step_time_s": fake_step_time_s}
    if startup_timeout_s is not None:
        engine_kwargs["startup_timeout_s"] = startup_timeout_s
    state = ServerState(args, served_model_name or args.model, engine_kwargs, limits)
    serving_completion = OpenAIServingCompletion(state)
    serving_chat = OpenAIServingChat(state)
    serving_tokenization = OpenAIServingTokenization(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starter = asyncio.ensure_future(state.start_engine())
        watchdog = asyncio.ensure_future(_watch_engine(state))
        app.state.starter = starter
        try:
            yield
        finally:
            watchdog.cancel()
            state.closing = True
            state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            if state.engine is not None:
                state.engine.shutdown()
            if not starter.done():
                # the engine is still loading in a worker thread: it shuts itself down when done
                await asyncio.wait({starter}, timeout=1.0)

    app = FastAPI(title="servetwin OpenAI-compatible server", lifespan=lifespan)
    app.state.servetwin = state
    if limits.max_request_bytes:
        app.add_middleware(RequestSizeLimit, max_bytes=limits.max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyAuth, api_key=api_key)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # 404 (no such route), 405 (wrong method): the same error shape as every other answer
        message = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(APIError(message, None, e.status_code, status_type(e.status_code)),
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return error_response(APIError(f"internal server error: {type(e).__name__}: {e}", None, 500,
                                       "InternalServerError"))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(engine_error(e))

    async def _body(request: Request) -> tuple[dict[str, Any], bool]:
        """The body as a JSON object, and whether it is large enough to validate off the loop too."""
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone (or dropped at --read-timeout) before its body arrived
            raise APIError("body: the client disconnected before the body arrived", "body", 408,
                           "RequestTimeoutError") from None
        if not worth_a_thread(raw, LARGE_BODY_BYTES):
            return parse_json_body(raw), False
        return await state.run_cpu(parse_json_body, raw), True  # megabytes of JSON: parsed off the event loop

    @app.api_route("/health", methods=["GET", "HEAD"])
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
        text += render_engine_health(state.engine_died or (state.engine is not None and state.engine.errored))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving_completion.create_completion(*await _body(request), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serving_chat.create_chat_completion(*await _body(request), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await serving_tokenization.tokenize(*await _body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await serving_tokenization.detokenize(*await _body(request))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": servetwin_version()})

    if profiler_dir is not None:  # as vLLM: the routes exist only with a profiler directory
        @app.post("/start_profile")
        async def start_profile() -> Response:
            try:  # checked again here: the folder may have gone since start-up (nothing starts then)
                check_profiler_dir(profiler_dir)
            except ConfigError:  # the reply names the flag, not the server's path (the log has it)
                logger.error("/start_profile: %s is not a writable folder", profiler_dir)
                raise APIError("the profiler directory (--profiler-dir) is not a writable folder; profiling not "
                               "started", None, 500, "InternalServerError") from None
            await state.ready_engine().start_profile(profiler_dir)
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> JSONResponse:
            path = await state.ready_engine().stop_profile()
            # the file's name in the profiler directory: the server's own paths stay out of replies
            return JSONResponse({"trace": None if path is None else os.path.basename(path)})

    return app


def uvicorn_config(app: Any, *, host: str, port: int, log_level: str, limits: Optional[ServerLimits] = None) -> Any:
    """The server's uvicorn settings. httptools (a C parser) where installed, with the connection limits of
    `http_limits` (head size and count, read deadline): per SSE chunk h11, pure Python, cost about as much
    as the rest of the send path. Without httptools, h11 with its head-size limit."""
    import uvicorn  # noqa: PLC0415

    limits = limits or ServerLimits()
    protocol = limited_http_protocol(limits)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol or "h11",
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          timeout_keep_alive=limits.timeout_keep_alive_s,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=SHUTDOWN_GRACE_S, access_log=False)


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the server's loop on uvloop where it is installed (as `vllm serve` does; uvicorn's own runner
    picks it the same way), else on asyncio's. Optimisation: uvloop's callbacks and socket writes are
    C; with 128 streams at ~10k chunks/s the loop's own overhead is what delays /health."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def check_profiler_dir(path: str) -> str:
    """`--profiler-dir`, created and proved writable (a file made and removed), or a `ConfigError`
    naming the flag: an unwritable folder found only at /stop_profile lost the profile and left it on."""
    import tempfile  # noqa: PLC0415

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".servetwin-write-check-"):
            pass
    except OSError as e:
        raise ConfigError("--profiler-dir", f"{path} is not a writable folder "
                                            f"({e.strerror or type(e).__name__})") from None
    return path


def run_server(args: EngineArgs, *, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: Optional[str] = None, pace: Optional[bool] = None, time_scale: float = 1.0,
               fake_step_time_s: Optional[float] = None, log_level: str = "warning",
               startup_timeout_s: Optional[float] = None, limits: Optional[ServerLimits] = None,
               api_key: Optional[str] = None, profiler_dir: Optional[str] = None) -> int:
    """Serve until SIGTERM (returns 0), SIGINT (`KeyboardInterrupt` once shut down: the CLI exits 130) or
    until the engine process dies (1).

    Raises the engine's start-up error if it fails to start. On SIGTERM / SIGINT the server stops
    accepting connections, aborts every request in flight (a stream gets an error event, 503
    `ServiceUnavailableError`, then `data: [DONE]`; a non-streamed request a 503), stops the engine and
    returns, within about a second."""
    import uvicorn  # noqa: PLC0415

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # runs in the signal handler: the aborts go through the loop
            if loop is not None and not state.closing:
                loop.call_soon_threadsafe(_abort_in_flight)
            super().handle_exit(sig, frame)

    app = build_app(args, served_model_name=served_model_name, pace=pace, time_scale=time_scale,
                    fake_step_time_s=fake_step_time_s, startup_timeout_s=startup_timeout_s, limits=limits,
                    api_key=api_key, profiler_dir=profiler_dir)
    server = Server(uvicorn_config(app, host=host, port=port, log_level=log_level, limits=limits))
    state: ServerState = app.state.servetwin
    loop: Optional[asyncio.AbstractEventLoop] = None

    def _abort_in_flight() -> None:
        state.closing = True
        if state.engine is not None and not state.engine.errored:
            n = state.engine.abort_all(ServerShuttingDownError("the server is shutting down"))
            if n:
                logger.warning("shutting down: aborted %d request(s) in flight", n)

    def _stop(e: Optional[BaseException] = None) -> None:
        server.should_exit = True

    async def _serve() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        await server.serve()

    state.on_startup_failure = _stop
    state.on_engine_dead = _stop
    # uvicorn re-raises the signal it caught once it has shut down (so a process dies "by" it): SIGTERM is
    # the orchestrator's normal stop, answered with exit status 0, so it lands on this handler instead,
    # which also stops a server whose own handlers are not installed yet
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    try:
        run_event_loop(_serve())
    finally:
        signal.signal(signal.SIGTERM, previous)
    if state.startup_error is not None:
        raise state.startup_error
    if state.engine_died:
        reason = state.engine.dead_error if state.engine is not None else "unknown"
        print(f"servetwin serve: the engine process died ({reason}); the server stopped", file=sys.stderr, flush=True)
        return 1
    return 0


__all__ = ["build_app", "run_event_loop", "run_server", "uvicorn_config"]