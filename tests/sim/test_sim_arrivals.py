"""Arrival processes: rates, burstiness, open-loop replay order, closed-loop feedback."""
import math

import numpy as np
import pytest
import simpy
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.sim.arrivals import ClosedLoop, Gamma, Offline, Poisson, Stage, StageLadder, parse_arrival
from servetwin.sim.workload import WorkloadRequest


def _gaps(times):
    return np.diff(np.concatenate([[0.0], times]))


def test_offline_all_at_zero():
    assert Offline().times(4, np.random.default_rng(0)).tolist() == [0.0] * 4


def test_poisson_rate_and_cv():
    t = Poisson(rate=25.0).times(4000, np.random.default_rng(1))
    gaps = _gaps(t)
    assert 4000 / t[-1] == pytest.approx(25.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.06)
    assert (gaps > 0).all()


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_rate_and_cv(cv):
    t = Gamma(rate=8.0, cv=cv).times(20000, np.random.default_rng(2))
    gaps = _gaps(t)
    assert 20000 / t[-1] == pytest.approx(8.0, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def _req(i, t=0.0):
    return WorkloadRequest(f"r{i}", t, [1, 2, 3], 4)


def test_open_loop_process_submits_at_arrival_times_in_input_order():
    env = simpy.Environment()
    reqs = [_req(0, 0.0), _req(1, 0.0), _req(2, 1.5), _req(3, 1.5), _req(4, 4.0)]
    seen = []

    def submit(r):
        seen.append((env.now, r.request_id))
        return env.event()

    env.process(Poisson(1.0).process(env, reqs, submit, np.random.default_rng(0)))
    env.run()
    assert seen == [(0.0, "r0"), (0.0, "r1"), (1.5, "r2"), (1.5, "r3"), (4.0, "r4")]


def test_closed_loop_keeps_n_in_flight_and_thinks():
    env = simpy.Environment()
    service, think, clients = 2.0, 0.5, 3
    reqs = [_req(i) for i in range(10)]
    in_flight, peak, log = [0], [0], []

    def submit(r):
        done = env.event()
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        log.append((env.now, r.request_id))

        def finish():
            yield env.timeout(service)
            in_flight[0] -= 1
            done.succeed()
        env.process(finish())
        return done

    proc = ClosedLoop(clients, think_time_s=think)
    env.process(proc.process(env, reqs, submit, np.random.default_rng(0)))
    env.run()
    assert peak[0] == clients
    assert [t for t, _ in log] == [0.0] * 3 + [2.5] * 3 + [5.0] * 3 + [7.5]
    assert [r.arrival_s for r in reqs] == [t for t, _ in log]  # set when issued
    assert [rid for _, rid in log] == [f"r{i}" for i in range(10)]


def test_closed_loop_exponential_think_is_seeded():
    def run(seed):
        env = simpy.Environment()
        reqs = [_req(i) for i in range(6)]

        def submit(r):
            return env.timeout(1.0)
        env.process(ClosedLoop(2, 1.0, "exponential").process(env, reqs, submit,
                                                               np.random.default_rng(seed)))
        env.run()
        return [r.arrival_s for r in reqs]
    assert run(5) == run(5) != run(6)


def test_parse_arrival_defaults_and_types():
    assert isinstance(parse_arrival(None), Offline)
    assert parse_arrival({"type": "gamma", "rate": 2, "cv": 3}) == Gamma(2.0, 3.0)
    cl = parse_arrival({"type": "closed_loop", "clients": 4, "think_time_s": 0.2})
    assert cl == ClosedLoop(4, 0.2, "fixed") and cl.closed_loop
    with pytest.raises(ValueError, match="x.think: must be one of"):
        parse_arrival({"type": "closed_loop", "clients": 4, "think": "long"}, "x")
    with pytest.raises(ValueError, match="x.burst: unknown field"):
        parse_arrival({"type": "poisson", "rate": 1, "burst": 2}, "x")


@settings(max_examples=40, deadline=None)
@given(stages=st.lists(st.tuples(st.floats(0.5, 20.0), st.floats(0.5, 10.0)), min_size=1, max_size=4),
       service=st.floats(0.0, 5.0), seed=st.integers(0, 2**16))
def test_stage_ladder_stages_never_overlap(stages, service, seed):
    """inference-perf's ladder: stage k sends int(rate x duration) requests within [enqueue + 1 s,
    enqueue + 1 s + duration], and the next stage is enqueued on the first 1 s poll tick after the last of
    them finished."""
    ladder = StageLadder(tuple(Stage(r, d) for r, d in stages if int(r * d) >= 1))
    assume(ladder.stages)
    counts = ladder.stage_counts()
    env = simpy.Environment()
    reqs = [_req(i) for i in range(sum(counts))]
    finish: dict[str, float] = {}

    def submit(r):
        ev = env.timeout(service)
        ev.callbacks.append(lambda _e, rid=r.request_id: finish.__setitem__(rid, env.now))
        return ev
    env.process(ladder.process(env, reqs, submit, np.random.default_rng(seed)))
    env.run()
    assert len(finish) == len(reqs)  # every request sent once
    enqueued, first = 0.0, 0
    for stage, n in zip(ladder.stages, counts):
        part = reqs[first:first + n]
        times = [r.arrival_s for r in part]
        assert times == sorted(times)
        assert times[0] >= enqueued + 1.0 - 1e-9
        assert times[-1] == pytest.approx(enqueued + 1.0 + stage.duration_s)  # gaps rescaled to the duration
        last_done = max(finish[r.request_id] for r in part)
        nxt = enqueued + math.ceil((last_done - enqueued) - 1e-9)  # the 1 s poll tick that sees it
        if first + n < len(reqs):
            assert reqs[first + n].arrival_s >= nxt + 1.0 - 1e-9 >= last_done
        enqueued, first = nxt, first + n


def test_stage_ladder_parse_names_the_field():
    ladder = parse_arrival({"type": "stages", "stages": [{"rate": 3, "duration_s": 20}, {"rate": 2.5, "duration_s": 3}]})
    assert ladder.stage_counts() == [60, 7]
    with pytest.raises(ConfigError) as e:
        parse_arrival({"type": "stages", "stages": [{"rate": 3}]})
    assert "stages[0]" in str(e.value) and "duration_s" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_arrival({"type": "stages", "stages": [{"rate": 0.1, "duration_s": 2}]})
    assert "stages[0]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_arrival({"type": "stages", "stages": []})
    assert "workload.arrival.stages" in str(e.value)
