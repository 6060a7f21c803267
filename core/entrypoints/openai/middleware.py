"""Pure ASGI middleware of the OpenAI server: the request size limit and the API key.

Both answer in the server's error shape (`protocol.error_body`) before a route runs. They are plain
ASGI callables (not Starlette's `BaseHTTPMiddleware`, which buffers streaming responses).
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Awaitable, Callable, Optional

from servetwin.core.entrypoints.openai.protocol import APIError, error_body

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a 128k-token prompt as text or as JSON token ids is < 1 MiB


def too_large(limit: int) -> APIError:
    return APIError(f"body: the request body is larger than the server's limit of {limit} bytes "
                    "(servetwin serve --max-request-bytes)", "body", 413, "RequestTooLargeError")


async def send_error(send: Callable[[dict], Awaitable[None]], e: APIError,
                     headers: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    body = json.dumps(error_body(e.message, e.param, e.status, e.type)).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope: dict[str, Any], name: bytes) -> Optional[bytes]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class RequestSizeLimit:
    """413 for a body over `max_bytes`: at once from Content-Length (the body is never read), and for a
    body sent without one (chunked) as soon as the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            await send_error(send, too_large(self.max_bytes))
            return
        received = 0
        limit = self.max_bytes

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit)  # inside the route: answered by the APIError handler
            return message

        await self.app(scope, limited_receive, send)


# Routes guarded besides `/v1/*`: the profiler's write to the server's disk and slow the engine. vLLM's
# `--api-key` leaves them open (it guards `/v1` only); servetwin does not (docs/serving.md).
GUARDED_ROUTES = ("/start_profile", "/stop_profile")


class APIKeyAuth:
    """`Authorization: Bearer <key>` on every `/v1/*` route (vLLM's `--api-key`) and `GUARDED_ROUTES`;
    else a 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not (
                path.startswith("/v1") or path in GUARDED_ROUTES):
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization") or b""
        if not secrets.compare_digest(given, self.expected):
            await send_error(send, APIError("Unauthorized: a valid API key is required (Authorization: Bearer "
                                            "<key>)", None, 401, "AuthenticationError"),
                             [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


__all__ = ["RequestSizeLimit", "APIKeyAuth", "DEFAULT_MAX_REQUEST_BYTES", "send_error", "too_large"]
