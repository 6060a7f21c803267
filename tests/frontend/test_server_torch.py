"""Content checks against a real model: the server (torch backend, tiny-llama) answers exactly what the
offline in-process `LLM` answers (greedy), stop strings cut the same text, logprobs are consistent."""
from __future__ import annotations

import openai
import pytest

from frontend_utils import ServerProcess, backend_available

pytestmark = pytest.mark.skipif(not backend_available("torch"), reason="torch backend (servetwin.gpu.executor) not importable")

MODEL = "tiny-llama"
ENGINE = ["--num-gpu-blocks", "256", "--max-model-len", "512"]
PROMPTS = ["The capital of France is", "Hello! How are you today?", "Prefix caching lets a new request"]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model", MODEL, "--backend", "torch", *ENGINE, startup_timeout=180)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    from servetwin.core.engine.llm import LLM
    from servetwin.core.sampling_params import SamplingParams

    with LLM(model=MODEL, backend="torch", multiprocess=False, num_gpu_blocks=256, max_model_len=512) as llm:
        greedy = SamplingParams(max_tokens=16, temperature=0.0)
        texts = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
        chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy)[0].outputs[0].text
        yield texts, chat


def test_completions_match_offline_llm(client, offline):
    texts, _ = offline
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0)
    got = {c.index: c.text for c in r.choices}
    assert [got[i] for i in range(len(PROMPTS))] == texts
    # streaming gives the same text
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == texts[0]


def test_chat_matches_offline_llm(client, offline):
    _, chat = offline
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.content == chat


def test_stop_string_cuts_the_greedy_text(client, offline):
    text = offline[0][0]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip())  # 2 chars inside it
    cut = text[:text.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop,
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == cut + stop


def test_logprobs_are_consistent_with_greedy_choice(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 8
    # token strings of a byte-level BPE may collide ("\ufffd"): ask for ids to check the numbers
    r2 = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3,
                                   extra_body={"return_tokens_as_token_ids": True})
    assert r2.choices[0].text == r.choices[0].text
    lp = r2.choices[0].logprobs
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok.startswith("token_id:") and tok in top
        assert tok_lp <= 0.0 and len(top) >= 3
        assert tok_lp == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely token
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def test_sampled_logprobs_keep_the_server_alive(server, client):
    """Random sampling picks tokens outside the top-k: the front end used to read the sampled token at
    `token_ids[sampled_rank]` (a vocabulary rank), raise IndexError and kill the server for good."""
    import httpx

    for seed in range(4):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=seed,
                                      logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 8
        for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[tok] == tok_lp and tok_lp <= 0.0  # the sampled token's own logprob
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=1.0, seed=1, logprobs=True, top_logprobs=1, n=2)
    assert len(r.choices) == 2 and sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens
    assert httpx.get(server.url + "/health").status_code == 200
