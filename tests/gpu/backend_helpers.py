"""Shared helpers for the torch-backend tests: HF oracles and hand-built scheduler outputs."""
from __future__ import annotations

import os
import random
from typing import Optional, Sequence

import torch

from servetwin.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from servetwin.core.sampling_params import SamplingParams
from servetwin.gpu.executor import TorchExecutor
from servetwin.gpu.models.registry import resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

class HFOracle:
    """HF transformers' own forward of the same checkpoint (fp32, eager attention), memoised."""

    def __init__(self, path) -> None:
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                          attn_implementation="eager",
                                                          local_files_only=True).eval()
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def all_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits at every position `[len(tokens), vocab]`."""
        key = tuple(tokens)
        if key not in self._memo:
            self._memo[key] = self.model(torch.tensor([list(tokens)])).logits[0].float()
        return self._memo[key]

    def last_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        return self.all_logits(tokens)[-1]

    @torch.inference_mode()
    def generate_greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """n greedy tokens, EOS included when it is the argmax (what `ignore_eos` generates; HF
        `generate`'s min_new_tokens would mask EOS instead, and random weights do pick it)."""
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self.last_logits(seq).argmax()))
        return seq[len(prompt):]


def step(step_idx: int, new: Sequence[NewRequestData] = (), cached: Optional[CachedRequestData] = None,
         num_scheduled: Optional[dict[str, int]] = None, finished: Sequence[str] = (),
         preempted: Sequence[str] = ()) -> SchedulerOutput:
    """A hand-built SchedulerOutput (running rows first, then new ones, like the scheduler)."""
    cached = cached or CachedRequestData()
    num_scheduled = num_scheduled or {}
    return SchedulerOutput(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=dict(num_scheduled),
                           total_num_scheduled_tokens=sum(num_scheduled.values()),
                           finished_req_ids=set(finished), preempted_req_ids=set(preempted), step=step_idx)


# fp32 with rtol 1e-5: the largest |diff| seen is 1.9e-5 on logits of mean magnitude ~6.7 (reduction
# order noise), 0.57 of this tolerance
ATOL = 2e-5
_ORACLES: dict[str, HFOracle] = {}


def oracle(name: str) -> HFOracle:
    if name not in _ORACLES:
        _ORACLES[name] = HFOracle(resolve_model(name).path)
    return _ORACLES[name]


def make_executor(name: str, **kw) -> TorchExecutor:
    kw.setdefault("torch_paged_mode", "batched")  # the CPU default is "loop"; cover the batched groups
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("max_model_len", 512)
    return TorchExecutor(name, device="cpu", keep_logits=True, **kw)


def check_step_logits(ex: TorchExecutor, orc: HFOracle, so, out, atol: float = ATOL) -> int:
    """Compare every scheduled row's logits with HF; returns the number of rows checked."""
    for rid, n in so.num_scheduled_tokens.items():
        st = ex.state.requests[rid]
        sampled = out.sampled_token_ids[out.req_id_to_index[rid]]
        upto = st.num_computed_tokens  # after this step's advance
        prefix = st.token_ids[:upto]
        ref = orc.last_logits(prefix)
        torch.testing.assert_close(ex.last_logits[rid], ref, atol=atol, rtol=1e-5,
                                   msg=lambda m: f"step {so.step} request {rid}: {m}")
        if sampled:
            assert sampled == [int(ref.argmax())], f"step {so.step} {rid}: greedy token differs"
    return len(so.num_scheduled_tokens)


class TeeExecutor:
    """Each scheduler output on the reference and on a parallel executor (TP or PP workers); the engine
    goes on with the reference's output, and every step's tokens and logits are compared."""

    def __init__(self, ref: TorchExecutor, parallel, atol: float) -> None:
        self.ref, self.parallel, self.atol = ref, parallel, atol
        self.rows_compared = 0
        self.sampled = 0

    def execute_model(self, so: SchedulerOutput):
        want, got = self.ref.execute_model(so), self.parallel.execute_model(so)
        assert got.req_ids == want.req_ids
        assert got.sampled_token_ids == want.sampled_token_ids, f"step {so.step}"
        ref_logits, par_logits = self.ref.kept_logits(), self.parallel.collective_rpc("kept_logits")
        assert ref_logits.keys() == par_logits.keys()
        for rid, logits in ref_logits.items():
            torch.testing.assert_close(par_logits[rid], logits, rtol=1e-4, atol=self.atol,
                                       msg=lambda m: f"step {so.step}, {rid}: {m}")
        self.rows_compared += len(ref_logits)
        self.sampled += sum(len(t) for t in want.sampled_token_ids)
        return want


def random_prompts(n: int, vocab: int, max_len: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(3, vocab) for _ in range(rnd.randint(1, max_len))] for _ in range(n)]
