"""The server runs on the C event loop and HTTP parser that `vllm serve` uses (uvloop, httptools): with
pure-Python h11 on asyncio's loop, 128 streams kept /health waiting up to 118 ms (benchmarks/server_stall.py)."""
from __future__ import annotations

import asyncio
import sys

import pytest

from servetwin.core.entrypoints.openai.api_server import run_event_loop, uvicorn_config


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build (a dependency elsewhere)")
def test_the_server_loop_is_uvloop():
    seen: list[str] = []

    async def main() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)

    run_event_loop(main())
    assert seen and seen[0].startswith("uvloop")


def test_the_server_parses_http_with_httptools():
    async def app(scope, receive, send) -> None:  # a bare ASGI app: only the protocol choice is under test
        pass

    config = uvicorn_config(app, host="127.0.0.1", port=0, log_level="warning")
    config.load()
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    # httptools, with the connection limits of `http_limits` (head size and count, read deadline)
    assert issubclass(config.http_protocol_class, HttpToolsProtocol)
    assert config.http_protocol_class.__name__ == "LimitedHttpToolsProtocol"
