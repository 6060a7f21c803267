"""`SimExecutor`: executes a `SchedulerOutput` with fake tokens and a predicted step duration.

Tokens follow `core.executor.FakeExecutor`'s rule (row r of step k samples `(7k + r) % 1000 + 10`),
so a simulated run produces the same tokens as the recorded oracle. A request never samples EOS
(a fake token that happens to equal `eos_token_id` is moved to the next id) unless its forced output
length is reached: with `output_lengths[request_id] = n`, the n-th output token is `eos_token_id`
(the scheduler then stops it, provided its sampling params carry that EOS id). Otherwise requests
finish by `max_tokens`. The timing is `CostModel.predict` of the step's rows (0 s for an empty
`SchedulerOutput`, which vLLM's runner returns at once); the host clock is never read.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from core.outputs import ModelRunnerOutput, SchedulerOutput, StepTiming
from sim.cost_model import CostModel, StepSummary
from sim.hardware import HardwareSpec
from sim.model_spec import ModelSpec


def fake_token(step: int, row: int) -> int:
    """The oracle's deterministic token rule (same as `core.executor.FakeExecutor`)."""
    return (step * 7 + row) % 1000 + 10


class SimExecutor:
    def __init__(self, model: ModelSpec | str = "tiny-llama", hardware: HardwareSpec | str = "cpu",
                 tp: int = 1, cuda_graphs: Optional[bool] = None,
                 graph_sizes: Optional[Sequence[int]] = None, ipc: bool = False,
                 eos_token_id: Optional[int] = None,
                 output_lengths: Optional[Mapping[str, int]] = None,
                 cost_model: Optional[CostModel] = None) -> None:
        self.cost_model = cost_model or CostModel(model, hardware, tp=tp, cuda_graphs=cuda_graphs,
                                                  graph_sizes=graph_sizes, ipc=ipc)
        self.num_tokens: dict[str, int] = {}  # prompt + sampled tokens, as the runner knows them
        self.num_prompt_tokens: dict[str, int] = {}
        self.eos_token_id = eos_token_id
        self.output_lengths: dict[str, int] = {}
        for rid, n in (output_lengths or {}).items():
            self.set_output_length(rid, n)
        self.last_summary: Optional[StepSummary] = None

    def set_output_length(self, request_id: str, n: int) -> None:
        """Force EOS as the `n`-th output token of `request_id`."""
        if self.eos_token_id is None:
            raise ValueError("output_lengths: forcing EOS needs eos_token_id")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"output_lengths[{request_id!r}]: must be an integer >= 1, got {n!r}")
        self.output_lengths[request_id] = n

    def _update_token_counts(self, so: SchedulerOutput) -> None:
        """The runner's view of each request's known tokens (prompt + sampled), from the output."""
        counts, prompts = self.num_tokens, self.num_prompt_tokens
        for rid in so.finished_req_ids:
            counts.pop(rid, None)
            prompts.pop(rid, None)
            self.output_lengths.pop(rid, None)
        for new in so.scheduled_new_reqs:
            counts[new.req_id] = prompts[new.req_id] = len(new.prompt_token_ids)
        cached = so.scheduled_cached_reqs
        for rid in cached.resumed_req_ids:
            counts[rid] = len(cached.all_token_ids[rid])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        self._update_token_counts(so)
        counts = self.num_tokens
        before = so.num_computed_before
        forced_lengths = self.output_lengths or None
        eos = self.eos_token_id
        base = so.step * 7
        sampled: list[list[int]] = []
        append = sampled.append
        p_reqs = p_q = p_q2 = p_qs = p_kv = d_reqs = d_s = num_sampling = 0
        r = -1
        for rid, q in so.num_scheduled_tokens.items():  # one pass: tokens and the step's sums
            r += 1
            s = before[rid]
            if q == 1:
                d_reqs += 1
                d_s += s
            else:
                p_reqs += 1
                p_q += q
                p_q2 += q * q
                p_qs += q * s
                p_kv += s + q
            n_tok = counts[rid]
            if s + q < n_tok:  # a partial prefill samples nothing
                append([])
                continue
            num_sampling += 1
            forced = forced_lengths.get(rid) if forced_lengths is not None else None
            if forced is not None and n_tok - self.num_prompt_tokens[rid] + 1 >= forced:
                tok = eos
            else:
                tok = (base + r) % 1000 + 10  # fake_token(step, r)
                if tok == eos:
                    tok += 1
            append([tok])
            counts[rid] = n_tok + 1
        summary = StepSummary(num_reqs=r + 1, num_tokens=p_q + d_reqs, num_sampling=num_sampling,
                              prefill_reqs=p_reqs, prefill_sum_q=p_q, prefill_sum_q2=p_q2,
                              prefill_sum_q_s=p_qs, prefill_sum_kv=p_kv, decode_reqs=d_reqs,
                              decode_sum_kv=d_s + d_reqs)
        self.last_summary = summary
        if so.total_num_scheduled_tokens == 0:
            timing = StepTiming(duration_s=0.0)  # vLLM's runner returns at once: nothing runs
        else:
            timing = self.cost_model.predict(summary)
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index=dict(zip(ids, range(len(ids)))),
                                 sampled_token_ids=sampled, timing=timing)

    # -- exact fast-forward of steady decode steps -----------------------------------------------
    def eos_free_steps(self, req_ids: Sequence[str], limit: int) -> int:
        """Steps (<= limit) in which none of `req_ids` can sample a forced EOS."""
        if not self.output_lengths:
            return limit
        k = limit
        for rid in req_ids:
            forced = self.output_lengths.get(rid)
            if forced is not None:
                outputs = self.num_tokens[rid] - self.num_prompt_tokens[rid]
                k = min(k, forced - outputs - 1)  # the forced EOS is output number `forced`
        return max(k, 0)

    def fast_forward(self, req_ids: Sequence[str], first_step: int, k: int) -> list[list[int]]:
        """Tokens of `k` decode steps starting at engine step `first_step` (row = position in
        `req_ids`), counted in the runner view exactly as `execute_model` would."""
        eos = self.eos_token_id
        out = []
        counts = self.num_tokens
        for row, rid in enumerate(req_ids):
            toks = [((first_step + j) * 7 + row) % 1000 + 10 for j in range(k)]
            if eos is not None and eos in toks:
                toks = [t + 1 if t == eos else t for t in toks]
            counts[rid] += k
            out.append(toks)
        return out

    def decode_step_durations(self, num_reqs: int, sum_kv_before: int, k: int) -> list[float]:
        """Predicted durations of `k` pure-decode steps of `num_reqs` rows whose computed tokens sum to
        `sum_kv_before` at the first step (each step adds `num_reqs`)."""
        predict = self.cost_model.predict
        return [predict(StepSummary(num_reqs=num_reqs, num_tokens=num_reqs, num_sampling=num_reqs,
                                    decode_reqs=num_reqs,
                                    decode_sum_kv=sum_kv_before + num_reqs * (j + 1))).duration_s
                for j in range(k)]
