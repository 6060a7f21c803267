"""The OpenAI-compatible server, driven by the official `openai` client against a real server process
(`python -m servetwin.experiments.cli serve --backend fake ...`, paced at 2 ms per step, toy tokenizer)."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from servetwin.core.engine.metrics import parse_prometheus_text, sample
from frontend_utils import ServerProcess

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model", MODEL, "--backend", "fake", "--pace", "--fake-step-time", "0.002",
                        "--max-model-len", "4096")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def metrics(server) -> dict[str, float]:
    return parse_prometheus_text(httpx.get(server.url + "/metrics", timeout=5).text)


def wait_idle(server, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        if sample(values, "vllm:num_requests_running") == 0 and sample(values, "vllm:num_requests_waiting") == 0:
            return values
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def words(text: str) -> list[int]:
    return [int(w) for w in text.split()]


def assert_stride7(numbers: list[int]) -> None:
    """A lone request on the fake backend gets tokens (7 * step) % 1000 + 10 on consecutive steps."""
    for a, b in zip(numbers, numbers[1:]):
        assert (b - 10) % 1000 == (a - 10 + 7) % 1000, numbers


def test_health_models_and_metrics_endpoints(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 4096
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert f"# TYPE {name} " in resp.text, name


def test_completions_text_token_and_batched_prompts(client):
    r = client.completions.create(model=MODEL, prompt="alpha beta gamma", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
    assert len(words(r.choices[0].text)) == 5 and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)
    assert_stride7(words(r.choices[0].text))

    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3)
    assert len(words(r.choices[0].text)) == 3 and r.usage.prompt_tokens == 4

    r = client.completions.create(model=MODEL, prompt=["one", "two three"], max_tokens=4, n=2, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(len(words(c.text)) == 4 for c in r.choices)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 16


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model=MODEL, prompt="9 8 7", max_tokens=3, echo=True)
    text = r.choices[0].text
    assert text.startswith("9 8 7") and len(words(text[len("9 8 7"):])) == 3


def test_streaming_completion_with_n_and_usage(client):
    stream = client.completions.create(model=MODEL, prompt="a b", max_tokens=12, n=2, stream=True,
                                       stream_options={"include_usage": True})
    texts, reasons, usage, chunks = {0: "", 1: ""}, {}, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert chunks > 2  # really streamed (12 paced steps)
    assert all(len(words(t)) == 12 for t in texts.values())
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 24 and usage.prompt_tokens == 2


def test_chat_completion_and_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert len(words(r.choices[0].message.content)) == 4 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("system: be brief\nuser: hello there\nassistant:".split())

    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stream=True)
    roles, content, reason = [], "", None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            content += c.delta.content or ""
            reason = c.finish_reason or reason
    assert roles == ["assistant"] and len(words(content)) == 6 and reason == "length"

    # echo continues the assistant's last message
    cont = msgs + [{"role": "assistant", "content": "1 2"}]
    r = client.chat.completions.create(model=MODEL, messages=cont, max_tokens=3, extra_body={"echo": True,
                                       "add_generation_prompt": False})
    assert r.choices[0].message.content.startswith("1 2") and len(words(r.choices[0].message.content)) == 5


def test_stop_strings(client):
    # Tokens decode to " <id>" with ids stepping by 7, so some token ends in "3" within 10 steps and the
    # next one starts with a space: "3 " is bound to appear.
    r = client.completions.create(model=MODEL, prompt="p q", max_tokens=40, stop=["3 ", "zzz"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and "3 " not in c.text and c.text.endswith(tuple(" 0123456789"))
    assert_stride7(words(c.text + "3"))
    assert r.usage.completion_tokens < 40

    r = client.completions.create(model=MODEL, prompt="p q", max_tokens=40, stop="3 ",
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text.endswith("3 ")

    stream = client.completions.create(model=MODEL, prompt="p q", max_tokens=40, stop=["3 "], stream=True)
    text, reason = "", None
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.text
            reason = ch.finish_reason or reason
    assert reason == "stop" and "3 " not in text
    assert_stride7(words(text + "3"))


def _bad(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.response.json()
    assert set(body) == {"error"} and info.value.status_code == 400
    err = body["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]
    return err


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=7), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(n=2, temperature=0), "n"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(logprobs=50), "logprobs"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(extra_body={"min_tokens": 9}, max_tokens=3), "min_tokens"),
    (dict(prompt=[1] * 5000), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(presence_penalty=3), "presence_penalty"),
])
def test_bad_completion_parameters_get_400_naming_the_field(client, kwargs, param):
    kwargs = dict(dict(model=MODEL, prompt="x y", max_tokens=3), **kwargs)
    err = _bad(lambda: client.completions.create(**kwargs))
    assert err["param"] == param, err


def test_bad_requests_do_not_hurt_the_server(server, client):
    assert _bad(lambda: client.chat.completions.create(model=MODEL, messages=[], max_tokens=2))["param"] == "messages"
    assert _bad(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=3))["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    raw = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "body"
    raw = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "max_tokens"
    raw = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "prompt"
    # still serving
    r = client.completions.create(model=MODEL, prompt="still alive", max_tokens=2)
    assert len(words(r.choices[0].text)) == 2
    assert httpx.get(server.url + "/health").status_code == 200


def test_max_tokens_beyond_the_context_is_a_400_like_vllm(server, client):
    # max_model_len 4096: "a b" is 2 toy tokens, so 4094 output tokens fit and 4095 do not
    err = _bad(lambda: client.completions.create(model=MODEL, prompt="a b", max_tokens=4095))
    assert err["param"] == "max_tokens"
    assert "'max_tokens' is too large: 4095" in err["message"] and "(4095 > 4096 - 2)" in err["message"]
    err = _bad(lambda: client.completions.create(model=MODEL, prompt=["a", "a b c"], max_tokens=4094, stream=True))
    assert err["param"] == "max_tokens"  # any prompt of a batch; before any stream starts
    msgs = [{"role": "user", "content": "x"}]
    err = _bad(lambda: client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10**6))
    assert err["param"] == "max_completion_tokens"
    err = _bad(lambda: client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10**6))
    assert err["param"] == "max_tokens"
    long_prompt = [1] * 4090
    r = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=6)  # fits exactly
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    err = _bad(lambda: client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=7))
    assert err["param"] == "max_tokens"
    wait_idle(server)


def test_logprobs_on_a_backend_without_logits_are_a_400(server, client):
    err = _bad(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=1))
    assert err["param"] == "logprobs" and "fake backend" in err["message"]
    err = _bad(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=2, logprobs=True))
    assert err["param"] == "logprobs"
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_priority_under_fcfs_is_a_400_like_vllm(server, client):
    err = _bad(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": 3}))
    assert err["param"] == "priority" and "policy='priority'" in err["message"]
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": 0})
    assert r.choices[0].finish_reason == "length"


def test_metrics_follow_the_traffic(server, client):
    before = wait_idle(server)
    prompt = [7] * 40  # 2 full blocks of 16 tokens: the second request hits the prefix cache
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    after = wait_idle(server)
    assert sample(after, "vllm:prefix_cache_queries_total") - sample(before, "vllm:prefix_cache_queries_total") >= 80
    assert sample(after, "vllm:prefix_cache_hits_total") - sample(before, "vllm:prefix_cache_hits_total") >= 32
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert sample(after, name) - sample(before, name) == 2, name
    assert sample(after, "vllm:inter_token_latency_seconds_count") - sample(
        before, "vllm:inter_token_latency_seconds_count") == 6
    # paced at 2 ms per step: 4 tokens take at least 8 ms end to end
    e2e = sample(after, "vllm:e2e_request_latency_seconds_sum") - sample(before, "vllm:e2e_request_latency_seconds_sum")
    assert e2e >= 2 * 4 * 0.002
    assert sample(after, "vllm:generation_tokens_total") - sample(before, "vllm:generation_tokens_total") == 8
    assert sample(after, "vllm:kv_cache_usage_perc") == 0.0
    assert sample(after, "vllm:num_preemptions_total") == 0


def test_client_disconnect_mid_stream_aborts_the_request(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 3000, "stream": True}  # 6 s if not aborted
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines += 1
                if lines >= 3:
                    break
    t0 = time.monotonic()
    after = wait_idle(server, timeout=3.0)
    assert time.monotonic() - t0 < 3.0
    assert sample(after, "vllm:request_success_total", finished_reason="abort") - sample(
        before, "vllm:request_success_total", finished_reason="abort") == 1


def test_client_disconnect_while_waiting_aborts_the_request(server):
    before = wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3000},
                   timeout=httpx.Timeout(10, read=0.3))
    after = wait_idle(server, timeout=3.0)
    assert sample(after, "vllm:request_success_total", finished_reason="abort") - sample(
        before, "vllm:request_success_total", finished_reason="abort") == 1


def test_dead_engine_turns_health_red_and_requests_fail_fast():
    import os
    import signal

    srv = ServerProcess("--model", MODEL, "--backend", "fake", "--pace", "--fake-step-time", "0.005")
    try:
        engine = [p for p in srv.engine_pids if "engine_proc" in open(f"/proc/{p}/cmdline").read()]
        assert len(engine) == 1
        with httpx.Client(timeout=10) as http:
            with http.stream("POST", srv.url + "/v1/completions",
                             json={"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True}) as resp:
                it = resp.iter_lines()
                assert next(it).startswith("data: ")
                os.kill(engine[0], signal.SIGKILL)
                t0 = time.monotonic()
                rest = "\n".join(it)  # the stream ends (with an error event) instead of hanging
            assert time.monotonic() - t0 < 3 and '"InternalServerError"' in rest and rest.strip().endswith("data: [DONE]")
            assert http.get(srv.url + "/health").status_code == 503
            r = http.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and "dead" in r.json()["error"]["message"]
    finally:
        srv.stop()
