"""Logits processors (gpu/logits_processors.py) and their use by the sampler."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.sampling_params import SamplingParams
from servetwin.gpu.logits_processors import (AdapterLogitsProcessor, BatchUpdate, LogitBiasLogitsProcessor, LogitsProcessor, LogitsProcessors, MinTokensLogitsProcessor, MoveDirectionality, build_batch_update, build_logitsprocs)
from servetwin.gpu.sampler import Sampler
from servetwin.gpu.sampling_metadata import SamplingMetadata

NEG_INF = float("-inf")


def bias(token: int, value: float) -> SamplingParams:
    return SamplingParams(extra_args={"logit_bias": {token: value}})


def applied(proc: LogitsProcessor, num_reqs: int, vocab: int = 6) -> torch.Tensor:
    return proc.apply(torch.zeros(num_reqs, vocab))


# -- BatchUpdate bookkeeping ------------------------------------------------------------------------

def test_added_removed_moved_and_swapped_rows():
    proc = LogitBiasLogitsProcessor(vocab_size=6)
    proc.update_state(BatchUpdate(batch_size=3, added=[(0, bias(0, 1.0), [], []), (1, bias(1, 2.0), [], []),
                                                       (2, bias(2, 3.0), [], [])]))
    assert applied(proc, 3)[[0, 1, 2], [0, 1, 2]].tolist() == [1.0, 2.0, 3.0]
    # remove row 0, move 2 -> 0 (the persistent batch condenses), batch shrinks to 2
    proc.update_state(BatchUpdate(batch_size=2, removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    out = applied(proc, 2)
    assert out[0].tolist() == [0, 0, 3.0, 0, 0, 0] and out[1].tolist() == [0, 2.0, 0, 0, 0, 0]
    proc.update_state(BatchUpdate(batch_size=2, moved=[(0, 1, MoveDirectionality.SWAP)]))
    out = applied(proc, 2)
    assert out[1, 2] == 3.0 and out[0, 1] == 2.0 and out.abs().sum() == 5.0
    # re-adding an index with params that need no bias clears it
    proc.update_state(BatchUpdate(batch_size=2, added=[(0, SamplingParams(), [], [])]))
    assert applied(proc, 2)[0].abs().sum() == 0 and applied(proc, 2)[1, 2] == 3.0


def test_rows_past_batch_size_are_dropped():
    proc = LogitBiasLogitsProcessor()
    proc.update_state(BatchUpdate.from_batch([bias(1, 1.0)] * 3, [[]] * 3, [[]] * 3))
    proc.update_state(BatchUpdate.from_batch([bias(1, 1.0)] * 2, [[]] * 2, [[]] * 2))
    assert set(proc.biases) == {0, 1}
    assert applied(proc, 2)[:, 1].tolist() == [1.0, 1.0]


def test_build_batch_update_diff():
    a, b, c = bias(0, 1.0), bias(1, 1.0), bias(2, 1.0)
    assert build_batch_update(["x", "y"], ["x", "y"], [a, b], [[], []], [[], []]) is None
    upd = build_batch_update(["x", "y", "z"], ["y", "x"], [b, a], [[], []], [[], []])
    assert upd.batch_size == 2 and list(upd.removed) == [2] and [i for i, *_ in upd.added] == [0, 1]
    upd = build_batch_update(["x"], ["x", "z"], [a, c], [[], []], [[], []])
    assert [i for i, *_ in upd.added] == [1] and list(upd.removed) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from("abcdef"), unique=True, max_size=6), min_size=1, max_size=6))
def test_diffed_updates_match_a_fresh_processor(batches):
    """Feeding step-to-step diffs gives the same logits as rebuilding from scratch each step."""
    token_of = {r: i for i, r in enumerate("abcdef")}
    params_of = {r: bias(token_of[r], float(token_of[r] + 1)) for r in "abcdef"}
    persistent = LogitBiasLogitsProcessor(vocab_size=6)
    prev: list[str] = []
    for ids in batches:
        params = [params_of[r] for r in ids]
        empty = [[] for _ in ids]
        persistent.update_state(build_batch_update(prev, ids, params, empty, empty))
        fresh = LogitBiasLogitsProcessor(vocab_size=6)
        fresh.update_state(BatchUpdate.from_batch(params, empty, empty))
        assert torch.equal(applied(persistent, len(ids)), applied(fresh, len(ids)))
        prev = ids


# -- built-ins --------------------------------------------------------------------------------------

def test_min_tokens_follows_the_live_output_list():
    params = SamplingParams(min_tokens=2, stop_token_ids=[4])
    params.update_from_generation_config([1, 5])  # EOS 1, extra stop id 5
    output: list[int] = []
    proc = MinTokensLogitsProcessor(vocab_size=6)
    proc.update_state(BatchUpdate(batch_size=2, added=[(1, params, [0], output)]))
    out = applied(proc, 2)
    assert out[1].tolist() == [0, NEG_INF, 0, 0, NEG_INF, NEG_INF] and out[0].abs().sum() == 0
    output.append(3)
    proc.update_state(None)
    assert (applied(proc, 2)[1, [1, 4, 5]] == NEG_INF).all()
    output.append(3)
    proc.update_state(None)  # min_tokens reached: no more masking
    assert applied(proc, 2).abs().sum() == 0


def test_min_tokens_inactive_when_satisfied_or_zero():
    proc = MinTokensLogitsProcessor()
    proc.update_state(BatchUpdate(batch_size=2, added=[
        (0, SamplingParams(min_tokens=1, stop_token_ids=[2]), [], [7]),
        (1, SamplingParams(stop_token_ids=[2]), [], [])]))
    assert proc.min_toks == {}
    assert applied(proc, 2).abs().sum() == 0


def test_logit_bias_parsing_and_validation():
    proc = LogitBiasLogitsProcessor(vocab_size=4)
    params = SamplingParams(extra_args={"logit_bias": {"2": -1.5, 3: 2}})
    proc.update_state(BatchUpdate(batch_size=1, added=[(0, params, [], [])]))
    assert applied(proc, 1, vocab=4).tolist() == [[0.0, 0.0, -1.5, 2.0]]
    with pytest.raises(ValueError, match="logit_bias"):
        proc.update_state(BatchUpdate(batch_size=1, added=[(0, bias(9, 1.0), [], [])]))
    with pytest.raises(ValueError, match="logit_bias"):
        proc.update_state(BatchUpdate(batch_size=1, added=[
            (0, SamplingParams(extra_args={"logit_bias": {"x": 1.0}}), [], [])]))


def test_adapter_runs_callables_in_order_with_token_ids():
    calls = []

    def two_args(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        calls.append(("two", list(output_ids)))
        row[output_ids] = NEG_INF  # in place: ban what was already generated
        return row

    def three_args(prompt_ids: list[int], output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        calls.append(("three", list(prompt_ids), list(output_ids)))
        return row + 10.0  # out of place

    output = [2]
    params = SamplingParams(logits_processors=[two_args, three_args])
    proc = AdapterLogitsProcessor()
    proc.update_state(BatchUpdate(batch_size=2, added=[(1, params, [0, 1], output)]))
    out = applied(proc, 2, vocab=4)
    assert out[0].tolist() == [0.0] * 4
    assert out[1].tolist() == [10.0, 10.0, NEG_INF, 10.0]
    output.append(3)
    out = applied(proc, 2, vocab=4)
    assert out[1].tolist() == [10.0, 10.0, NEG_INF, NEG_INF]
    assert calls == [("two", [2]), ("three", [0, 1], [2]), ("two", [2, 3]), ("three", [0, 1], [2, 3])]


# -- with the sampler -------------------------------------------------------------------------------

class CountingArgmaxInvariant(LogitsProcessor):
    """Argmax-invariant custom processor: adds a constant (logged so the test sees the calls)."""

    def __init__(self, device="cpu", vocab_size: Optional[int] = None) -> None:
        super().__init__(device, vocab_size)
        self.calls = 0

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return logits + 1.0

    def is_argmax_invariant(self) -> bool:
        return True


def test_processor_groups_and_greedy_skip_of_argmax_invariant_ones():
    procs = build_logitsprocs(vocab_size=5, custom=[CountingArgmaxInvariant])
    custom = procs.argmax_invariant[0]
    assert [type(p) for p in procs.non_argmax_invariant] == [
        MinTokensLogitsProcessor, LogitBiasLogitsProcessor, AdapterLogitsProcessor]
    greedy = [SamplingParams(temperature=0.0)]
    procs.update_state(BatchUpdate.from_batch(greedy, [[0]], [[]]))
    md = SamplingMetadata.from_requests(greedy, [[]], [[0]], {}, 5, logitsprocs=procs)
    Sampler()(torch.randn(1, 5), md)
    assert custom.calls == 0  # all-greedy batch never reaches argmax-invariant processors
    rand = [SamplingParams(temperature=1.0)]
    md = SamplingMetadata.from_requests(rand, [[]], [[0]], {}, 5, logitsprocs=procs)
    Sampler()(torch.randn(1, 5), md)
    assert custom.calls == 1


def test_persistent_processors_across_steps_match_rebuilt_ones():
    """An executor keeping processors across steps (diff updates) samples like a stateless one."""
    vocab = 8
    ban_even = lambda out, row: row.index_fill_(0, torch.arange(0, vocab, 2), NEG_INF)  # noqa: E731
    params_of = {
        "a": SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),
        "b": SamplingParams(temperature=0.0, extra_args={"logit_bias": {3: 200.0}}),
        "c": SamplingParams(temperature=0.0, logits_processors=[ban_even]),
    }
    outputs = {r: [] for r in params_of}
    persistent = build_logitsprocs(vocab_size=vocab)
    prev: list[str] = []
    torch.manual_seed(8)
    for ids in (["a", "b"], ["b", "a", "c"], ["c", "a"], ["a"]):
        params = [params_of[r] for r in ids]
        prompts = [[0] for _ in ids]
        outs = [outputs[r] for r in ids]
        persistent.update_state(build_batch_update(prev, ids, params, prompts, outs))
        logits = torch.randn(len(ids), vocab)
        logits[:, 7] = 100.0  # the stop token would win without min_tokens
        md_p = SamplingMetadata.from_requests(params, outs, prompts, {}, vocab, logitsprocs=persistent)
        md_f = SamplingMetadata.from_requests(params, outs, prompts, {}, vocab)
        tok_p = Sampler()(logits, md_p).sampled_token_ids.tolist()
        tok_f = Sampler()(logits, md_f).sampled_token_ids.tolist()
        assert tok_p == tok_f
        for r, tok in zip(ids, tok_p):
            if r == "a":
                assert (tok == 7) == (len(outputs["a"]) >= 2)
            if r == "b":
                assert tok == 3
            outputs[r].append(tok)
        prev = ids


def test_logits_processors_container_update_reaches_all():
    seen = []

    class Recorder(CountingArgmaxInvariant):
        def update_state(self, batch_update):
            seen.append(batch_update)

    procs = LogitsProcessors([Recorder(), MinTokensLogitsProcessor()])
    assert len(procs.argmax_invariant) == 1 and len(procs.non_argmax_invariant) == 1
    upd = BatchUpdate(batch_size=0)
    procs.update_state(upd)
    procs.update_state(None)
    assert seen == [upd, None]
