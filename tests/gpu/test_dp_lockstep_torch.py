"""MoE data parallelism in lockstep with the torch backend on the CPU: tiny-qwen3-moe at DP=2 (two engine
processes, one torch thread each, a gloo DP group between them), as vLLM's `DPEngineCoreProc` runs it:
the ranks run the same number of steps, an idle rank runs dummy batches while the other has work, a wave
ends only at the every-16-steps all-reduce, greedy outputs equal one DP=1 engine, and a dying engine
still fails the client within 5 s and leaves no process."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest

from servetwin.core.engine.async_llm import AsyncLLM
from servetwin.core.engine.dp_lockstep import DP_SYNC_INTERVAL
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.llm import LLM
from servetwin.core.sampling_params import SamplingParams

ENGINE = dict(device="cpu", num_gpu_blocks=256, max_model_len=256, max_num_seqs=16, enable_prefix_caching=False)
MODEL = "tiny-qwen3-moe"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 300) for _ in range(rnd.randint(2, 20))] for _ in range(n)]


def _start_dp_llm() -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # one torch thread per engine process
        return LLM(MODEL, data_parallel_size=2, multiprocess=True, **ENGINE)


@pytest.fixture(scope="module")
def dp_llm():
    llm = _start_dp_llm()
    yield llm
    llm.close()


def _settled_rank_stats(llm: LLM, timeout_s: float = 60.0) -> list[dict]:
    """Each rank's stats once every rank has ended its wave (the tail runs after the last output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = llm.get_stats()["engines"]
        if not any(r["engines_running"] for r in ranks):
            return ranks
        assert time.monotonic() < deadline, f"the lockstep wave did not end: {ranks}"
        time.sleep(0.05)


def test_moe_dp2_greedy_outputs_equal_dp1_and_ranks_step_together(dp_llm):
    prompts = _prompts(32, seed=3)
    with LLM(MODEL, multiprocess=False, **ENGINE) as ref:
        want = [list(o.outputs[0].token_ids) for o in ref.generate(prompts, GREEDY)]
    before = _settled_rank_stats(dp_llm)
    got = [list(o.outputs[0].token_ids) for o in dp_llm.generate(prompts, GREEDY)]
    assert got == want
    after = _settled_rank_stats(dp_llm)
    assert all(r["lockstep"] for r in after)
    steps = [a["lockstep_steps"] - b["lockstep_steps"] for a, b in zip(after, before)]
    assert steps[0] == steps[1] > 0
    # each rank ran a real step or a dummy batch at every lockstep step
    for a, b, n in zip(after, before, steps):
        assert (a["num_steps"] - b["num_steps"]) + (a["dummy_batches"] - b["dummy_batches"]) >= n
    # the wave ended at an all-reduce: step 1 or a multiple of 16 of each wave
    waves = after[0]["waves"] - before[0]["waves"]
    assert waves >= 1 and after[1]["waves"] - before[1]["waves"] == waves


def test_an_idle_rank_runs_dummy_batches_while_the_other_has_work(dp_llm):
    """One request: one rank decodes it, the other runs a dummy batch at every step; requests ending on
    one rank first keep the wave going until the next 16-step all-reduce, and nothing hangs."""
    before = _settled_rank_stats(dp_llm)
    out = dp_llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 20
    after = _settled_rank_stats(dp_llm)
    steps = [a["lockstep_steps"] - b["lockstep_steps"] for a, b in zip(after, before)]
    real = [a["num_steps"] - b["num_steps"] for a, b in zip(after, before)]
    dummies = [a["dummy_batches"] - b["dummy_batches"] for a, b in zip(after, before)]
    assert steps[0] == steps[1]
    busy = 0 if real[0] else 1
    assert real[1 - busy] == 0 and real[busy] >= 20
    assert dummies[1 - busy] == steps[0]  # the idle rank: a dummy batch at every step of the wave
    assert dummies[busy] == steps[0] - real[busy]  # the busy rank: only after its request finished
    assert steps[0] % DP_SYNC_INTERVAL == 0  # the wave ended at a 16-step all-reduce (one wave)
    assert after[0]["waves"] - before[0]["waves"] == 1


def test_a_killed_engine_fails_the_client_within_5s_and_leaves_no_process():
    llm = _start_dp_llm()
    pids = llm.llm_engine.client.engine_pids
    result: list = []

    def run() -> None:
        try:
            llm.generate(_prompts(16, seed=4), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
            result.append(None)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 60
        while llm.llm_engine.client.coordinator.lb.engine_inflight.count(0) and time.monotonic() < deadline:
            time.sleep(0.05)  # both ranks have requests
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGKILL)
        t_kill = time.monotonic()
        t.join(10)
        assert not t.is_alive()
        assert time.monotonic() - t_kill < 5.0
        assert isinstance(result[0], EngineDeadError), result
    finally:
        llm.close()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


def test_async_llm_streams_moe_dp2_in_lockstep_with_dp1_tokens():
    """The server's path (`AsyncLLM`, `DPAsyncMPClient`): the start-wave relay runs in its engine readers."""
    prompts = [f"lockstep prompt {i}" for i in range(6)]
    with LLM(MODEL, multiprocess=False, **ENGINE) as ref:
        want = [list(o.outputs[0].token_ids) for o in ref.generate(prompts, GREEDY)]

    async def stream(llm: AsyncLLM, i: int) -> list[int]:
        tokens: list[int] = []
        async for out in llm.generate(prompts[i], GREEDY, f"r{i}"):
            tokens = list(out.outputs[0].token_ids)
        return tokens

    async def main() -> tuple[list, list]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", "1")
            args = EngineArgs.from_kwargs(model=MODEL, data_parallel_size=2, **ENGINE)
            llm = await asyncio.to_thread(AsyncLLM, args)
        try:
            got = [await stream(llm, 0)]  # one rank alone first, then both
            got += await asyncio.gather(*[stream(llm, i) for i in range(1, len(prompts))])
            deadline = time.monotonic() + 60
            while True:
                ranks = (await llm.client.call_utility_async("get_stats"))["engines"]
                if not any(r["engines_running"] for r in ranks) or time.monotonic() > deadline:
                    return got, ranks
                await asyncio.sleep(0.05)
        finally:
            llm.shutdown()

    got, ranks = asyncio.run(asyncio.wait_for(main(), 300))
    assert got == want
    assert ranks[0]["lockstep_steps"] == ranks[1]["lockstep_steps"] > 0
    assert not any(r["engines_running"] for r in ranks) and ranks[0]["waves"] == ranks[1]["waves"] >= 1
