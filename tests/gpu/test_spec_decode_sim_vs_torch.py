"""Sim vs torch with speculative decoding: the same workload on tiny-llama (CPU) and on the simulator,
the simulator replaying the torch run's acceptance pattern (accepted counts and proposal lengths per
request, `SpecReplay`), schedules every step identically: scheduled tokens, spec tokens and accepted
counts, step by step. (A test of both backends, so it lives with the torch tests; sim never imports
torch.)"""
from __future__ import annotations

import random

import pytest

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.engine_factory import create_executor
from servetwin.core.sched.scheduler import Scheduler
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.sim.spec_drafter import SimDrafter, SpecReplay

ENGINE = dict(model="tiny-llama", device="cpu", dtype="float32", num_gpu_blocks=128, max_model_len=96,
              max_num_batched_tokens=48, max_num_seqs=6, block_size=8, enable_prefix_caching=False)
# n-gram: few, partly accepted drafts; the target as its own draft model: k drafts a step, nearly all accepted
# (the step budget of 48 cuts drafts of full batches)
CONFIGS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
           "draft_model": {"method": "draft_model", "num_speculative_tokens": 4, "model": "tiny-llama"}}


def requests() -> list[Request]:
    rng = random.Random(1)
    out = []
    for i in range(12):
        phrase = [rng.randrange(3, 300) for _ in range(2 + i % 3)]
        n = 6 + (i * 5) % 23
        out.append(Request(f"r{i}", (phrase * n)[:n], SamplingParams(max_tokens=6 + i % 7, temperature=0.0,
                                                                     ignore_eos=True)))
    return out


class Recorder:
    """The executor, with every proposal's length recorded per request (what `SpecReplay` replays)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.scheduler_cls = getattr(inner, "scheduler_cls", Scheduler)
        self.draft_lengths: dict[str, list[int]] = {}

    def execute_model(self, so):
        out = self.inner.execute_model(so)
        self.sampled = {rid for rid, toks in zip(out.req_ids, out.sampled_token_ids) if toks}
        return out

    def take_draft_token_ids(self):
        drafts = self.inner.take_draft_token_ids()
        for rid, d in zip(drafts.req_ids, drafts.draft_token_ids):
            if rid in self.sampled:  # the drafters propose for the rows that sampled
                self.draft_lengths.setdefault(rid, []).append(len(d))
        return drafts


def run(backend: str, spec: dict, replay: SpecReplay | None = None) -> tuple[list[tuple], SpecReplay]:
    """Every step's (scheduled tokens, spec token counts, accepted counts), and the acceptance pattern."""
    args = EngineArgs.from_kwargs(backend=backend, speculative_config=spec, **ENGINE)
    info = create_executor(args)
    if replay is not None:
        info.executor.enable_spec_decode(SimDrafter(args.speculative_config, replay=replay))
    ex = Recorder(info.executor)
    engine = EngineCore(args.scheduler_config(info.max_model_len), args.cache_config(info.num_gpu_blocks),
                        ex, speculative_config=args.speculative_config)
    for r in requests():
        engine.add_request(r)
    steps, pattern = [], SpecReplay(draft_lengths=ex.draft_lengths)
    while engine.has_work():
        result = engine.step()
        so, mro = result.scheduled, result.model_output
        accepted = {}
        for rid in so.scheduled_spec_decode_tokens:
            toks = mro.sampled_token_ids[mro.req_id_to_index[rid]]
            accepted[rid] = len(toks) - 1
            pattern.accepted.setdefault(rid, []).append(len(toks) - 1)
        steps.append((dict(so.num_scheduled_tokens),
                      {k: len(v) for k, v in so.scheduled_spec_decode_tokens.items()}, accepted))
    return steps, pattern


@pytest.mark.parametrize("method", list(CONFIGS))
def test_sim_replays_the_torch_runs_steps(method):
    torch_steps, pattern = run("torch", CONFIGS[method])
    assert sum(sum(a.values()) for _, _, a in torch_steps) > 0  # drafts were accepted on the way
    sim_steps, _ = run("sim", CONFIGS[method], replay=pattern)
    assert len(sim_steps) == len(torch_steps)
    for i, (t, s) in enumerate(zip(torch_steps, sim_steps)):
        assert s == t, f"step {i}"
