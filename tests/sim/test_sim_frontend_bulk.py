"""`ApiServerFrontend.on_step_outputs_at`: the outputs of consecutive quiet steps given with explicit times equal,
in every effect, `on_step_output` called at those times - the CPUs' virtual-time state and jobs, the output
messages and their merging, the deliveries (floats with ==), no SimPy event - and what follows goes on alike."""
from types import SimpleNamespace

import pytest
import simpy
from hypothesis import given, settings, strategies as st

from servetwin.sim.frontend import ApiServerFrontend, load_frontend_spec


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
