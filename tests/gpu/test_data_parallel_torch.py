"""Data parallelism with the torch backend on the CPU: tiny-llama at TP=2 x DP=2 (two engine processes,
each with two gloo workers: 6 processes, one torch thread each on this 2-core machine) against one
in-process TP=1 DP=1 engine, and the real load balancer's stats stream replayed into the balancer the
simulator uses (`dp_lb.DPLoadBalancer`, as `sim/cluster.py` drives it)."""
from __future__ import annotations

import random

import pytest

from servetwin.core.engine.dp_lb import replay_lb_trace
from servetwin.core.engine.llm import LLM
from servetwin.core.sampling_params import SamplingParams

ENGINE = dict(device="cpu", num_gpu_blocks=256, max_model_len=256, max_num_seqs=32, enable_prefix_caching=False)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 320) for _ in range(rnd.randint(2, 24))] for _ in range(n)]


@pytest.fixture(scope="module")
def dp_llm():
    llm = LLM("tiny-llama", tensor_parallel_size=2, data_parallel_size=2, multiprocess=True, **ENGINE)
    yield llm
    llm.close()


def test_tp2_x_dp2_greedy_outputs_equal_one_engine(dp_llm):
    prompts = _prompts(64, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM("tiny-llama", multiprocess=False, **ENGINE) as ref:
        want = [list(o.outputs[0].token_ids) for o in ref.generate(prompts, params)]
    client = dp_llm.llm_engine.client
    start = len(client.lb_trace)
    got = [list(o.outputs[0].token_ids) for o in dp_llm.generate(prompts, params)]
    assert got == want
    ranks = [e[2] for e in client.lb_trace[start:] if e[0] == "pick"]
    assert ranks.count(0) == ranks.count(1) == 32  # all 64 picked before any stats: rotation and bumps


def test_lb_choices_of_200_requests_replay_into_the_simulators_balancer(dp_llm):
    """Requests arrive in waves between engine steps, so the picks see published (waiting, running, kv)
    rows and in-flight counts freed by finishes; the recorded stream replayed gives the same engines."""
    engine = dp_llm.llm_engine
    client = engine.client
    start = len(client.lb_trace)
    prompts = _prompts(200, seed=9)
    rnd = random.Random(1)
    sent = 0
    while sent < len(prompts) or engine.has_unfinished_requests():
        wave = rnd.randint(1, 12)
        for p in prompts[sent:sent + wave]:
            engine.add_request(f"w{sent}", p, SamplingParams(temperature=0.0, max_tokens=rnd.randint(1, 4)))
            sent += 1
        for _ in range(rnd.randint(0, 3)):
            if engine.has_unfinished_requests():
                engine.step()
    trace = client.lb_trace[start:]
    picks = {e[1]: e[2] for e in trace if e[0] == "pick"}
    assert len(picks) == 200 and set(picks.values()) == {0, 1}
    publishes = [e for e in trace if e[0] == "publish"]
    assert publishes and any(any(row[0] or row[1] for row in e[2]) for e in publishes)  # load was seen
    assert sum(e[0] == "finish" for e in trace) == 200
    # the stream starts where the previous test left the balancer: replay from the start of the recording
    replayed = replay_lb_trace(client.lb_trace, 2)
    assert {rid: replayed[rid] for rid in picks} == picks
    # and the published rows steered the picks: without them the same stream picks differently
    blind = replay_lb_trace([e for e in client.lb_trace if e[0] != "publish"], 2)
    assert {rid: blind[rid] for rid in picks} != picks
    assert sum(client.coordinator.lb.engine_inflight) == 0
