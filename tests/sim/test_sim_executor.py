"""SimExecutor: FakeExecutor's tokens, forced EOS, predicted timing, no host clock."""
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.engine.executor import Executor, FakeExecutor, make_executor
from servetwin.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from servetwin.sim.cost_model import CostModel, RowShape
from servetwin.sim.executor import SimExecutor, fake_token


def _outputs():
    """Step 0: 'a' (10-token prompt) fully, 'b' (40 tokens) a 16-token chunk. Step 1: 'a' decodes,
    'b' finishes its prompt. Step 2: both decode."""
    so0 = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", list(range(100, 110)), None, ([1],), 0),
                            NewRequestData("b", list(range(200, 240)), None, ([2, 3, 4],), 0)],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={"a": 10, "b": 16},
        total_num_scheduled_tokens=26, finished_req_ids=set(), preempted_req_ids=set(), step=0,
        num_computed_before={"a": 0, "b": 0})
    so1 = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(req_ids=["a", "b"], new_block_ids=[None, None],
                                                num_computed_tokens=[10, 16],
                                                num_output_tokens=[1, 0]),
        num_scheduled_tokens={"a": 1, "b": 24}, total_num_scheduled_tokens=25,
        finished_req_ids=set(), preempted_req_ids=set(), step=1,
        num_computed_before={"a": 10, "b": 16})
    so2 = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(req_ids=["a", "b"], new_block_ids=[None, None],
                                                num_computed_tokens=[11, 40],
                                                num_output_tokens=[2, 1]),
        num_scheduled_tokens={"a": 1, "b": 1}, total_num_scheduled_tokens=2,
        finished_req_ids=set(), preempted_req_ids=set(), step=2,
        num_computed_before={"a": 11, "b": 40})
    return [so0, so1, so2]


def test_implements_the_executor_protocol_and_is_found_by_name():
    assert isinstance(SimExecutor(), Executor)
    ex = make_executor("sim", model="tiny-llama", hardware="cpu")
    assert isinstance(ex, SimExecutor)


def test_tokens_match_fake_executor_and_timing_matches_cost_model():
    sim, fake = SimExecutor(model="llama-3.1-8b", hardware="h100-sxm", token_rule="oracle"), FakeExecutor()
    cm = CostModel("llama-3.1-8b", "h100-sxm")
    expected_rows = [
        [RowShape(10, 0, True), RowShape(16, 0, False)],
        [RowShape(1, 10, True), RowShape(24, 16, True)],
        [RowShape(1, 11, True), RowShape(1, 40, True)],
    ]
    for so, rows in zip(_outputs(), expected_rows):
        out = sim.execute_model(so)
        ref = fake.execute_model(so)
        assert out.sampled_token_ids == ref.sampled_token_ids
        assert out.req_ids == ref.req_ids and out.req_id_to_index == ref.req_id_to_index
        assert out.timing == cm.predict(rows)
        assert out.timing.duration_s > 0
    assert out.timing.padded_batch_size == 2  # decode-only step on a CUDA device


def test_forced_eos_at_output_length():
    sim = SimExecutor(eos_token_id=2, output_lengths={"a": 2}, token_rule="oracle")
    toks = [sim.execute_model(so).sampled_token_ids for so in _outputs()[:2]]
    assert toks[0][0] == [fake_token(0, 0)] and toks[1][0] == [2]  # 2nd output of 'a' is EOS
    assert toks[1][1] == [fake_token(1, 1)]  # 'b' is not forced


def test_fake_token_equal_to_eos_is_moved_off_it():
    eos = fake_token(0, 0)
    sim = SimExecutor(eos_token_id=eos, token_rule="oracle")
    out = sim.execute_model(_outputs()[0])
    assert out.sampled_token_ids[0] == [eos + 1]


def test_output_lengths_need_an_eos_id():
    with pytest.raises(ValueError, match="eos_token_id"):
        SimExecutor(output_lengths={"a": 3})
    with pytest.raises(ValueError, match=r"output_lengths\['a'\]"):
        SimExecutor(eos_token_id=2, output_lengths={"a": 0})


