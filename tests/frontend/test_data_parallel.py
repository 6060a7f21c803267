"""Data parallelism in the engine stack on the fake backend (fast): N engine processes behind the front
end's load balancer (`DPSyncMPClient` / `DPAsyncMPClient`), the coordinator's publish rule driven by
front-end events, per-engine /metrics labels, aborts and a dying engine."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.engine import messages as m
from servetwin.core.engine.async_llm import AsyncLLM
from servetwin.core.engine.dp_client import DPFrontEndCoordinator
from servetwin.core.engine.dp_lb import replay_lb_trace
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.llm import LLM
from servetwin.core.engine.metrics import parse_prometheus_text, sample
from servetwin.core.sampling_params import SamplingParams
from frontend_utils import pid_alive

FAKE = dict(model="fake-model", backend="fake", tokenizer="toy", data_parallel_size=2)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _stats(running: int, waiting: int, kv: float = 0.0) -> m.EngineStats:
    return m.EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv)


def test_coordinator_publishes_changed_counts_100ms_after_the_last_publish_and_the_picks_follow_them():
    clock = FakeClock()
    coord = DPFrontEndCoordinator(2, clock)
    assert [coord.choose(f"a{i}") for i in range(4)] == [0, 1, 0, 1]  # no stats yet: bumps + rotation
    coord.on_engine_stats(0, _stats(running=5, waiting=3))
    clock.t = 0.05
    assert coord.choose("b0") == 1  # first stats: published at once (the previous publish is at -inf)
    assert coord.lb.lb_engines == [[3, 5, 0.0], [1, 0, 0.0]]  # engine 1's waiting bumped by the pick
    publishes = [e for e in coord.lb_trace if e[0] == "publish"]
    assert publishes == [("publish", 0.05, [[3, 5, 0.0], [0, 0, 0.0]])]
    coord.on_engine_stats(1, _stats(running=1, waiting=0))
    clock.t = 0.10  # < 100 ms after the publish: the rows stay
    coord.choose("b1")
    assert len([e for e in coord.lb_trace if e[0] == "publish"]) == 1
    clock.t = 0.16
    coord.choose("b2")
    assert [e for e in coord.lb_trace if e[0] == "publish"][-1] == ("publish", 0.16, [[3, 5, 0.0], [0, 1, 0.0]])
    coord.on_engine_stats(1, _stats(running=1, waiting=0))  # unchanged counts are not sent
    clock.t = 10.0
    coord.choose("b3")
    assert len([e for e in coord.lb_trace if e[0] == "publish"]) == 2
    for rid in ["a0", "a1", "b0"]:
        coord.on_finished(rid)
    assert sum(coord.lb.engine_inflight) == 5
    picks = {e[1]: e[2] for e in coord.lb_trace if e[0] == "pick"}
    assert replay_lb_trace(coord.lb_trace, 2) == picks


def test_bad_data_parallel_size_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="data_parallel_size"):
        EngineArgs.from_kwargs(model="m", backend="fake", data_parallel_size=0)
    with pytest.raises(ConfigError, match="data_parallel_size"):
        LLM(model="m", backend="fake", data_parallel_size=2, multiprocess=False)


def test_llm_with_two_engines_spreads_requests_and_leaves_no_process():
    llm = LLM(**dict(FAKE, multiprocess=True, num_gpu_blocks=64, block_size=16, max_model_len=4096))
    client = llm.llm_engine.client
    pids = client.engine_pids
    try:
        outs = llm.generate([f"prompt {i}" for i in range(40)], SamplingParams(max_tokens=3, temperature=0))
        assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 40
        picks = [e[2] for e in client.lb_trace if e[0] == "pick"]
        assert sorted(set(picks)) == [0, 1] and len(picks) == 40
        assert sum(client.coordinator.lb.engine_inflight) == 0  # every finish freed its slot
        stats = llm.get_stats()
        assert len(stats["engines"]) == 2 and all(e["num_steps"] > 0 for e in stats["engines"])
        # a request the engine refuses (it can never fit the KV pool) frees its in-flight slot too
        with pytest.raises(ValueError):
            llm.generate([[7] * 2000], SamplingParams(max_tokens=1))
        assert sum(client.coordinator.lb.engine_inflight) == 0
    finally:
        llm.close()
    deadline = time.monotonic() + 10
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)]


async def _stream(llm: AsyncLLM, rid: str, max_tokens: int, seen: set) -> int:
    n = 0
    async for out in llm.generate(f"prompt {rid}", SamplingParams(max_tokens=max_tokens, temperature=0), rid):
        seen.add(rid)
        n = len(out.outputs[0].token_ids)
    return n


def test_async_llm_labels_metrics_per_engine_aborts_and_fails_every_stream_when_an_engine_dies():
    async def main():
        llm = await asyncio.to_thread(AsyncLLM, EngineArgs.from_kwargs(**FAKE), pace=True, fake_step_time_s=0.005)
        pids = llm.client.engine_pids
        try:
            got = await asyncio.gather(*[_stream(llm, f"ok{i}", 5, set()) for i in range(8)])
            assert got == [5] * 8
            values = parse_prometheus_text(llm.metrics.render())
            for rank in ("0", "1"):
                assert sample(values, "servetwin:engine_steps_total", engine=rank) > 0
            # an aborted stream frees its in-flight slot in the balancer
            seen: set[str] = set()
            task = asyncio.ensure_future(_stream(llm, "cancelled", 10_000, seen))
            while not seen:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert "cancelled" not in llm.client.coordinator.lb.reqs_in_flight
            # one engine dies: every stream (on either engine) ends with EngineDeadError
            seen = set()
            streams = [asyncio.ensure_future(_stream(llm, f"s{i}", 10_000, seen)) for i in range(10)]
            while len(seen) < 10:
                await asyncio.sleep(0.01)
            os.kill(pids[1], signal.SIGKILL)
            t_kill = time.monotonic()
            results = await asyncio.gather(*streams, return_exceptions=True)
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert time.monotonic() - t_kill < 5.0
            assert llm.errored and "data-parallel engine 1" in str(llm.dead_error)
            with pytest.raises(EngineDeadError):
                llm.add_request("late", "x", SamplingParams(max_tokens=1))
        finally:
            llm.shutdown()
        deadline = time.monotonic() + 10
        while any(map(pid_alive, pids)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not [p for p in pids if pid_alive(p)]

    asyncio.run(asyncio.wait_for(main(), 120))


def test_llm_raises_engine_dead_when_one_engine_dies_and_close_stops_the_other():
    llm = LLM(**dict(FAKE, multiprocess=True))
    pids = llm.llm_engine.client.engine_pids
    try:
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not llm.llm_engine.client.is_dead and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(EngineDeadError, match="data-parallel engine 0"):
            llm.generate([f"prompt {i}" for i in range(8)], SamplingParams(max_tokens=3))
    finally:
        llm.close()
    deadline = time.monotonic() + 10
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)]
