"""`AsyncLLM` (the server's front end) and the paced engine loop used to serve the `sim` backend."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from servetwin.core.engine.async_llm import AsyncLLM
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.mp_client import AsyncMPClient, EngineRequestError
from servetwin.core.sampling_params import SamplingParams
from frontend_utils import backend_available, pid_alive

FAKE = dict(model="fake-model", backend="fake", tokenizer="toy")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _collect(llm: AsyncLLM, prompt, params, rid):
    outs = []
    async for out in llm.generate(prompt, params, rid):
        outs.append(out)
    return outs


def test_generate_streams_cumulative_outputs_for_many_concurrent_requests():
    async def main():
        llm = await asyncio.to_thread(AsyncLLM, EngineArgs.from_kwargs(**FAKE))
        try:
            lens = [1 + (i * 7) % 23 for i in range(60)]
            results = await asyncio.gather(*[
                _collect(llm, f"prompt {i} words", SamplingParams(max_tokens=n, temperature=0), f"r{i}")
                for i, n in enumerate(lens)])
            for n, outs in zip(lens, results):
                assert outs[-1].finished and all(not o.finished for o in outs[:-1])
                final = outs[-1].outputs[0]
                assert len(final.token_ids) == n and final.finish_reason == "length"
                assert final.text == "".join(f" {t}" for t in final.token_ids)  # toy tokenizer
                counts = [len(o.outputs[0].token_ids) for o in outs]
                assert counts == sorted(counts)  # cumulative
            # n > 1 in one generate call
            outs = await _collect(llm, [1, 2, 3], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1), "par")
            assert [len(c.token_ids) for c in outs[-1].outputs] == [5, 5, 5]
            assert not llm.collectors and not llm.output_processor.has_unfinished()
            stats = await llm.get_stats()
            assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        finally:
            llm.shutdown()
    run(main())


def test_cancel_and_break_abort_the_request_in_the_engine():
    async def main():
        llm = await asyncio.to_thread(AsyncLLM, EngineArgs.from_kwargs(**FAKE), pace=True, fake_step_time_s=0.005)
        try:
            params = SamplingParams(max_tokens=2000, ignore_eos=True)
            # break out of the generator
            gen = llm.generate([1, 2, 3], params, "brk")
            async for out in gen:
                if len(out.outputs[0].token_ids) >= 2:
                    break
            await gen.aclose()
            # cancel the consuming task
            task = asyncio.ensure_future(_collect(llm, [4, 5, 6], params, "cnl"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 3
            while True:
                stats = await llm.get_stats()
                if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)
            assert stats["num_steps"] < 400  # 2000 steps would take 10 s: both were aborted early
            assert llm.metrics.finished.get("abort") == 2
            assert not llm.collectors and not llm.output_processor.has_unfinished()
        finally:
            llm.shutdown()
    run(main())


def test_refused_request_fails_only_its_own_generate():
    async def main():
        llm = await asyncio.to_thread(AsyncLLM, EngineArgs.from_kwargs(num_gpu_blocks=5, **FAKE))
        try:
            ok = asyncio.ensure_future(_collect(llm, [1] * 10, SamplingParams(max_tokens=5), "ok"))
            with pytest.raises(EngineRequestError, match=r"^prompt: "):
                await _collect(llm, [2] * 100, SamplingParams(max_tokens=5), "too-big")
            assert len((await ok)[-1].outputs[0].token_ids) == 5
        finally:
            llm.shutdown()
    run(main())


def test_dead_engine_fails_pending_and_later_requests_quickly():
    async def main():
        llm = await asyncio.to_thread(AsyncLLM, EngineArgs.from_kwargs(**FAKE), pace=True, fake_step_time_s=0.01)
        try:
            pid = llm.client.engine_pid
            task = asyncio.ensure_future(_collect(llm, [1, 2], SamplingParams(max_tokens=1000), "victim"))
            await asyncio.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await task
            assert time.monotonic() - t0 < 1.5
            assert llm.errored
            with pytest.raises(EngineDeadError):
                await _collect(llm, [3], SamplingParams(max_tokens=2), "later")
        finally:
            llm.shutdown()
        assert not pid_alive(pid)
    run(main())


def _paced_release_check(args: EngineArgs, time_scale: float, step_s: float | None) -> tuple[int, float]:
    """Drive an AsyncMPClient directly; every outputs message must arrive at or after its release time."""
    async def main():
        client = await asyncio.to_thread(AsyncMPClient, args, pace=True, time_scale=time_scale,
                                         fake_step_time_s=step_s)
        try:
            assert client.config.paced and client.config.time_scale == time_scale
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            t_submit = time.monotonic()
            with client.batched():
                for i in range(3):
                    client.add_request(f"r{i}", [1 + i] * 20, params)
            releases, done = [], 0
            while done < 3:
                msg = await client.get_output_async()
                now = time.monotonic()
                if not msg.outputs:
                    continue
                assert msg.release_at > 0 and now >= msg.release_at  # never earlier than simulated time
                releases.append((msg.release_at, msg.sim_time_s))
                done += sum(1 for o in msg.outputs if o.finished)
            # release times follow simulated time: wall = t_ready + sim * time_scale, strictly increasing
            sims = [s for _, s in releases]
            assert all(b > a for a, b in zip(sims, sims[1:]))
            for (r0, s0), (r1, s1) in zip(releases, releases[1:]):
                assert abs((r1 - r0) - (s1 - s0) * time_scale) < 1e-6
            stats = await client.call_utility_async("get_stats")
            return sims, releases[-1][0] - t_submit, stats
        finally:
            client.shutdown()
    return run(main())


def test_paced_fake_engine_releases_outputs_at_step_end_times():
    sims, elapsed, stats = _paced_release_check(EngineArgs.from_kwargs(**FAKE), time_scale=0.5, step_s=0.02)
    assert len(sims) == 12
    # a busy engine's steps are back to back in simulated time: exactly one step time apart
    assert all(abs((b - a) - 0.02) < 1e-9 for a, b in zip(sims, sims[1:]))
    # 12 steps of 20 ms simulated at time_scale 0.5 -> at least 120 ms of wall time
    assert elapsed >= 12 * 0.02 * 0.5 - 1e-6
    assert stats["paced"] and stats["sim_time_s"] == pytest.approx(sims[-1])


@pytest.mark.skipif(not backend_available("sim"), reason="sim backend (servetwin.sim.kv_pool) not importable")
def test_paced_sim_engine_releases_outputs_at_predicted_times():
    args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", tokenizer="toy", num_gpu_blocks=1024)
    sims, elapsed, stats = _paced_release_check(args, time_scale=20.0, step_s=None)
    assert len(sims) == 12
    # The same requests through an in-process engine give the cost model's predicted step durations:
    # the paced engine's step end times are exactly their running sum.
    from servetwin.core.engine.engine_factory import create_engine_core
    from servetwin.core.request import Request

    engine, _ = create_engine_core(args)
    for i in range(3):
        engine.add_request(Request(f"r{i}", [1 + i] * 20, SamplingParams(max_tokens=12, ignore_eos=True)))
    durations = []
    while engine.scheduler.has_unfinished_requests():
        result = engine.step()
        if result.outputs:
            durations.append(result.model_output.timing.duration_s)
    assert len(durations) == 12 and all(d > 0 for d in durations)
    gaps = [b - a for a, b in zip(sims, sims[1:])]
    assert gaps == pytest.approx(durations[1:], rel=1e-9, abs=1e-12)
    # released no earlier than simulated time: 11 predicted steps stretched 20x
    assert elapsed >= sum(durations[1:]) * 20.0 - 1e-6