def test_never_reads_the_host_clock(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("host clock read")
    sim = SimExecutor(model="qwen3-0.6b", hardware="h200")
    for name in ("time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns",
                 "process_time"):
        monkeypatch.setattr(time, name, boom)
    for so in _outputs():
        assert sim.execute_model(so).timing.duration_s > 0


def test_request_token_rule_depends_on_the_request_only():
    from servetwin.sim.executor import request_token, request_token_salt  # noqa: PLC0415
    sim = SimExecutor(model="llama-3.1-8b")
    sos = _outputs()
    outs = [sim.execute_model(so).sampled_token_ids for so in sos]
    new = {r.req_id: r for r in sos[0].scheduled_new_reqs}
    salt_a, salt_b = (request_token_salt(rid, new[rid].prompt_token_ids, new[rid].sampling_params) for rid in "ab")
    assert outs[0][0] == [request_token(salt_a, 0)] and outs[1][0] == [request_token(salt_a, 1)]
    assert outs[1][1] == [request_token(salt_b, 0)] and outs[2][1] == [request_token(salt_b, 1)]
    # the tokens of implicit steps come from the same rule, and advance the runner's count
    assert sim.lazy_tokens("a", 3) == [request_token(salt_a, k) for k in (3, 4, 5)]
    assert sim.num_tokens["a"] - sim.num_prompt_tokens["a"] == 6


def test_unknown_token_rule_names_the_field():
    with pytest.raises(ValueError, match="token_rule"):
        SimExecutor(token_rule="random")


def test_request_token_salt_follows_the_sampling_mode():
    from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415
    from servetwin.sim.executor import request_token_salt  # noqa: PLC0415
    greedy, seeded, rand = SamplingParams(temperature=0), SamplingParams(seed=3), SamplingParams()
    assert request_token_salt("x", [1, 2], greedy) == request_token_salt("y", [1, 2], greedy)
    assert request_token_salt("x", [1, 2], greedy) != request_token_salt("x", [1, 3], greedy)
    assert request_token_salt("x", [1, 2], seeded) == request_token_salt("y", [1, 2], SamplingParams(seed=3))
    assert request_token_salt("x", [1, 2], seeded) != request_token_salt("x", [1, 2], SamplingParams(seed=4))
    assert request_token_salt("x", [1, 2], rand) != request_token_salt("y", [1, 2], rand)
    # the definition the fake tokens (and every recorded sim trace) rest on: CRC-32 of the prompt as int64s
    import zlib  # noqa: PLC0415
    from array import array  # noqa: PLC0415
    prompt = [1, 2, 300, 2**40, 0]
    assert request_token_salt("x", prompt, greedy) == zlib.crc32(array("q", prompt).tobytes())
    assert request_token_salt("x", prompt, seeded) == zlib.crc32(array("q", prompt).tobytes() + b"3")


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2**40), max_size=6), min_size=1, max_size=3),
       sends=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 9), max_size=3),
                                st.sampled_from([0.0, 1.0]), st.sampled_from([None, 3, 40])), min_size=1, max_size=8),
       max_tokens=st.sampled_from([0, 8, 1 << 20]))
def test_request_token_salt_of_a_resent_prompt_is_computed_afresh(prompts, sends, max_tokens):
    """The salt of a prompt list sent again (from the memo of prompt CRCs) == the definition, whatever was
    sent before (lists grown in place, a memo that is full)."""
    import zlib  # noqa: PLC0415
    from array import array  # noqa: PLC0415

    from servetwin.core.prompt_memo import PromptMemo  # noqa: PLC0415
    from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415
    from servetwin.sim import executor  # noqa: PLC0415
    memo = PromptMemo(max_tokens=max_tokens)  # 0 / 8: full at once / soon
    for i, (p, grow, temperature, seed) in enumerate(sends):
        prompt = prompts[p % len(prompts)]
        prompt.extend(grow)
        params = SamplingParams(temperature=temperature, seed=seed)
        want = (zlib.crc32(array("q", prompt).tobytes()) if temperature == 0.0
                else zlib.crc32(array("q", prompt).tobytes() + str(seed).encode()) if seed is not None
                else zlib.crc32(f"r{i}".encode()))
        assert executor.request_token_salt(f"r{i}", prompt, params, memo) == want
        assert executor.request_token_salt(f"r{i}", tuple(prompt), params, memo) == want  # (no list: no memo)
        assert executor.request_token_salt(f"r{i}", prompt, params) == want  # (no memo)


def test_request_rule_tokens_stay_inside_a_small_vocabulary():
    sim = SimExecutor(model="tiny-llama")  # vocabulary of 320 ids
    toks = [t for so in _outputs() for row in sim.execute_model(so).sampled_token_ids for t in row]
    toks += sim.lazy_tokens("a", 400)
    assert toks and all(10 <= t < 320 for t in toks)


@pytest.mark.parametrize("modulus", [1000, 310, 70, 1])
def test_implicit_token_slices_equal_the_request_rule(modulus):
    """`lazy_tokens` reads the rule's cycle as a list slice; with 7 not invertible (modulus 70) it
    computes each token. Both equal `request_token` for every start and length."""
    from servetwin.sim.executor import request_token  # noqa: PLC0415

    ex = SimExecutor(model="tiny-llama")
    ex.token_modulus = modulus
    ex._inv7 = pow(7, -1, modulus) if modulus % 7 else None
    ex._cycle = []
    for salt in (0, 3, 999_999_937):
        for k0 in (0, 1, 17, 2500):
            for n in (0, 1, 16, 1500):
                assert ex._request_tokens(salt, k0, n) == [request_token(salt, k, modulus)
                                                           for k in range(k0, k0 + n)]
