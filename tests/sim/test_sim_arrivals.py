"""Arrival processes: rates, burstiness, open-loop replay order, closed-loop feedback."""
import numpy as np
import pytest
import simpy

from servetwin.sim.arrivals import ClosedLoop, Gamma, Offline, Poisson, parse_arrival
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
