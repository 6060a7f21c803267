"""`RequestOutputKind`: DELTA outputs (merged or not, as a slow consumer's collector merges them) add up
to the CUMULATIVE output, and FINAL_ONLY gives exactly the final cumulative output, for any token stream,
sample count, stop string and logprobs setting."""
from __future__ import annotations

import copy

from hypothesis import given, settings, strategies as st

from servetwin.core.engine.output_processor import OutputProcessor
from servetwin.core.engine.parallel_sampling import fan_out
from servetwin.core.engine.toy_tokenizer import ToyTokenizer
from servetwin.core.outputs import EngineCoreOutput, Logprobs
from servetwin.core.sampling_params import RequestOutputKind, SamplingParams

TOK = ToyTokenizer(64)


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 3))
    stop = draw(st.sampled_from([None, [" 7 8"], [" 3"]]))
    logprobs = draw(st.sampled_from([None, 1]))
    # per step: which samples get a token (each step touches at least one unfinished sample)
    steps = draw(st.lists(st.lists(st.integers(0, 63), min_size=n, max_size=n), min_size=1, max_size=25))
    merge = draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    return n, stop, logprobs, steps, merge


def run(kind, n, stop, logprobs, steps):
    params = SamplingParams(n=n, max_tokens=len(steps), stop=stop, logprobs=logprobs, output_kind=kind)
    op = OutputProcessor(TOK)
    children = fan_out("r", params)
    op.add_request("r", None, [1, 2], children)
    delivered, progress = [], []
    for i, tokens in enumerate(steps):
        last = i == len(steps) - 1
        outs = [EngineCoreOutput(cid, [tokens[j]], finish_reason=1 if last else None,
                                 new_logprobs=[Logprobs([tokens[j]], [-0.5], 1)] if logprobs else None)
                for j, (cid, _) in enumerate(children) if cid in op.children]
        results, _ = op.process_outputs(outs, observe=lambda *a: progress.append(a[1:3]))
        delivered += results
    return delivered, progress


def _view(out):
    return sorted((c.index, c.text, list(c.token_ids), c.logprobs, c.finish_reason, c.stop_reason)
                  for c in out.outputs)


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_deltas_add_up_to_the_cumulative_output_and_final_only_is_the_last(case):
    n, stop, logprobs, steps, merge = case
    cumulative, progress = run(RequestOutputKind.CUMULATIVE, n, stop, logprobs, steps)
    deltas, delta_progress = run(RequestOutputKind.DELTA, n, stop, logprobs, steps)
    finals, final_progress = run(RequestOutputKind.FINAL_ONLY, n, stop, logprobs, steps)
    assert cumulative[-1].finished and deltas[-1].finished
    # the metrics see every step whatever is delivered
    assert progress == delta_progress == final_progress
    # FINAL_ONLY: one output, the final cumulative one
    assert len(finals) == 1 and _view(finals[0]) == _view(cumulative[-1])
    # DELTA: merged in any grouping (a consumer taking some outputs late), they add up to the whole
    taken, pending = [], None
    for out, late in zip(deltas, merge + [False] * len(deltas)):
        if pending is None:
            pending = copy.deepcopy(out)
        else:
            pending.add(copy.deepcopy(out))
        if not late or out.finished:
            taken.append(pending)
            pending = None
    whole = copy.deepcopy(taken[0])
    for out in taken[1:]:
        whole.add(out)
    assert whole.finished and _view(whole) == _view(cumulative[-1])
    # a delta never repeats a finish and never carries a sample with nothing new
    for out in deltas:
        for c in out.outputs:
            assert c.text or c.token_ids or c.finish_reason is not None
    assert sum(c.finish_reason is not None for out in deltas for c in out.outputs) == n
