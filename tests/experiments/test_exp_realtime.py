"""`servetwin.core.testbed.realtime.run_realtime`: the wall-clock loop for measured backends, driven here by executors that
need no torch (FakeExecutor, SimExecutor), so it runs everywhere."""
import time

import numpy as np

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.executor import FakeExecutor
from servetwin.core.testbed.realtime import run_realtime
from servetwin.core.testbed.trace import TraceRecorder
from servetwin.sim.arrivals import Offline
from servetwin.sim.engine import simulate
from servetwin.sim.executor import SimExecutor
from servetwin.sim.workload import WorkloadRequest


class Count:
    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


def _engine(executor=None, max_model_len=256, blocks=64, seqs=4, budget=64):
    return EngineCore(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=max_model_len),
                      CacheConfig(num_gpu_blocks=blocks, block_size=16, enable_prefix_caching=True),
                      executor or FakeExecutor())


def _reqs(arrivals, prompt=20, max_tokens=4, **kw):
    return [WorkloadRequest(f"r{i}", t, [(7 * i + j) % 200 + 1 for j in range(prompt)], max_tokens, **kw)
            for i, t in enumerate(arrivals)]


def test_offline_run_completes_everything_with_timed_steps():
    rec, prog, done = TraceRecorder("rt", "fake"), Count(), []
    wall = run_realtime(_engine(), _reqs([0.3, 0.0, 0.1, 0.2, 0.0]), rec, offline=True, progress=prog,
                        on_complete=lambda rid, t: done.append(rid))
    frames = rec.frames()
    steps, reqs = frames["steps"], frames["requests"]
    assert prog.n == 5 and sorted(done) == ["r0", "r1", "r2", "r3", "r4"]
    assert (reqs.arrival_s == 0.0).all() and (reqs.output_tokens == 4).all()
    assert (reqs.finish_reason == "length").all()
    assert (steps.t_end_s >= steps.t_start_s).all()
    assert (steps.t_start_s.iloc[1:].to_numpy() >= steps.t_end_s.iloc[:-1].to_numpy()).all()
    assert 0 < steps.t_end_s.max() <= wall
    assert steps.annotation.iloc[0] == "execute_context_4(64)_generation_0(0)"  # budget 64 = 3 full + 1 chunk


def test_online_requests_join_when_their_arrival_time_has_come():
    arrivals = [0.0, 0.08, 0.16]
    rec = TraceRecorder("rt", "fake")
    t0 = time.perf_counter()
    wall = run_realtime(_engine(), _reqs(arrivals, max_tokens=2), rec, offline=False)
    assert time.perf_counter() - t0 >= 0.16 and wall >= 0.16  # it slept until the last arrival
    reqs = rec.frames()["requests"].set_index("request_id")
    for i, t in enumerate(arrivals):
        r = reqs.loc[f"r{i}"]
        assert r.arrival_s == t
        assert r.first_scheduled_s >= t  # never scheduled before it arrived
        assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s


def test_parallel_sampling_fans_out_and_unservable_requests_are_rejected():
    rec, prog, rejected, done = TraceRecorder("rt", "fake"), Count(), {}, []
    reqs = _reqs([0.0], n=3) + [WorkloadRequest("huge", 0.0, list(range(1, 300)), 4)]
    run_realtime(_engine(), reqs, rec, offline=True, progress=prog, rejected=rejected,
                 on_complete=lambda rid, t: done.append(rid))
    rows = rec.frames()["requests"].set_index("request_id")
    assert sorted(rows.index) == ["0_r0", "1_r0", "2_r0"] and (rows.parent_id == "r0").all()
    assert (rows.output_tokens == 4).all()
    assert done == ["r0"] and prog.n == 2
    assert list(rejected) == ["huge"] and "max_model_len" in rejected["huge"]


def test_realtime_loop_makes_the_same_decisions_as_the_simulator_offline():
    def sim_engine():
        return _engine(SimExecutor(model="tiny-llama", hardware="cpu"), seqs=3, budget=48)
    rng = np.random.default_rng(1)
    lens = rng.integers(5, 60, size=7)
    reqs = [WorkloadRequest(f"q{i}", 0.0, [(13 * i + j) % 250 + 1 for j in range(int(n))], int(3 + i % 4))
            for i, n in enumerate(lens)]
    sim = simulate(sim_engine(), [WorkloadRequest(**{f: getattr(r, f) for f in r.__slots__}) for r in reqs], Offline())
    rec = TraceRecorder("rt", "sim-realtime")
    run_realtime(sim_engine(), reqs, rec, offline=True)
    a, b = sim.recorder.frames()["steps"], rec.frames()["steps"]
    assert a.annotation.tolist() == b.annotation.tolist() and len(a) > 5
    assert a.kv_free_blocks.tolist() == b.kv_free_blocks.tolist()
