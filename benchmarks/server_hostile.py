"""Hostile input against the server and the command line (issue 27): nothing freezes, nothing exhausts memory.

Part 1, the server: starts `servetwin serve --backend fake` (toy tokenizer) on a loopback port and,
one at a time, sends the hostile requests of issue 27 items 1, 3, 5 and 6 while a separate process
polls `GET /health` every 20 ms on its own connection. Printed per case: the answer (status), its
time, the longest /health answer during the case, and PASS when /health stayed under 100 ms, no 5xx
came back, and the answer is the expected one (a 4xx, or a 200 for a legal request). Cases:

- 1: `{"prompt": [[5]] * 100000, "max_tokens": 1}` and `{"prompt": [[5]] * 1000, "n": 128}` (400:
  more sequences than --max-seqs-per-request), and a legal 200 prompts x n=1 (200);
- 3: `/tokenize` of a 4 MB text (200, tokenised in the tokenizer thread), `/detokenize` of 500k ids;
- 5: a body over 256 KiB nested 980 levels (400, completions and chat);
- 6: a 64 MB header (431 after 64 KiB), 30 slow-header and 10 slow-body connections (each closed by
  the server, 408, within --read-timeout, here 3 s).

Part 2, the command line: every hostile file case of issue 27 (items 2, 9, 10, 11, 12) through
`servetwin run` / `replay` in a subprocess: PASS when it exits 2 naming the field or file, within
5 s and under 500 MB peak RSS (`wait4`'s ru_maxrss), with no traceback and no file content echoed.
Large files are sparse (no disk used). Only loopback addresses; every loop is bounded.

Part 3, the profiler endpoints (issue 38 item 5): `servetwin serve --backend sim --api-key K
--profiler-dir D`: /start_profile and /stop_profile without the key (401), a profile over a stream of
requests (200; /stop_profile answers within 1 s, the reply names the file and no server path, the
trace holds at most MAX_PROFILE_STEPS steps), and the directory replaced by a file (/start_profile 500
naming --profiler-dir, nothing started).

Part 2 also runs every importer (`import vllm-trace`, `vllm-bench`, `vllm-log`, `calibrate --from-vllm`,
`compare --measured`) on a decompression bomb, a /dev/zero symlink, a FIFO, a folder and 100k-deep JSON
(issue 38 item 1): PASS when it exits 2 naming the file and the limit within 10 s under 600 MB.

Usage: python benchmarks/server_hostile.py [--part server|cli|profiler|all] [--backend fake|torch]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
from serve_process import wait_healthy  # the script's folder, benchmarks/, is on sys.path

HEALTH_LIMIT_S = 0.100
READ_TIMEOUT_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- part 1: the server ---------------------------------------------------------------------------------
def _probe(url: str, stop: Any, worst: Any, failures: Any) -> None:
    """In its own process: GET /health every 20 ms on one connection; the longest answer in `worst`."""
    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = client.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            dt = time.perf_counter() - t0
            with worst.get_lock():
                worst.value = max(worst.value, dt)
            if not ok:
                with failures.get_lock():
                    failures.value += 1
            time.sleep(0.02)


class Probe:
    def __init__(self, url: str) -> None:
        self.stop = multiprocessing.Event()
        self.worst = multiprocessing.Value("d", 0.0)
        self.failures = multiprocessing.Value("i", 0)
        self.proc = multiprocessing.Process(target=_probe, args=(url, self.stop, self.worst, self.failures),
                                            daemon=True)
        self.proc.start()
        time.sleep(0.2)

    def reset(self) -> None:
        time.sleep(0.1)
        with self.worst.get_lock():
            self.worst.value = 0.0

    def close(self) -> None:
        self.stop.set()
        self.proc.join(5)


def _raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 30.0) -> tuple[int, bytes]:
    """Send a raw request; (status or 0 when closed without one, the answer's bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(head + body)
        except OSError:
            pass
        return _read_status(s)


def _read_status(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data) < 12:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


def _huge_header(port: int) -> tuple[int, bytes]:
    """Send up to 64 MB of one header in 1 MB pieces until the server answers or closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: ")
        piece = b"a" * (1 << 20)
        for _ in range(64):
            try:
                s.sendall(piece)
            except OSError:
                break
        return _read_status(s)


def _slow_clients(port: int, n_head: int, n_body: int) -> tuple[int, bytes]:
    """Slow-header and slow-body connections, a byte every 0.5 s; (worst status, summary). Each must be
    closed by the server (408) within READ_TIMEOUT_S + 2 s; status 408 when all were."""
    socks = []
    for i in range(n_head + n_body):
        s = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S + 5)
        if i < n_head:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        else:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{")
        socks.append(s)
    t0 = time.monotonic()
    closed_at: dict[int, float] = {}
    statuses: dict[int, int] = {}
    while len(closed_at) < len(socks) and time.monotonic() - t0 < READ_TIMEOUT_S + 2:
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                s.sendall(b"x")
                s.settimeout(0.001)
                chunk = s.recv(65536)
                s.settimeout(READ_TIMEOUT_S + 5)
            except socket.timeout:
                s.settimeout(READ_TIMEOUT_S + 5)
                continue
            except OSError:
                chunk = b""
            closed_at[i] = time.monotonic() - t0
            statuses[i] = int(chunk.split(b" ", 2)[1]) if chunk.startswith(b"HTTP/1.1 ") else 0
        time.sleep(0.5)
    for s in socks:
        s.close()
    held = len(socks) - len(closed_at)
    worst = max(closed_at.values(), default=float("nan"))
    summary = f"{len(closed_at)}/{len(socks)} closed by the server, last after {worst:.1f} s, statuses " \
              f"{sorted(set(statuses.values()))}".encode()
    return (408 if held == 0 and set(statuses.values()) <= {408, 0} else 0), summary


def _nested(depth: int, pad: int) -> bytes:
    return b'{"prompt": "1 2", "max_tokens": 1, "pad": "' + b"x" * pad + b'", "deep": ' + b"[" * depth + \
        b"]" * depth + b"}"


def server_cases(url: str, port: int) -> list[tuple[str, Callable[[], tuple[int, bytes]], tuple[int, ...]]]:
    def post(path: str, body: Any) -> Callable[[], tuple[int, bytes]]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()

        def go() -> tuple[int, bytes]:
            r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=120)
            return r.status_code, r.content[:200]
        return go

    chat_deep = (b'{"messages": [{"role": "user", "content": "hi"}], "pad": "' + b"x" * 300_000 + b'", "deep": '
                 + b"[" * 980 + b"]" * 980 + b"}")
    return [
        ("1  100k one-token prompts", post("/v1/completions", {"prompt": [[5]] * 100000, "max_tokens": 1}), (400,)),
        ("1  1000 prompts x n=128", post("/v1/completions", {"prompt": [[5]] * 1000, "n": 128, "max_tokens": 1}),
         (400,)),
        ("1  200 prompts x n=1 (legal)", post("/v1/completions", {"prompt": [[5, 6]] * 200, "max_tokens": 1}),
         (200,)),
        ("3  /tokenize 4 MB text", post("/tokenize", {"prompt": "7 " * 2_000_000}), (200,)),
        ("3  /detokenize 500k ids", post("/detokenize", {"tokens": [7] * 500_000}), (200,)),
        ("5  completions 300 KB nested 980", post("/v1/completions", _nested(980, 300_000)), (400,)),
        ("5  chat 300 KB nested 980", post("/v1/chat/completions", chat_deep), (400,)),
        ("6  64 MB header", lambda: _huge_header(port), (431,)),
        ("6  30 slow-header + 10 slow-body", lambda: _slow_clients(port, 30, 10), (408,)),
    ]


def run_server_part(backend: str) -> bool:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = ["--model", "fake-model", "--backend", "fake", "--num-gpu-blocks", "4096"] if backend == "fake" else \
        ["--model", "tiny-llama", "--backend", "torch"]
    cmd = [sys.executable, "-m", "servetwin.experiments.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *model, "--max-model-len", "4096", "--read-timeout", str(READ_TIMEOUT_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    ok = True
    try:
        wait_healthy(url, proc)
        probe = Probe(url)
        print(f"{'case':36s} {'status':>6s} {'time s':>7s} {'/health max ms':>15s}  result")
        for name, go, expected in server_cases(url, port):
            probe.reset()
            t0 = time.perf_counter()
            status, detail = go()
            dt = time.perf_counter() - t0
            time.sleep(0.1)
            worst = probe.worst.value
            good = status in expected and worst < HEALTH_LIMIT_S and probe.failures.value == 0
            ok &= good
            print(f"{name:36s} {status:6d} {dt:7.2f} {worst * 1000:15.1f}  {'PASS' if good else 'FAIL'}"
                  + ("" if good else f"  {detail[:160]!r}"), flush=True)
        probe.close()
        if proc.poll() is not None:
            print(f"the server exited ({proc.returncode})")
            ok = False
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        print(f"server exit status on SIGTERM: {proc.returncode} (0 documented)")
        ok &= proc.returncode == 0
    return ok


# -- part 2: the command line ---------------------------------------------------------------------------
def _sparse(path: Path, size: int, head: bytes = b"") -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def _bomb(key: str) -> str:
    levels = "".join(f"l{i + 1}: &l{i + 1} [{', '.join([f'*l{i}'] * 9)}]\n" for i in range(8))
    return f"l0: &l0 [x, x, x, x, x, x, x, x, x]\n{levels}{key}: *l8\n"


def cli_cases(d: Path) -> list[tuple[str, list[str], str]]:
    """(name, argv after `servetwin`, text the error must contain)."""
    base = ("model: tiny-llama\nbackends: [sim]\nhardware: cpu\nworkload: {requests: 4, prompt_tokens: {type: fixed, "
            "value: 8}, output_tokens: {type: fixed, value: 4}}\n")

    def cfg(name: str, text: str) -> str:
        p = d / f"{name}.yaml"
        p.write_text(text) if isinstance(text, str) else p.write_bytes(text)
        return str(p)

    def scenario(name: str, data: Any) -> str:
        p = d / f"{name}.json"
        p.write_text(data if isinstance(data, str) else json.dumps(data))
        return str(p)

    def trace(name: str, text: bytes | str) -> str:
        p = d / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(p)

    def with_trace(name: str, path: str, fmt: str = "auto") -> str:
        return cfg(name, "model: tiny-llama\nbackends: [sim]\nworkload:\n  arrival: {type: trace, path: "
                   + json.dumps(path) + (f", format: {fmt}" if fmt != "auto" else "") + "}\n")

    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_gpu_blocks": 64, "block_size": 16}
    (d / "bigmodel").mkdir()
    big_config = _sparse(d / "bigmodel" / "config.json", 3 << 30, b"{")
    big_trace = str(_sparse(d / "big.csv", 3 << 30, b"arrival_s,prompt_tokens,output_tokens\n"))
    out = str(d / "out")
    return [
        ("2  alias bomb in seed", ["run", cfg("bomb_seed", base + _bomb("seed")), "-o", out], "config"),
        ("2  alias bomb in model", ["run", cfg("bomb_model", _bomb("model") + "backends: [sim]\n"), "-o", out],
         "config"),
        ("2  alias bomb under sweep", ["sweep", cfg("bomb_sweep", base + _bomb("sweep")), "-o", out], "config"),
        ("10 YAML nested 10^5", ["run", cfg("deep", "a: " + "[" * 100000 + "]" * 100000 + "\n"), "-o", out],
         "nested"),
        ("11 YAML int of 5000 digits", ["run", cfg("digits", base + "seed: " + "9" * 5000 + "\n"), "-o", out],
         "config"),
        ("11 non-UTF-8 YAML", ["run", cfg("latin1", b"model: caf\xe9\n"), "-o", out], "not UTF-8"),
        ("11 model: /etc/passwd", ["run", cfg("passwd", base.replace("tiny-llama", "/etc/passwd")), "-o", out],
         "model"),
        ("11 model: /proc/self/mem", ["run", cfg("procmem", base.replace("tiny-llama", "/proc/self/mem")), "-o", out],
         "model"),
        ("9  model: 3 GiB config.json", ["run", cfg("bigcfg", base.replace("tiny-llama", str(big_config))), "-o", out],
         "model"),
        ("9  3 GiB trace file", ["run", with_trace("bigtrace", big_trace), "-o", out], "workload.arrival.path"),
        ("9  mooncake input_length 1e10", ["run", with_trace("moon", trace("moon.jsonl", json.dumps(
            {"timestamp": 0, "input_length": 10 ** 10, "output_length": 4, "hash_ids": [1]}) + "\n"), "mooncake"),
            "-o", out], "input_length"),
        ("10 JSONL trace line nested 10^5", ["run", with_trace("deepjsonl", trace("deep.jsonl", "[" * 100000 +
                                                                               "]" * 100000 + "\n")), "-o", out],
         "nested"),
        ("10 CSV field of 200k chars", ["run", with_trace("bigfield", trace("field.csv", "arrival_s,prompt_tokens,"
                                                                          "output_tokens\n0,8," + "4" * 200000
                                                                          + "\n")), "-o", out], "field.csv"),
        ("12 workload.file /proc/self/environ", ["run", cfg("environ", "model: tiny-llama\nbackends: [sim]\n"
                                                         "workload: {file: /proc/self/environ}\n"), "-o", out],
         "workload"),
        ("9  replay prompt_len 1e8", ["replay", scenario("plen", {"settings": settings, "requests": [
            {"id": "a", "prompt_len": 10 ** 8, "max_tokens": 2}]})], "prompt_len"),
        ("10 scenario nested 10^5", ["replay", scenario("deepscn", "[" * 100000 + "]" * 100000)], "nested"),
        ("13 duplicate scenario key", ["replay", scenario("dupkey", '{"settings": {}, "settings": {}, '
                                                                   '"requests": []}')], "duplicate"),
    ]


def _gzip_bomb(path: Path, inflated: int) -> str:
    import zlib  # noqa: PLC0415

    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"0" * (1 << 20)
    with open(path, "wb") as f:
        for _ in range(inflated // len(chunk)):
            f.write(z.compress(chunk))
        f.write(z.flush())
    return str(path)


def import_cases(d: Path) -> list[tuple[str, list[str], str]]:
    """Every importer x every hostile file kind (issue 38 item 1); the error must name the file."""
    from servetwin.core.limits import MAX_IMPORT_FILE_BYTES  # noqa: PLC0415

    files = {"gzip bomb": (_gzip_bomb(d / "bomb.json.gz", MAX_IMPORT_FILE_BYTES + (64 << 20)), "inflates to more"),
             "/dev/zero link": (str(d / "zero.json"), "not a regular file"),
             "FIFO": (str(d / "fifo.json"), "not a regular file"), "folder": (str(d / "dir.json"), "is a folder"),
             "JSON nested 10^5": (str(d / "deep.json"), "nested more than")}
    (d / "zero.json").symlink_to("/dev/zero")
    os.mkfifo(d / "fifo.json")
    (d / "dir.json").mkdir()
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    exp = d / "exp.yaml"
    exp.write_text("name: e\nmodel: tiny-llama\nhardware: cpu\nbackends: [sim]\n")
    out = []
    for kind, (path, needle) in files.items():
        commands = {"import vllm-trace": ["import", "vllm-trace", path, "-o", str(d / "o")],
                    "import vllm-bench": ["import", "vllm-bench", path, "-o", str(d / "o"), "--hardware", "h100-sxm"],
                    "import vllm-log": ["import", "vllm-log", path],
                    "calibrate --from-vllm": ["calibrate", "--from-vllm", path, "-o", str(d / "c.yaml"),
                                              "--hardware", "h100-sxm"],
                    "compare --measured": ["compare", "--measured", path, str(exp)]}
        for command, argv in commands.items():
            text = "no vLLM startup line" if (command == "import vllm-log" and kind == "JSON nested 10^5") else needle
            out.append((f"1  {command}: {kind}", argv, text))
    return out


def _peak_rss_mb(argv: list[str], timeout: float) -> tuple[int, float, float, str]:
    """(exit status, wall s, peak RSS MB, stderr) of `servetwin argv` in a child process; the peak RSS
    is wait4's for that child alone."""
    t0 = time.perf_counter()
    err_file = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: exec the CLI with stderr to the file
        os.setsid()
        os.dup2(err_file.fileno(), 2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.execv(sys.executable, [sys.executable, "-m", "servetwin.experiments.cli", *argv])
    deadline = time.monotonic() + timeout
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            done, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.02)
    dt = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    err_file.seek(0)
    return rc, dt, usage.ru_maxrss / 1024, err_file.read().decode(errors="replace")


def run_cli_part() -> bool:
    ok = True
    with tempfile.TemporaryDirectory(prefix="servetwin-hostile-") as tmp:
        d = Path(tmp)
        print(f"\n{'case':52s} {'exit':>4s} {'time s':>7s} {'peak MB':>8s}  result")
        imports = d / "imports"
        imports.mkdir()
        # issue 27's cases: 5 s and 500 MB; issue 38's importer cases: 10 s and 600 MB, the file named
        cases = [(c, 5.0, 500) for c in cli_cases(d)] + [(c, 10.0, 600) for c in import_cases(imports)]
        for (name, argv, needle), limit_s, limit_mb in cases:
            rc, dt, rss, err = _peak_rss_mb(argv, timeout=2 * limit_s)
            last = err.strip().splitlines()[-1] if err.strip() else ""
            clean = "Traceback" not in err and "HOME=" not in err and "PATH=" not in err
            named = not name.startswith("1  ") or argv[2] in err  # an importer case: its file named
            good = rc == 2 and needle in err and dt < limit_s and rss < limit_mb and clean and named
            ok &= good
            print(f"{name:52s} {rc:4d} {dt:7.2f} {rss:8.0f}  {'PASS' if good else 'FAIL'}  {last[:150]}", flush=True)
    return ok


# -- part 3: the profiler endpoints ---------------------------------------------------------------------
def run_profiler_part() -> bool:
    """Auth, growth under a stream of requests, an unwritable directory (issue 38 item 5)."""
    import shutil  # noqa: PLC0415

    from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces  # noqa: PLC0415
    from servetwin.sim.predicted_profile import MAX_PROFILE_STEPS  # noqa: PLC0415

    ok = True
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer hostile-key"}
    with tempfile.TemporaryDirectory(prefix="servetwin-profiler-") as tmp:
        prof = Path(tmp) / "prof"
        cmd = [sys.executable, "-m", "servetwin.experiments.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--model", "llama-3.1-8b", "--backend", "sim", "--max-model-len", "4096", "--api-key", "hostile-key",
               "--profiler-dir", str(prof)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)

        def check(name: str, good: bool, detail: str = "") -> None:
            nonlocal ok
            ok &= good
            print(f"{name:52s} {'PASS' if good else 'FAIL'}  {detail}", flush=True)
        try:
            wait_healthy(url, proc)
            print(f"\n{'profiler case':52s} result")
            for route in ("/start_profile", "/stop_profile"):
                check(f"5  {route} without the API key", httpx.post(url + route, timeout=10).status_code == 401)
            check("5  /start_profile with the key", httpx.post(url + "/start_profile", headers=auth,
                                                               timeout=10).status_code == 200)
            t0 = time.perf_counter()
            with httpx.Client(timeout=60, headers=auth) as c:
                while time.perf_counter() - t0 < 20.0:  # a steady stream: the profile grows
                    c.post(url + "/v1/completions", json={"model": "llama-3.1-8b", "prompt": [[7] * 64] * 16,
                                                          "max_tokens": 64})
            t1 = time.perf_counter()
            r = httpx.post(url + "/stop_profile", headers=auth, timeout=60)
            stop_s = time.perf_counter() - t1
            name = r.json().get("trace") if r.status_code == 200 else None
            check("5  /stop_profile: quick, names the file only", r.status_code == 200 and stop_s < 1.0
                  and name is not None and "/" not in name and tmp not in r.text, f"{stop_s:.2f} s, {r.text[:80]}")
            path = prof / str(name)
            deadline = time.monotonic() + 60
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            steps = len(read_profiler_traces([path])) if path.exists() else -1
            check("5  trace capped at MAX_PROFILE_STEPS", 0 < steps <= MAX_PROFILE_STEPS,
                  f"{steps} steps, {path.stat().st_size / 1e6 if path.exists() else 0:.1f} MB")
            shutil.rmtree(prof)
            prof.write_text("not a folder")
            r = httpx.post(url + "/start_profile", headers=auth, timeout=10)
            check("5  unwritable directory: 500 at /start_profile", r.status_code == 500
                  and "--profiler-dir" in r.text and tmp not in r.text, r.text[:100])
            check("5  ... and no profile running", httpx.post(url + "/stop_profile", headers=auth,
                                                             timeout=10).json() == {"trace": None})
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--part", choices=["server", "cli", "profiler", "both", "all"], default="all")
    ap.add_argument("--backend", choices=["fake", "torch"], default="fake",
                    help="the server's backend (torch: tiny-llama with its Hugging Face tokenizer)")
    ns = ap.parse_args()
    print(f"host load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    ok = True
    if ns.part in ("server", "both", "all"):
        ok &= run_server_part(ns.backend)
    if ns.part in ("cli", "both", "all"):
        ok &= run_cli_part()
    if ns.part in ("profiler", "all"):
        ok &= run_profiler_part()
    print("\nALL PASS" if ok else "\nSOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
