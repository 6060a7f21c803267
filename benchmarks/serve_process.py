"""Shared by the server benchmarks: wait for a `servetwin serve` child to answer /health."""
from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Return once GET `url`/health answers 200; RuntimeError if `proc` exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not become healthy within {timeout_s:.0f} s")
        time.sleep(0.1)
