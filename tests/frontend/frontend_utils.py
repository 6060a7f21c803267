"""Helpers for the front-end tests: backend availability, free ports, process checks, test servers."""
from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def backend_available(name: str) -> bool:
    """torch: servetwin.gpu.executor imports; sim: servetwin.sim.kv_pool imports (both are written by other sessions)."""
    module = {"torch": "servetwin.gpu.executor", "sim": "servetwin.sim.kv_pool"}[name]
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001
        return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def descendants(pid: int) -> list[int]:
    """Live descendant pids of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        children.setdefault(int(rest[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return [p for p in out if pid_alive(p)]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, even if it is SIGKILLed (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


class ServerProcess:
    """`python -m servetwin.experiments.cli serve ...` on a free loopback port; `stop()` leaves no process behind."""

    def __init__(self, *cli_args: str, startup_timeout: float = 90.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [PY, "-m", "servetwin.experiments.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *cli_args]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self.engine_pids: list[int] = []
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy within {startup_timeout} s")
            time.sleep(0.1)
        self.engine_pids = descendants(self.proc.pid)

    def stop(self, timeout: float = 15.0) -> str:
        """SIGTERM, wait; SIGKILL what is left (by pid). Returns the server's output."""
        procs = set(descendants(self.proc.pid)) | set(self.engine_pids)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        leftovers = [p for p in procs if not wait_gone(p, 15.0)]  # generous: the host may be busy
        for p in leftovers:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out = self.output()
        self.log.close()
        assert not leftovers, f"processes left after the server stopped: {leftovers}\n{out}"
        return out

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


def run_script(code: str, timeout: float = 60.0, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
