"""100 concurrent streaming requests through the official async `openai` client.

Runs against the `sim` backend (paced: every step's outputs are released at the cost model's
predicted end time) when `servetwin.sim.kv_pool` imports, otherwise against the paced `fake` backend."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from servetwin.core.engine.metrics import parse_prometheus_text, sample
from frontend_utils import ServerProcess, backend_available

MODEL = "tiny-llama"
BACKEND = "sim" if backend_available("sim") else "fake"


@pytest.fixture(scope="module")
def server():
    extra = ["--fake-step-time", "0.002", "--pace"] if BACKEND == "fake" else ["--time-scale", "1.0"]
    srv = ServerProcess("--model", MODEL, "--backend", BACKEND, "--num-gpu-blocks", "4096",
                        "--max-model-len", "2048", "--max-num-seqs", "128", *extra)
    yield srv
    srv.stop()


async def _one(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> tuple[int, int, str, int]:
    prompt = " ".join(str(10 + (i * 13 + k) % 200) for k in range(5 + i % 40))
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             temperature=0.8, seed=i, stream_options={"include_usage": True})
    text, reason, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return len(text.split()), usage, reason, max_tokens


def test_100_concurrent_streaming_requests_complete_with_the_right_token_counts(server):
    rng = random.Random(0)
    lengths = [rng.randint(8, 64) for _ in range(100)]
    before = parse_prometheus_text(httpx.get(server.url + "/metrics").text)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=60) as client:
            return await asyncio.gather(*[_one(client, i, n) for i, n in enumerate(lengths)])

    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), 90))
    elapsed = time.monotonic() - t0
    for n_words, usage, reason, max_tokens in results:
        assert (n_words, usage, reason) == (max_tokens, max_tokens, "length")
    after = parse_prometheus_text(httpx.get(server.url + "/metrics").text)
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert sample(after, name) - sample(before, name) == 100, name
    assert sample(after, "vllm:generation_tokens_total") - sample(before, "vllm:generation_tokens_total") == sum(lengths)
    assert sample(after, "vllm:request_success_total", finished_reason="length") - sample(
        before, "vllm:request_success_total", finished_reason="length") == 100
    # paced at time_scale 1: steps are back to back in simulated time and released no earlier than their
    # mapped end, so the predicted busy time of the steps serving this load cannot exceed its wall time
    busy = sample(after, "servetwin:simulated_busy_seconds_total") - sample(
        before, "servetwin:simulated_busy_seconds_total")
    steps = sample(after, "servetwin:engine_steps_total") - sample(before, "servetwin:engine_steps_total")
    assert steps >= max(lengths)
    assert 0 < busy <= elapsed
    if BACKEND == "fake":
        assert busy == pytest.approx(steps * 0.002)
    print(f"{BACKEND}: 100 streams, {sum(lengths)} tokens in {elapsed:.2f} s")
