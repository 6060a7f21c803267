"""Multi-turn conversations: each turn's prompt is the history (previous prompt + the engine's answer)
plus a new message; turn k + 1 is sent when turn k completes; the prefix cache sees the history."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.sim.coefficients import CostCoefficients
from servetwin.sim.conversation import ConversationArrivals
from servetwin.sim.cost_model import CostModel
from servetwin.sim.engine import Simulation
from servetwin.sim.executor import SimExecutor
from servetwin.sim.frontend import FrontendCoefficients, FrontendConfig, FrontendSpec
from servetwin.sim.workload import build_workload

BLOCK = 16
STEP_1MS = CostCoefficients(c_step=1e-3, c_linear=0.0, c_attn_prefill=0.0, c_attn_decode=0.0, c_lm_head=0.0, c_comm=0.0)


def _engine(caching=True, async_scheduling=False, max_model_len=4096, blocks=3000):
    cm = CostModel("tiny-llama", "cpu", coefficients=STEP_1MS)
    return EngineCore(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=max_model_len,
                                      async_scheduling=async_scheduling),
                      CacheConfig(num_gpu_blocks=blocks, block_size=BLOCK, enable_prefix_caching=caching),
                      SimExecutor(cost_model=cm))


def _workload(count=5, turns=3, seed=0, think_s=0.25, arrival=None, **extra):
    conv = {"count": count, "turns": turns, "first_prompt": {"type": "uniform", "low": 20, "high": 70},
            "message_tokens": {"type": "uniform", "low": 1, "high": 40},
            "output_tokens": {"type": "uniform", "low": 1, "high": 50}, "think_time_s": think_s, **extra}
    return {"seed": seed, "conversations": conv, "arrival": arrival or {"type": "poisson", "rate": 20.0}}


def _run(workload, engine=None, **sim_kw):
    spec, reqs = build_workload(workload, vocab_size=1000)
    sim = Simulation(engine or _engine(), reqs, spec.arrival, **sim_kw)
    sim.run()
    return sim, reqs, sim.recorder.frames()["requests"].set_index("request_id")


def _history_hits(history_len, async_scheduling=False):
    """The prompt tokens of a next turn the prefix cache must hold: vLLM caches full blocks of computed
    tokens and the answer's last token was never computed; with async scheduling the block holding the
    answer's second-to-last token was scheduled before that token was known, so it may be missing too."""
    return (history_len - (2 if async_scheduling else 1)) // BLOCK * BLOCK


def _turns(reqs):
    convs = {}
    for r in reqs:
        convs.setdefault(r.conversation.conversation, []).append(r)
    return [sorted(ts, key=lambda r: r.conversation.turn) for ts in convs.values()]


def test_ids_turn_order_and_planned_lengths():
    spec, reqs = build_workload(_workload(count=3, turns=4), vocab_size=1000)
    assert isinstance(spec.arrival, ConversationArrivals)
    assert [r.request_id for r in reqs[:5]] == ["conv-0-turn-1", "conv-0-turn-2", "conv-0-turn-3", "conv-0-turn-4",
                                                "conv-1-turn-1"]
    for turns in _turns(reqs):
        for prev, turn in zip(turns, turns[1:]):  # planned: previous prompt + planned answer + message
            assert len(turn.prompt_token_ids) == (len(prev.prompt_token_ids) + prev.max_tokens
                                                  + turn.conversation.message_tokens)
            assert turn.prompt_token_ids[:len(prev.prompt_token_ids)] == prev.prompt_token_ids


