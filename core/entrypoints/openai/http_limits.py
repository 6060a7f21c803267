"""Connection-level limits of the OpenAI server: header size and count, and a read deadline.

uvicorn's httptools protocol (the C parser the server runs on, as `vllm serve` does) has neither a
header size limit nor a read timeout: a client could send a 64 MB header (buffered, then parsed on
the event loop), or hold a connection open forever by sending a byte now and then (its keep-alive
timeout only runs between requests). `limited_http_protocol(limits)` is uvicorn's
`HttpToolsProtocol` with, per connection:

- header bytes: once the bytes of a request's head (request line + headers) pass `max_header_bytes`
  without the head being complete, a 431 and the connection is closed (the head is never parsed
  further); more than `max_header_count` headers: the same;
- read deadline: a request's head and body must arrive within `read_timeout_s` of its first byte
  (of the connection, for the first request); else a 408 when no response has started, and the
  connection is closed (the route, if it was reading the body, sees a disconnect);
- a malformed request gets a 400 in the server's JSON error shape, not uvicorn's plain text.

Between requests on a keep-alive connection uvicorn's own `timeout_keep_alive` applies. These are
public protocol callbacks (asyncio's `Protocol` and httptools' parser callbacks); the subclass adds
only its own state.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Optional

from servetwin.core.entrypoints.openai.middleware import DEFAULT_MAX_REQUEST_BYTES
from servetwin.core.entrypoints.openai.protocol import error_body


@dataclass(slots=True)
class ServerLimits:
    """What one request or connection may cost the server (`servetwin serve` flags of the same names)."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a body; 0: no limit
    max_seqs_per_request: int = 256  # prompts x n of one completion request (sequences it creates)
    max_header_bytes: int = 64 * 1024  # a request's head (request line + headers)
    max_header_count: int = 256  # headers in one request (vLLM's --h11-max-header-count default)
    read_timeout_s: float = 30.0  # for a request's head and body to arrive; 0: no deadline
    timeout_keep_alive_s: float = 5.0  # idle between requests (uvicorn's / vLLM's default)


def raw_error(status: int, reason: str, message: str, type_: str) -> bytes:
    """A complete HTTP/1.1 error response in the server's JSON shape, closing the connection."""
    body = json.dumps(error_body(message, None, status, type_)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def limited_http_protocol(limits: ServerLimits) -> Optional[type]:
    """uvicorn's httptools protocol with `limits` (None when httptools is missing: uvicorn then uses
    h11, whose `h11_max_incomplete_event_size` bounds the head; `uvicorn_config` passes it)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: PLC0415
    except ImportError:
        return None

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.st_head_bytes = 0
            self.st_header_count = 0
            self.st_in_head = True
            self.st_rejected = False
            self.st_deadline: Optional[asyncio.TimerHandle] = None
            self.st_arm()

        def st_arm(self) -> None:
            if self.st_deadline is None and limits.read_timeout_s > 0:
                self.st_deadline = self.loop.call_later(limits.read_timeout_s, self.st_timed_out)

        def st_disarm(self) -> None:
            if self.st_deadline is not None:
                self.st_deadline.cancel()
                self.st_deadline = None

        def st_reject(self, status: int, reason: str, message: str, type_: str) -> None:
            self.st_disarm()
            self.st_rejected = True
            if not self.transport.is_closing():
                # an answer only where no other response is on the wire (a pipelined one still streaming)
                if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                    self.transport.write(raw_error(status, reason, message, type_))
                self.transport.close()

        def st_timed_out(self) -> None:
            self.st_deadline = None
            self.st_reject(408, "Request Timeout", f"the request did not arrive within {limits.read_timeout_s:g} s "
                           "(servetwin serve --read-timeout)", "RequestTimeoutError")

        def data_received(self, data: bytes) -> None:
            if self.st_in_head:
                self.st_head_bytes += len(data)
            super().data_received(data)
            if self.st_in_head and self.st_head_bytes > limits.max_header_bytes:
                self.st_reject(431, "Request Header Fields Too Large", "the request line and headers are larger "
                               f"than {limits.max_header_bytes} bytes (servetwin serve --max-header-bytes)",
                               "RequestHeaderFieldsTooLargeError")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.st_arm()

        def on_header(self, name: bytes, value: bytes) -> None:
            self.st_header_count += 1
            if self.st_header_count > limits.max_header_count:
                self.st_reject(431, "Request Header Fields Too Large", f"more than {limits.max_header_count} "
                               "headers (servetwin serve --max-header-count)", "RequestHeaderFieldsTooLargeError")
                return
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self.st_in_head = False
            if self.st_rejected:
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self.st_rejected:  # the rest of a chunk the parser is still feeding after a 431
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self.st_rejected:
                return
            super().on_message_complete()
            self.st_disarm()  # the response may take minutes (a stream): only reading is bounded
            self.st_in_head, self.st_head_bytes, self.st_header_count = True, 0, 0

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self.st_disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self.st_disarm()
            self.transport.write(raw_error(400, "Bad Request", f"malformed HTTP request: {msg}", "BadRequestError"))
            self.transport.close()

    return LimitedHttpToolsProtocol


__all__ = ["ServerLimits", "limited_http_protocol", "raw_error"]
