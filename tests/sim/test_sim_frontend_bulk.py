"""`ApiServerFrontend.on_step_outputs_at` and `outputs_at`: the outputs of consecutive quiet steps given with
explicit times equal, in every effect, `on_step_output` called at those times - the CPUs' virtual-time state and
jobs, the output messages and their merging, the deliveries (floats with ==), no SimPy event (`outputs_at`: the
front end's wake-ups and hand-overs to the engine at their times too) - and what follows goes on alike."""
from types import SimpleNamespace

import pytest
import simpy
from hypothesis import given, settings, strategies as st

from servetwin.sim.frontend import ApiServerFrontend, load_frontend_spec
from servetwin.sim.sim_time import delay_to


class _CountingEnvironment(simpy.Environment):
    """A SimPy environment that counts the timeouts created (the front end's wake-ups and delayed deliveries)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_timeouts = 0

    def timeout(self, delay, value=None):
        self.num_timeouts += 1
        return super().timeout(delay, value)


def _frontend(servers: int, endpoint: str, ingress: str, scale: float):
    env = _CountingEnvironment()
    spec = load_frontend_spec("vllm")
    c = spec.coefficients
    for name in ("c_req_s", "c_chat_s", "c_prompt_token_s", "c_hop_s", "c_hop_token_s", "c_step_s", "c_token_out_s",
                 "c_chunk_s", "c_finish_s"):  # (scaled: a busy front end merges messages)
        setattr(c, name, getattr(c, name) * scale)
    reached = []
    fe = ApiServerFrontend(env, spec, endpoint, lambda r, d: reached.append((env.now, r.request_id, d)),
                           api_server_count=servers, ingress=ingress)
    return env, fe, reached


def _state(fe: ApiServerFrontend) -> dict:
    """What the front end holds (read only): per CPU its clock, virtual time, weight, busy time and jobs."""
    cpus = [(c.now, c.virtual, c.weight, c.busy_s, c.has_important_jobs,
             sorted((v, seq, job.work, job.weight, job.important) for v, seq, job in c._heap)) for c in fe.cpus]
    outputs = [(o.t_engines, o.num_tokens, o.num_chunks, o.num_finished, len(o.done)) for o in fe._outputs]
    d = fe.deliveries
    return {"cpus": cpus, "outputs": outputs, "busy": fe._handler_busy, "wake": fe._wake_at,
            "messages": fe.num_messages, "requests": fe.num_requests,
            "deliveries": (d._ends, d._clients, [d.client_time(t) for t in d._ends])}


def _run_to(env: simpy.Environment, t: float) -> None:
    if t > env.now:
        env.run(until=t)


def _request(i: int):
    return SimpleNamespace(request_id=f"r{i}", prompt_token_ids=list(range(50 + i)))


@settings(max_examples=150, deadline=None)
@given(servers=st.sampled_from([1, 1, 2, 3]), endpoint=st.sampled_from(["chat", "completions"]),
       ingress=st.sampled_from(["shared", "in_order"]), scale=st.sampled_from([1.0, 10.0, 30.0, 300.0]),
       prefix=st.lists(st.floats(1e-5, 0.02), max_size=4), k=st.integers(0, 64),
       steps=st.lists(st.tuples(st.floats(1e-5, 0.03), st.floats(0.0, 0.01)), max_size=25),
       same_engine_time=st.booleans())
def test_on_step_outputs_at_equals_sequential_calls(servers, endpoint, ingress, scale, prefix, k, steps,
                                                    same_engine_time):
    """Quiet steps after a busy start (requests' ingress, a completing output, all done), with unimportant
    output jobs still in service; each step's output received at its end (sync) or later (async: at the next
    step's start); one, two or three API servers; then a request and a completing output after the run."""
    fronts = [_frontend(servers, endpoint, ingress, scale) for _ in range(2)]
    for env, fe, _ in fronts:  # the busy start: ingress, an output completing a request, all settled
        done = [fe.submit(_request(i)) for i in range(2)]
        env.run(until=0.005)
        fe.on_step_output(env.now, 2, 1, [done[0]])
        env.run()
        t = env.now
        for gap in prefix:  # quiet outputs whose jobs are still in service when the run starts
            t += gap
            _run_to(env, t)
            fe.on_step_output(t, 3, 0, [])
    t_engines, nows, t = [], [], fronts[0][0].now
    for gap, lag in steps:
        t += gap
        t_engines.append(t)
        nows.append(max(nows[-1] if nows else t, t if same_engine_time else t + lag))
    (env_a, seq, _), (env_b, bulk, _) = fronts
    assert bulk.quiet_until(nows[-1] if nows else env_b.now)
    timeouts = env_a.num_timeouts, env_b.num_timeouts
    clock = []  # env.now at each call: SimPy's `run(until)` adds a delay to now, rounded
    for now, t_engine in zip(nows, t_engines):
        _run_to(env_a, now)
        clock.append(env_a.now)
        seq.on_step_output(t_engine, k, 0, [])
    for now in nows:  # (env_b's clock along the same path)
        _run_to(env_b, now)
    bulk.on_step_outputs_at(clock, t_engines, k)
    assert (env_a.num_timeouts, env_b.num_timeouts) == timeouts  # no SimPy event either way
    assert _state(bulk) == _state(seq)
    # what follows: a request, a quiet output and one completing it, to the end
    results = []
    for env, fe, reached in fronts:
        _run_to(env, (nows[-1] if nows else env.now) + 0.001)
        done = fe.submit(_request(9))
        fe.on_step_output(env.now, k + 1, 0, [])
        env.run(until=env.now + 0.002)
        fe.on_step_output(env.now, 1, 1, [done])
        env.run()
        fe.finish()
        results.append((_state(fe), env.now, reached[-1][0], fe.summary(1.0)))
    assert results[0] == results[1]


def test_on_step_outputs_at_refuses_a_front_end_that_is_not_quiet():
    """An ingress in flight (an important job) or a pending wake-up due inside the run: refused, nothing changed."""
    env, fe, _ = _frontend(1, "completions", "shared", 1.0)
    fe.submit(_request(0))
    assert not fe.quiet_until(1.0)
    before = _state(fe)
    with pytest.raises(RuntimeError, match="not quiet"):
        fe.on_step_outputs_at([0.0, 0.001], [0.0, 0.001], 4)
    assert _state(fe) == before
    fe.on_step_outputs_at([0.0], [0.0], 0)  # (no output: nothing to send, as on_step_output)
    assert _state(fe) == before


@settings(max_examples=150, deadline=None)
@given(servers=st.sampled_from([1, 1, 2, 3]), endpoint=st.sampled_from(["chat", "completions"]),
       ingress=st.sampled_from(["shared", "in_order"]), scale=st.sampled_from([0.0, 1.0, 10.0, 30.0]),
       arrivals=st.lists(st.floats(0.0, 0.06), min_size=1, max_size=6), k=st.integers(1, 64),
       steps=st.lists(st.floats(1e-5, 0.01), min_size=1, max_size=40), tail=st.floats(0.0, 0.02))
def test_outputs_at_while_an_ingress_is_in_service_equals_sequential_calls(servers, endpoint, ingress, scale, arrivals,
                                                                           k, steps, tail):
    """Quiet steps' outputs while requests' ingress is on the CPU (bursts, one to three API servers, shared or in
    order, output work from none to heavy), given later - at the front end's wake-ups (`before_wake`), at an
    arrival and at the end - equal `on_step_output` called at each step's end: the CPUs' state, the messages,
    the deliveries, when each request reaches the engine (floats with ==)."""
    fronts = [_frontend(servers, endpoint, ingress, scale) for _ in range(2)]
    (env_a, seq, reached_a), (env_b, bulk, reached_b) = fronts
    events, t = sorted((t, 0, i) for i, t in enumerate(arrivals)), 0.0
    for gap in steps:
        t += gap
        events.append((t, 1, -1))
    events.sort()  # (an arrival at a step's end first: the engine settles before its next step)
    deferred: list[float] = []

    def give() -> None:  # the engine's part: the outputs received before now, at their times
        n = sum(1 for now in deferred if now < env_b.now)
        if n:
            bulk.outputs_at(deferred[:n], deferred[:n], k)
            del deferred[:n]
    bulk.before_wake = give
    for t, kind, i in events:
        _run_to(env_a, t)
        _run_to(env_b, t)
        if kind == 0:
            seq.submit(_request(i))
            give()
            bulk.submit(_request(i))
        else:
            while env_a.peek() <= env_a.now:  # (the step-by-step engine settles: wake-ups due now first)
                env_a.step()
            seq.on_step_output(env_a.now, k, 0, [])
            assert bulk.outputs_deferrable(env_b.now)
            deferred.append(env_b.now)
    end = events[-1][0] + tail
    for env in (env_a, env_b):
        _run_to(env, end)
    give()
    assert not deferred or end <= env_b.now == deferred[-1]  # (an output received now: at its own time)
    if deferred:
        bulk.outputs_at(deferred, deferred, k)
        deferred.clear()
    assert _state(bulk) == _state(seq)
    assert [(t, r) for t, r, _ in reached_a] == [(t, r) for t, r, _ in reached_b]
    for env, fe, _ in fronts:  # what follows: a completing output, to the end
        fe.on_step_output(env.now, 1, 0, [])
        env.run()
        fe.finish()
    assert _state(bulk) == _state(seq)
    assert [(t, r) for t, r, _ in reached_a] == [(t, r) for t, r, _ in reached_b]
    assert seq.summary(1.0) == bulk.summary(1.0)


def test_a_replayed_timeout_lands_on_its_time_where_no_delay_from_now_does():
    """Now's ulp finer than the target's (their sums round past it: no delay lands there): two hops, the last from
    the float before the target; SimPy's clock reads the target exactly when the callback runs."""
    now, t = 0.007339966513270923, 0.015604015468203036
    assert delay_to(now, t) is None
    env, fe, _ = _frontend(1, "completions", "shared", 1.0)
    env.run(until=now)
    assert env.now == now
    seen = []
    fe._at(t, lambda _e: seen.append(env.now))
    fe._at(now, lambda _e: seen.append(env.now))  # (now itself: no delay)
    env.run()
    assert seen == [now, t]
