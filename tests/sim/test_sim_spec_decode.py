"""The simulator's speculative decoding: drafts from `SimDrafter`, acceptance from the acceptance model,
verify rows priced as decode rows, and the decode shortcuts (lazy decodes, fast-forward) off."""
from __future__ import annotations

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.sim.engine import simulate_workload
from servetwin.sim.spec_acceptance import DEFAULT_ACCEPTANCE

ENGINE = dict(backend="sim", model="tiny-llama", hardware="cpu", num_gpu_blocks=2048, max_model_len=512,
              max_num_batched_tokens=512, max_num_seqs=32, block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def run_engine(num_requests: int = 32, max_tokens: int = 40):
    engine, _ = create_engine_core(EngineArgs.from_kwargs(**ENGINE))
    for i in range(num_requests):
        engine.add_request(Request(f"r{i}", list(range(10 + i, 30 + i)),
                                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    steps, outputs = [], {}
    while engine.has_work():
        result = engine.step()
        steps.append((result.scheduled, engine.executor.last_summary))
        for o in result.outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return engine, steps, outputs


def test_acceptance_follows_the_default_model_and_outputs_stay_whole():
    engine, steps, outputs = run_engine()
    assert all(len(t) == 40 for t in outputs.values()) and len(outputs) == 32
    totals = engine.spec_decoding_totals
    model = DEFAULT_ACCEPTANCE["ngram"]
    per_draft = totals.num_accepted_tokens / totals.num_drafts
    # drafts cut below k near max_tokens are rare: the mean accepted count is close to the model's for k
    assert abs(per_draft - model.expected_accepted(3)) < 0.15, per_draft
    pos = totals.num_accepted_tokens_per_pos
    assert abs(pos[0] / totals.num_drafts - model.prob_at_least(1)) < 0.1


def test_verify_rows_are_priced_as_decode_rows():
    _, steps, _ = run_engine(num_requests=4, max_tokens=12)
    verify = [(so, summary) for so, summary in steps if so is not None and so.scheduled_spec_decode_tokens
              and not so.scheduled_new_reqs]
    assert verify
    for so, summary in verify:
        assert summary.prefill_reqs == 0  # a 1 + m token verify row is not a prefill chunk
        assert summary.decode_reqs == so.total_num_scheduled_tokens


def test_simulation_switches_its_decode_shortcuts_off_with_speculation():
    workload = {"requests": 16, "arrival": {"type": "offline"}, "prompt_tokens": 32, "output_tokens": 24}
    result = simulate_workload(dict(ENGINE), workload, record_step_requests=False)  # lazy decodes would be on
    plain = simulate_workload(dict(ENGINE, speculative_config=None), workload, record_step_requests=False)
    assert len(result.completion_s) == len(plain.completion_s) == 16 and not result.unfinished
    # accepted drafts (0.875 a step on average with k = 3) leave fewer steps than one token a step
    assert result.num_steps < 0.75 * plain.num_steps


def test_user_set_acceptance_rates_drive_the_draws():
    def accepted(rates):
        engine, _ = create_engine_core(EngineArgs.from_kwargs(**ENGINE, spec_acceptance_rates=rates))
        for i in range(8):
            engine.add_request(Request(f"r{i}", list(range(10, 30)), SamplingParams(max_tokens=20, ignore_eos=True)))
        while engine.has_work():
            engine.step()
        return engine.spec_decoding_totals

    everything, nothing = accepted([1.0]), accepted("0.0")
    assert everything.num_accepted_tokens == everything.num_draft_tokens > 0  # no cut drafts: k=3 fits
    assert nothing.num_accepted_tokens == 0 and nothing.num_drafts > everything.num_drafts
    with pytest.raises(ConfigError) as e:
        EngineArgs.from_kwargs(**ENGINE, spec_acceptance_rates=[0.5, 1.5])
    assert e.value.path == "spec_acceptance_rates[1]"


def test_eagle_under_async_scheduling_verifies_the_placeholder_drafts():
    """Async scheduling: the scheduler holds -1 placeholders (the worker keeps the real drafts); the
    simulated worker verifies them, and every request still gets exactly its max_tokens."""
    engine, _ = create_engine_core(EngineArgs.from_kwargs(**dict(
        ENGINE, async_scheduling=True, speculative_config={"method": "eagle", "num_speculative_tokens": 3})))
    for i in range(8):
        engine.add_request(Request(f"r{i}", list(range(10, 40 + i)), SamplingParams(max_tokens=20, ignore_eos=True)))
    tokens: dict[str, int] = {}
    while engine.has_work():
        for o in engine.step().outputs:
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
    assert tokens == {f"r{i}": 20 for i in range(8)}
    st = engine.spec_decoding_totals
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens == 3 * st.num_drafts
