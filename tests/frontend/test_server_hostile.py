"""Hostile requests (issue 27): limits per request, not per prompt; nothing parsed, tokenised or read in a
way that stalls the event loop; no 5xx. One real server (fake backend, toy tokenizer) for the module,
with small limits so that each is reached cheaply. Timings are the benchmark's job
(`benchmarks/server_hostile.py`); these tests check answers and orderings only."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend_utils import ServerProcess

MODEL = "fake-model"
MAX_SEQS = 64
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model", MODEL, "--backend", "fake", "--max-model-len", "512", "--num-gpu-blocks", "1024",
                        "--max-seqs-per-request", str(MAX_SEQS), "--read-timeout", str(READ_TIMEOUT_S))
    yield srv
    srv.stop()


def post(server, path: str, body, timeout: float = 60.0) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=timeout)


def error(r: httpx.Response, status: int, param=...) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param is not ...:
        assert err["param"] == param, err
    return err


# -- item 1: sequences per request ----------------------------------------------------------------------
def test_sequence_limit_holds_per_request_not_per_prompt(server):
    error(post(server, "/v1/completions", {"prompt": [[5]] * 100_000, "max_tokens": 1}), 400, "prompt")
    error(post(server, "/v1/completions", {"prompt": [[5]] * 1000, "n": 128}), 400, "prompt")
    error(post(server, "/v1/completions", {"prompt": ["1 2"] * 10, "n": 10}), 400, "prompt")
    error(post(server, "/v1/completions", {"prompt": "1 2", "n": MAX_SEQS + 1}), 400, "n")
    error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                "n": MAX_SEQS + 1}), 400, "n")
    r = post(server, "/v1/completions", {"prompt": [[5, 6]] * MAX_SEQS, "max_tokens": 1})  # at the limit: legal
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_SEQS


# -- item 3: /tokenize off the loop; item 4: lone surrogates -------------------------------------------
def test_tokenize_runs_off_the_event_loop(server):
    """While a multi-megabyte /tokenize is being tokenised, /health answers (before the /tokenize does)."""
    done = {}

    def big() -> None:
        r = post(server, "/tokenize", {"prompt": "7 " * 1_500_000}, timeout=120)
        done["tokenize"] = (time.monotonic(), r.status_code, r.json()["count"] if r.status_code == 200 else None)

    t = threading.Thread(target=big)
    t.start()
    answered = []
    with httpx.Client(timeout=30) as client:
        while t.is_alive() and len(answered) < 200:
            answered.append((time.monotonic(), client.get(server.url + "/health").status_code))
            time.sleep(0.01)
    t.join(120)
    finished, status, count = done["tokenize"]
    assert status == 200 and count == 1_500_000
    assert any(code == 200 and at < finished for at, code in answered[1:]), "no /health answer during /tokenize"


def test_lone_surrogates_and_bad_ids_are_400s_on_tokenization_routes(server):
    error(post(server, "/tokenize", b'{"prompt": "a\\ud800b"}'), 400, "prompt")
    error(post(server, "/tokenize", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400, "messages")
    error(post(server, "/detokenize", {"tokens": [3, -1]}), 400, "tokens")
    assert post(server, "/detokenize", {"tokens": [7] * 50_000}).status_code == 200


# -- item 5: nesting ------------------------------------------------------------------------------------
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(1, 3000), pad=st.sampled_from([0, 300_000]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]))
def test_nesting_is_refused_past_the_limit_never_a_5xx(server, depth, pad, path):
    base = {"/v1/completions": b'"prompt": "1 2", "max_tokens": 1',
            "/v1/chat/completions": b'"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1',
            "/tokenize": b'"prompt": "1 2"'}[path]
    body = b"{" + base + b', "pad": "' + b"x" * pad + b'", "deep": ' + b"[" * depth + b"]" * depth + b"}"
    r = post(server, path, body)
    assert r.status_code < 500, r.text[:300]
    if depth + 1 > 64:  # the body object is one level, `deep` the others
        assert "nested" in error(r, 400, "body")["message"]
    else:
        assert r.status_code == 200, r.text[:300]


def test_nan_names_its_field_and_floats_are_strict(server):
    error(post(server, "/v1/completions", b'{"prompt": "1", "top_p": NaN}'), 400, "top_p")
    error(post(server, "/v1/completions", {"prompt": "1", "temperature": True}), 400, "temperature")
    err = error(post(server, "/v1/completions", b'{"prompt": "1", "\\ud800": 1}'), 400)
    assert err["param"] is not None and not err["message"].startswith("None")


def test_negative_token_ids_are_refused_without_a_vocabulary(server):
    error(post(server, "/v1/completions", {"prompt": [5, -3], "max_tokens": 1}), 400, "prompt")
    error(post(server, "/v1/completions", {"prompt": [5], "stop_token_ids": [-1]}), 400, "stop_token_ids")


# -- item 6: headers and slow clients; item 13: HEAD, malformed HTTP -----------------------------------
def raw(server, data: bytes, timeout: float = 10.0) -> tuple[int, bytes, float]:
    """Send `data`, read until the server answers and closes; (status or 0, answer, seconds to close)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answer, time.monotonic() - t0


def json_error(answer: bytes, status: int) -> dict:
    err = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == status and set(err) == {"message", "type", "param", "code"}
    return err


def test_oversized_and_too_many_headers_get_431(server):
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    status, answer, _ = raw(server, head)
    assert status == 431 and "--max-header-bytes" in json_error(answer, 431)["message"]
    many = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(300)) + b"\r\n"
    status, answer, _ = raw(server, many)
    assert status == 431 and "--max-header-count" in json_error(answer, 431)["message"]
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("partial", [
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",  # headers never end
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{",
], ids=["slow-headers", "slow-body"])
def test_slow_clients_are_dropped_at_the_read_timeout(server, partial):
    status, answer, took = raw(server, partial, timeout=READ_TIMEOUT_S + 10)
    assert status == 408 and took < READ_TIMEOUT_S + 5, (answer[:200], took)
    assert "--read-timeout" in json_error(answer, 408)["message"]


def test_a_slow_second_request_on_a_keep_alive_connection_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT_S + 10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\n")  # and nothing more
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_a_keep_alive_connection_is_not_cut_by_the_read_timeout(server):
    with httpx.Client(timeout=10) as client:
        for _ in range(3):  # the deadline covers reading a request, not the idle time between (keep-alive's)
            assert client.get(server.url + "/health").status_code == 200
            time.sleep(READ_TIMEOUT_S * 0.6)


def test_malformed_http_and_head_health(server):
    status, answer, _ = raw(server, b"GARBAGE\x00 / HTTP/9\r\n\r\n")
    assert status == 400 and json_error(answer, 400)["type"] == "BadRequestError"
    assert httpx.head(server.url + "/health").status_code == 200