@pytest.mark.parametrize("sim_kw", [dict(record_step_requests=True),  # decode fast-forward
                                    dict(record_step_requests=False),  # implicit (lazy) decodes
                                    dict(record_step_requests=True, fast_forward=False)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_next_prompt_holds_the_engines_answer_and_the_cache_hits_the_history(sim_kw, async_scheduling):
    sim, reqs, rows = _run(_workload(), _engine(async_scheduling=async_scheduling), **sim_kw)
    assert not sim.result.unfinished and len(sim.result.completion_s) == len(reqs) == 15
    for turns in _turns(reqs):
        assert rows.loc[turns[0].request_id, "cached_tokens"] == 0  # conversations share nothing
        for prev, turn in zip(turns, turns[1:]):
            answer = prev.output_token_ids
            assert len(answer) == prev.max_tokens == rows.loc[prev.request_id, "output_tokens"]
            history = prev.prompt_token_ids + answer
            message = turn.prompt_token_ids[len(history):]
            assert turn.prompt_token_ids == history + message and len(message) == turn.conversation.message_tokens
            assert 0 not in answer  # the placeholder never reaches the engine
            # vLLM caches full blocks of computed tokens; the answer's last token was never computed
            assert rows.loc[turn.request_id, "cached_tokens"] >= _history_hits(len(history), async_scheduling)
            # sent when the previous turn completed plus the user's think time
            done = sim.result.completion_s[prev.request_id]
            assert turn.arrival_s == pytest.approx(done + 0.25)


def test_without_prefix_caching_no_turn_hits():
    _, reqs, rows = _run(_workload(), _engine(caching=False))
    assert (rows.cached_tokens == 0).all() and len(rows) == len(reqs)


def test_a_modelled_front_end_sends_the_next_turn_after_the_client_got_the_answer():
    fe = FrontendConfig("api_server", "completions", FrontendSpec("test", FrontendCoefficients(
        c_req_s=0.002, c_chunk_s=0.001, c_step_s=0.0005, latency_in_s=0.001, latency_out_s=0.001)))
    sim, reqs, rows = _run(_workload(think_s=0.0), frontend=fe, record_step_requests=False)
    for turns in _turns(reqs):
        for prev, turn in zip(turns, turns[1:]):
            assert turn.arrival_s == pytest.approx(rows.loc[prev.request_id, "client_finish_s"])
            assert turn.arrival_s > rows.loc[prev.request_id, "finish_s"]
            history = len(prev.prompt_token_ids) + prev.max_tokens
            assert rows.loc[turn.request_id, "cached_tokens"] >= _history_hits(history)


def test_closed_loop_users_run_one_conversation_after_another():
    sim, reqs, rows = _run(_workload(count=4, turns=2, think_s=0.0,
                                     arrival={"type": "closed_loop", "clients": 2, "think_time_s": 1.0}))
    starts = {r.conversation.conversation: r.arrival_s for r in reqs if r.conversation.turn == 1}
    ends = {r.conversation.conversation: sim.result.completion_s[r.request_id] for r in reqs
            if r.conversation.turn == 2}
    assert starts[0] == starts[1] == 0.0
    # user 0 (conversation 0) and user 1 (conversation 1) each start their next conversation 1 s later
    assert sorted([starts[2], starts[3]]) == pytest.approx(sorted([ends[0] + 1.0, ends[1] + 1.0]))


def test_a_rejected_turn_ends_its_conversation():
    # a 200-token context: turns grow past it and are rejected; their conversation sends nothing more
    sim, reqs, rows = _run(_workload(count=3, turns=6), _engine(max_model_len=200))
    assert sim.result.rejected
    for turns in _turns(reqs):
        ids = [t.request_id for t in turns]
        first_bad = next((i for i, rid in enumerate(ids) if rid in sim.result.rejected), None)
        if first_bad is not None:
            assert all(rid in sim.result.unfinished for rid in ids[first_bad + 1:])
            assert all(rid not in rows.index for rid in ids[first_bad + 1:])


def test_max_context_tokens_ends_conversations_when_generated():
    _, reqs = build_workload(_workload(count=20, turns=10, max_context_tokens=300), vocab_size=1000)
    for turns in _turns(reqs):
        assert all(len(t.prompt_token_ids) + t.max_tokens <= 300 for t in turns[1:])
    assert any(len(ts) < 10 for ts in _turns(reqs))


def test_finish_eos_answers_end_with_the_forced_eos():
    w = {**_workload(count=2, turns=2), "finish": "eos", "max_output_tokens": 64}
    sim, reqs, _ = _run(w)
    for turns in _turns(reqs):
        first = turns[0]
        assert len(first.output_token_ids) == first.eos_at and first.output_token_ids[-1] == 0  # EOS id
        assert turns[1].prompt_token_ids[:len(first.prompt_token_ids) + first.eos_at] == \
            first.prompt_token_ids + first.output_token_ids


def test_same_seed_same_conversations():
    kw = dict(turns={"type": "uniform", "low": 1, "high": 5}, think_s=2.0, think="exponential")
    _, a = build_workload(_workload(**kw), vocab_size=1000)
    _, b = build_workload(_workload(**kw), vocab_size=1000)
    _, c = build_workload(_workload(**kw, seed=1), vocab_size=1000)
    thinks = [r.conversation.think_s for r in a if r.conversation.turn > 1]
    assert len(set(thinks)) == len(thinks) > 3  # exponential, drawn when generated
    assert [(r.request_id, r.prompt_token_ids, r.max_tokens, r.conversation) for r in a] == \
        [(r.request_id, r.prompt_token_ids, r.max_tokens, r.conversation) for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), count=st.integers(1, 4), turns=st.integers(1, 4),
       think=st.sampled_from([0.0, 0.01]), async_scheduling=st.booleans(), lazy=st.booleans())
def test_every_prompt_is_a_prefix_of_the_next_turns(seed, count, turns, think, async_scheduling, lazy):
    sim, reqs, rows = _run(_workload(count=count, turns=turns, seed=seed, think_s=think),
                           _engine(async_scheduling=async_scheduling), record_step_requests=not lazy)
    assert len(sim.result.completion_s) == len(reqs)
    for ts in _turns(reqs):
        for prev, turn in zip(ts, ts[1:]):
            history = prev.prompt_token_ids + prev.output_token_ids
            assert turn.prompt_token_ids[:len(history)] == history
            assert rows.loc[turn.request_id, "cached_tokens"] >= _history_hits(len(history), async_scheduling)


@pytest.mark.parametrize("extra, field", [
    ({"requests": 4}, "workload.requests"),
    ({"prompt_tokens": 4}, "workload.prompt_tokens"),
    ({"max_prompt_tokens": 4}, "workload.max_prompt_tokens"),
    ({"lengths": {"type": "sharegpt_like", "prompt": 5, "output": 5}}, "workload.lengths"),
    ({"n": 2}, "workload.n"),
])
def test_conflicting_workload_fields_are_named(extra, field):
    with pytest.raises(ConfigError) as e:
        build_workload({**_workload(), **extra})
    assert e.value.path == field


@pytest.mark.parametrize("conv, field", [
    ({"count": 0}, "workload.conversations.count"),
    ({"turns": 0}, "workload.conversations.turns"),
    ({"think": "poisson"}, "workload.conversations.think"),
    ({"think_time_s": -1}, "workload.conversations.think_time_s"),
    ({"max_context_tokens": 1}, "workload.conversations.max_context_tokens"),
    ({"message_tokens": {"type": "uniform", "low": 5}}, "workload.conversations.message_tokens.high"),
    ({"turn": 3}, "workload.conversations.turn"),
])
def test_bad_conversation_fields_are_named(conv, field):
    w = _workload()
    w["conversations"].update(conv)
    with pytest.raises(ConfigError) as e:
        build_workload(w)
    assert e.value.path == field


def test_trace_arrival_for_conversations_is_refused(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n")
    with pytest.raises(ConfigError) as e:
        build_workload({**_workload(), "arrival": {"type": "trace", "path": str(p)}})
    assert e.value.path == "workload.conversations"
