"""/tokenize, /detokenize and /version with vLLM's request and response shapes (a real server process,
fake backend, toy tokenizer)."""
from __future__ import annotations

import httpx
import pytest

from frontend_utils import ServerProcess

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model", MODEL, "--backend", "fake", "--max-model-len", "512")
    yield srv
    srv.stop()


def test_tokenize_a_prompt_and_back(server):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hello world again"}).json()
    assert set(r) == {"count", "max_model_len", "tokens", "token_strs"}
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 512 and r["token_strs"] is None
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    from servetwin.core.engine.toy_tokenizer import ToyTokenizer  # the fake backend's tokenizer (lossy)

    assert back == {"prompt": ToyTokenizer().decode(r["tokens"])}
    strs = httpx.post(server.url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"]


def test_tokenize_chat_messages_applies_the_template(server):
    msgs = [{"role": "user", "content": "hi there"}]
    with_prompt = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    without = httpx.post(server.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert with_prompt["count"] > without["count"] > 0


def test_bad_bodies_name_the_field(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1, "x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 9]})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404


def test_version(server):
    v = httpx.get(server.url + "/version").json()
    assert set(v) == {"version"} and isinstance(v["version"], str) and v["version"]
