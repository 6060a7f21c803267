"""`SimExecutor`: executes a `SchedulerOutput` with fake tokens and a predicted step duration.

Token rules (`token_rule`):
- "request" (default): the k-th output token of a request is `(7k + salt) % M + 10` (M = 1000, less
  for a vocabulary under 1010 ids), the salt a function of the request alone (`request_token_salt`:
  the prompt when greedy, prompt and seed when seeded, else the request id) - so the tokens of steps
  the scheduler runs implicitly (`servetwin.sim.lazy_decode`) can be produced late, batch composition never
  changes them, and equal greedy prompts give equal outputs as with a real model;
- "oracle": `servetwin.core.engine.executor.FakeExecutor`'s rule (row r of step k samples `(7k + r) % 1000 + 10`), the
  tokens of the recorded vLLM oracle (no implicit decodes with this rule).
A request never samples EOS (a fake token that happens to equal `eos_token_id` is moved to the next
id) unless its forced output length is reached: with `output_lengths[request_id] = n`, the n-th
output token is `eos_token_id` (the scheduler then stops it, provided its sampling params carry that
EOS id). Otherwise requests finish by `max_tokens`. The timing is `CostModel.predict` of the step's
rows, implicit ones included (0 s for an empty `SchedulerOutput`, which vLLM's runner returns at
once); the host clock is never read.
"""
from __future__ import annotations

import dataclasses
import math
import struct
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from servetwin.core.outputs import ModelRunnerOutput, StepTiming
from servetwin.core.prompt_memo import PromptMemo
from servetwin.core.sched.output import ImplicitDecodes, SchedulerOutput
from servetwin.core.testbed.iteration import compute_iteration_details
from servetwin.sim.cost_model import CostModel, StepSummary
from servetwin.sim.hardware import HardwareSpec
from servetwin.sim.kv_transfer import SimKVWorker
from servetwin.sim.model_spec import ModelSpec
from servetwin.sim.pipeline import PipelineStages
from servetwin.sim.predicted_profile import PredictedProfile
from servetwin.sim.scheduler import SimScheduler
from servetwin.sim.spec_drafter import SimDrafter
from servetwin.core.sched.spec_decode import DraftTokenIds


TOKEN_RULES = ("request", "oracle")
GREEDY_TEMPERATURE = 1e-5  # servetwin.core.sampling_params: below this, sampling is greedy


def fake_token(step: int, row: int) -> int:
    """The oracle's deterministic token rule (same as `servetwin.core.engine.executor.FakeExecutor`)."""
    return (step * 7 + row) % 1000 + 10


def request_token_salt(request_id: str, prompt_token_ids: Optional[Sequence[int]] = None,
                       params: Any = None, memo: Optional[PromptMemo] = None) -> int:
    """What a request's fake tokens depend on, like a real model's: greedy decoding - the prompt
    (equal prompts give equal outputs, so their full output blocks hash equal); seeded sampling - the
    prompt and the seed (reproducible); otherwise the request id."""
    if params is not None and prompt_token_ids is not None:
        greedy = params.temperature < GREEDY_TEMPERATURE
        if greedy or params.seed is not None:
            prompt_crc = _prompt_crc(prompt_token_ids, memo)
            # (crc32(b, crc32(a)) == crc32(a + b): the seed's bytes continue the prompt's CRC)
            return prompt_crc if greedy else zlib.crc32(str(params.seed).encode(), prompt_crc)
    return zlib.crc32(request_id.encode())


def _prompt_crc(prompt_token_ids: Sequence[int], memo: Optional[PromptMemo]) -> int:
    """CRC-32 of the prompt's tokens as int64s' native bytes, as array("q", ...).tobytes() gave them
    (struct packs them 2x faster). (speed: with `memo`, a prompt sent again - the same list,
    servetwin.core.prompt_memo - is packed once, not at every request's first step)"""
    kept = memo is not None and type(prompt_token_ids) is list
    if kept:
        known = memo.get(prompt_token_ids)
        if known is not None:
            return known
    crc = zlib.crc32(struct.pack(f"={len(prompt_token_ids)}q", *prompt_token_ids))
    if kept:
        memo.put(prompt_token_ids, crc)
    return crc


def request_token(salt: int, k: int, modulus: int = 1000) -> int:
    """The "request" rule: the k-th output token (k from 0) of a request with this salt."""
    return (7 * k + salt) % modulus + 10


class SimExecutor:
    # The engine builds this scheduler: vLLM's plus the simulator's exact shortcuts (off until the
    # Simulation enables them), whose implicit decode rows only this executor runs.
    scheduler_cls = SimScheduler

    def __init__(self, model: ModelSpec | str = "tiny-llama", hardware: HardwareSpec | str = "cpu",
                 tp: int = 1, cuda_graphs: Optional[bool] = None,
                 graph_sizes: Optional[Sequence[int]] = None, ipc: bool = False,
                 eos_token_id: Optional[int] = None,
                 output_lengths: Optional[Mapping[str, int]] = None,
                 cost_model: Optional[CostModel] = None, token_rule: str = "request",
                 quantization: Optional[str] = None, kv_cache_dtype: str = "auto") -> None:
        if token_rule not in TOKEN_RULES:
            raise ValueError(f"token_rule: unknown rule {token_rule!r} (allowed: {', '.join(TOKEN_RULES)})")
        self.cost_model = cost_model or CostModel(model, hardware, tp=tp, cuda_graphs=cuda_graphs,
                                                  graph_sizes=graph_sizes, ipc=ipc, quantization=quantization,
                                                  kv_cache_dtype=kv_cache_dtype)
        self.token_rule = token_rule
        # the "request" rule's tokens stay inside the model's vocabulary: ids 10 .. 10 + modulus - 1
        self.token_modulus = max(1, min(1000, self.cost_model.model.vocab_size - 10))
        self._inv7 = pow(7, -1, self.token_modulus) if math.gcd(7, self.token_modulus) == 1 else None
        self._cycle: list[int] = []
        self.num_tokens: dict[str, int] = {}  # prompt + sampled tokens, as the runner knows them
        self.num_prompt_tokens: dict[str, int] = {}
        self.salts: dict[str, int] = {}  # the "request" rule's salt per request
        self.prompt_crcs = PromptMemo()  # (speed: `_prompt_crc`; a cluster's engines share one: `share_prompt_memo`)
        self.eos_token_id = eos_token_id
        self.output_lengths: dict[str, int] = {}
        for rid, n in (output_lengths or {}).items():
            self.set_output_length(rid, n)
        self.last_summary: Optional[StepSummary] = None
        self.profile: Optional[PredictedProfile] = None  # between start_profile and stop_profile
        self.profiles_written = 0
        self.profile_writer: Optional[threading.Thread] = None  # the last trace being written
        self.kv_pool: Any = None  # the KV pool it was sized with (sim/kv_pool.py:build_sim_executor)
        # pipeline parallelism: the stages whose times the simulation books per batch (sim/pipeline.py)
        self.pipeline: Optional[PipelineStages] = None
        self.drafter: Optional[SimDrafter] = None  # speculative decoding (enable_spec_decode)
        self.draft_token_ids: Optional[DraftTokenIds] = None  # the latest proposals, until taken
        self.kv_worker: Optional[SimKVWorker] = None  # a KV connector's worker side (enable_kv_transfer)

    def reset(self) -> None:
        """Forget every request (a new engine over this executor starts from an empty runner state)."""
        for table in (self.num_tokens, self.num_prompt_tokens, self.salts, self.output_lengths):
            table.clear()
        if self.pipeline is not None:
            self.pipeline.reset()

    def share_prompt_memo(self, memo: PromptMemo) -> None:
        """Keep the prompts' token-salt CRCs in `memo`, shared with other engines of the same simulation (a pure
        function of the prompt's tokens). Before any request."""
        self.prompt_crcs = memo

    def set_output_length(self, request_id: str, n: int) -> None:
        """Force EOS as the `n`-th output token of `request_id`."""
        if self.eos_token_id is None:
            raise ValueError("output_lengths: forcing EOS needs eos_token_id")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"output_lengths[{request_id!r}]: must be an integer >= 1, got {n!r}")
        self.output_lengths[request_id] = n

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """The runner state of these finished requests dropped (a step's `finished_req_ids`)."""
        counts, prompts, salts, lengths = self.num_tokens, self.num_prompt_tokens, self.salts, self.output_lengths
        for rid in request_ids:
            counts.pop(rid, None)
            prompts.pop(rid, None)
            salts.pop(rid, None)
            lengths.pop(rid, None)

    def _update_token_counts(self, so: SchedulerOutput) -> None:
        """The runner's view of each request's known tokens (prompt + sampled), from the output."""
        counts, prompts = self.num_tokens, self.num_prompt_tokens
        if so.finished_req_ids:
            self.forget_requests(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            counts[new.req_id] = prompts[new.req_id] = len(new.prompt_token_ids)
            self.salts[new.req_id] = request_token_salt(new.req_id, new.prompt_token_ids, new.sampling_params,
                                                        self.prompt_crcs)
        cached = so.scheduled_cached_reqs
        for rid in cached.resumed_req_ids:
            counts[rid] = len(cached.all_token_ids[rid])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        worker = self.kv_worker
        if worker is None:
            return self._execute_spec(so) if self.drafter is not None else self._execute(so)
        # vLLM's runner: start_load_kv before the forward pass, get_finished after it (sim/kv_transfer.py)
        worker.start(so.kv_connector_metadata, self.num_prompt_tokens)
        out = self._execute_spec(so) if self.drafter is not None else self._execute(so)
        timing = out.timing if out.timing is not None else StepTiming(duration_s=0.0)
        out.kv_connector_output, duration = worker.finish(so.kv_connector_metadata, timing.duration_s,
                                                          so.total_num_scheduled_tokens > 0)
        if duration != timing.duration_s:  # it waited for transfers
            out.timing = dataclasses.replace(timing, duration_s=duration)
        return out

    def enable_kv_transfer(self, worker: SimKVWorker) -> None:
        """Model a KV connector's transfers with `worker`; the simulator's decode shortcuts must be off
        (Simulation switches them off when the scheduler has a connector)."""
        self.kv_worker = worker

    def kv_transfer_totals(self) -> dict[str, int]:
        """The offloading connector's transfer counters under vLLM's names without `vllm:`
        (offloading/metrics.py:42-47: kv_offload_load_bytes, kv_offload_store_bytes: bytes of the
        jobs started); {} without an offloading connector."""
        worker = self.kv_worker
        if worker is None or not worker.offloading:
            return {}
        return {"kv_offload_load_bytes": worker.totals.bytes["load"],
                "kv_offload_store_bytes": worker.totals.bytes["store"]}

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_token_counts(so)
        counts = self.num_tokens
        before = so.num_computed_before
        forced_lengths = self.output_lengths or None
        eos = self.eos_token_id
        base = so.step * 7
        salts = self.salts if self.token_rule == "request" else None
        modulus = self.token_modulus
        prompts = self.num_prompt_tokens
        sampled: list[list[int]] = []
        append = sampled.append
        qs = list(so.num_scheduled_tokens.values())
        ss = [before[rid] for rid in so.num_scheduled_tokens]
        num_sampling = 0
        r = -1
        for rid, q in so.num_scheduled_tokens.items():
            r += 1
            s = ss[r]
            n_tok = counts[rid]
            if s + q < n_tok:  # a partial prefill samples nothing
                append([])
                continue
            num_sampling += 1
            forced = forced_lengths.get(rid) if forced_lengths is not None else None
            if forced is not None and n_tok - prompts[rid] + 1 >= forced:
                tok = eos
            else:
                if salts is not None:
                    tok = (7 * (n_tok - prompts[rid]) + salts[rid]) % modulus + 10  # request_token
                else:
                    tok = (base + r) % 1000 + 10  # fake_token(step, r)
                if tok == eos:
                    tok += 1
            append([tok])
            counts[rid] = n_tok + 1
        implicit = so.implicit_decodes  # unlisted decode rows (SimScheduler): one sampled token each
        summary = StepSummary.from_lists(qs, ss, num_sampling,
                                         implicit_decodes=implicit.num_reqs if implicit is not None else 0,
                                         implicit_sum_s=implicit.sum_computed_before if implicit is not None else 0,
                                         shared_kv=so.shared_kv_tokens)
        self.last_summary = summary
        if so.total_num_scheduled_tokens == 0:
            timing = StepTiming(duration_s=0.0)  # vLLM's runner returns at once: nothing runs
        else:
            timing = self.cost_model.predict(summary)
        ids = list(so.num_scheduled_tokens)
        if self.profile is not None and so.total_num_scheduled_tokens:
            self.profile.record(compute_iteration_details(so).annotation, timing.duration_s)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index=dict(zip(ids, range(len(ids)))),
                                 sampled_token_ids=sampled, timing=timing)

    # -- speculative decoding (sim/spec_drafter.py) ------------------------------------------------
    def enable_spec_decode(self, drafter: SimDrafter) -> None:
        """Draft and verify with `drafter`; the simulator's decode shortcuts must be off (Simulation
        switches them off when the scheduler drafts)."""
        self.drafter = drafter

    def take_draft_token_ids(self) -> Optional[DraftTokenIds]:
        drafts, self.draft_token_ids = self.draft_token_ids, None
        return drafts

    def _execute_spec(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """`execute_model` with drafts: a verifying row samples accepted + 1 tokens, and is priced as
        1 + m decode rows (vLLM runs a uniform (k + 1)-token decode batch: each query token attends
        the KV before it like a decode, not like a prefill chunk)."""
        self._update_token_counts(so)
        self.drafter.forget(so.finished_req_ids)
        qs: list[int] = []
        ss: list[int] = []
        sampled: list[list[int]] = []
        num_sampling = 0
        for r, (rid, q) in enumerate(so.num_scheduled_tokens.items()):
            s = so.num_computed_before[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                qs += [1] * q
                ss += range(s, s + q)
            else:
                qs.append(q)
                ss.append(s)
            if s + q - len(drafts or ()) < self.num_tokens[rid]:  # a partial prefill samples nothing
                sampled.append([])
                continue
            num_sampling += 1
            a = self.drafter.num_accepted(so, rid, len(drafts)) if drafts else 0
            sampled.append(self._next_tokens(rid, a + 1, so.step, r))
        summary = StepSummary.from_lists(qs, ss, num_sampling, shared_kv=so.shared_kv_tokens)
        self.last_summary = summary
        timing = self.cost_model.predict(summary) if so.total_num_scheduled_tokens else StepTiming(duration_s=0.0)
        ids = list(so.num_scheduled_tokens)
        self.draft_token_ids = DraftTokenIds(ids, [[10] * self.drafter.proposal_length(rid) if toks else []
                                                   for rid, toks in zip(ids, sampled)])
        return ModelRunnerOutput(req_ids=ids, req_id_to_index=dict(zip(ids, range(len(ids)))),
                                 sampled_token_ids=sampled, timing=timing)

    def _next_tokens(self, rid: str, n: int, step: int, row: int) -> list[int]:
        """The next `n` tokens of a row (the token rule, forced EOS and EOS avoidance as in
        `execute_model`), ending at a forced EOS."""
        out: list[int] = []
        eos = self.eos_token_id
        for _ in range(n):
            n_out = self.num_tokens[rid] - self.num_prompt_tokens[rid]
            forced = self.output_lengths.get(rid)
            if forced is not None and eos is not None and n_out + 1 >= forced:  # (forcing needs an EOS id)
                tok = eos
            else:
                tok = (request_token(self.salts[rid], n_out, self.token_modulus) if self.token_rule == "request"
                       else fake_token(step, row))
                tok += tok == self.eos_token_id
            out.append(tok)
            self.num_tokens[rid] += 1
            if tok == self.eos_token_id:
                break
        return out

    # -- vLLM's /start_profile and /stop_profile: the predicted steps as a profiler trace -------------
    def start_profile(self, profile_dir: str) -> None:
        if self.profile is None:
            self.profile = PredictedProfile(profile_dir, self.profiles_written)

    def stop_profile(self) -> Optional[str]:
        """Write the predicted steps since `start_profile` off the step loop (a thread); returns the
        trace's path (None: not on)."""
        if self.profile is None:
            return None
        (path, self.profile_writer), self.profile = self.profile.write_in_background(), None
        self.profiles_written += 1
        return str(path)

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

    # -- implicit steady decodes (servetwin.sim.lazy_decode.LazyTokenSource) ----------------------
    def lazy_eligible(self, request) -> bool:
        """Whether `request` may run implicitly: its tokens depend on it alone and it can only stop
        by length (no forced EOS, no stop token ids, no EOS id its tokens could hit)."""
        if self.token_rule != "request" or request.request_id in self.output_lengths:
            return False
        sp = request.sampling_params
        if sp.stop_token_ids:
            return False
        eos = sp._eos_token_id
        return eos is None or eos == self.eos_token_id or not 10 <= eos <= self.token_modulus + 10

    def lazy_tokens(self, request_id: str, n: int) -> list[int]:
        """The next `n` tokens of `request_id` (the "request" rule), counted in the runner view."""
        n_tok = self.num_tokens[request_id]
        k0 = n_tok - self.num_prompt_tokens[request_id]
        toks = self._request_tokens(self.salts[request_id], k0, n)
        eos = self.eos_token_id
        if eos is not None and eos in toks:
            toks = [t + 1 if t == eos else t for t in toks]
        self.num_tokens[request_id] = n_tok + n
        return toks

    def _request_tokens(self, salt: int, k0: int, n: int) -> list[int]:
        """`request_token(salt, k)` for k in [k0, k0 + n). With 7 invertible mod the modulus, the
        sequence is one cycle P[j] = 7j mod M + 10 entered at j0 = k0 + salt / 7: a list slice."""
        modulus = self.token_modulus
        inv7 = self._inv7
        if inv7 is None:
            return [(7 * k + salt) % modulus + 10 for k in range(k0, k0 + n)]
        cycle = self._cycle
        if len(cycle) < modulus + n:
            reps = -(-(modulus + n) // modulus)
            cycle = self._cycle = [7 * j % modulus + 10 for j in range(modulus)] * reps
        j0 = (k0 + salt * inv7) % modulus
        return cycle[j0:j0 + n]

    def fast_forward(self, req_ids: Sequence[str], first_step: int, k: int) -> list[list[int]]:
        """Tokens of `k` decode steps starting at engine step `first_step` (row = position in
        `req_ids`), counted in the runner view exactly as `execute_model` would."""
        if self.token_rule == "request":
            return [self.lazy_tokens(rid, k) for rid in req_ids]
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

    def implicit_decode_duration(self, implicit: ImplicitDecodes, shared_kv: int) -> Optional[float]:
        """`execute_model`'s duration of a batch of implicit decode rows alone (`SimScheduler.quiet_step`:
        no listed row, so nothing else for the runner to do), or None when this executor must see the
        step itself (a KV connector's worker, a drafter, a profile being recorded)."""
        if self.kv_worker is not None or self.drafter is not None or self.profile is not None:
            return None
        k = implicit.num_reqs
        return self.cost_model.decode_duration(k, implicit.sum_computed_before + k, shared_kv)

    def implicit_decode_durations(self, implicit: ImplicitDecodes, shared_kv: int, n: int) -> Optional[list[float]]:
        """`implicit_decode_duration` of `n` consecutive batches of the same implicit rows, the first
        `implicit`, each next one a token longer per row (`sum_computed_before` + i * `num_reqs`), with
        `shared_kv` shared tokens throughout - element for element the floats n calls would give; None
        when this executor must see each step itself."""
        if self.kv_worker is not None or self.drafter is not None or self.profile is not None:
            return None
        k = implicit.num_reqs
        return self.cost_model.decode_durations(k, implicit.sum_computed_before + k, shared_kv, n)

    def decode_step_durations(self, num_reqs: int, sum_kv_before: int, k: int,
                              shared_kv: int = 0) -> list[float]:
        """Predicted durations of `k` pure-decode steps of `num_reqs` rows whose computed tokens sum to
        `sum_kv_before` at the first step (each step adds `num_reqs`), `shared_kv` shared tokens."""
        predict = self.cost_model.predict
        return [predict(StepSummary(num_reqs=num_reqs, num_tokens=num_reqs, num_sampling=num_reqs,
                                    decode_reqs=num_reqs, decode_sum_kv=sum_kv_before + num_reqs * (j + 1),
                                    shared_kv=shared_kv)).duration_s
                for j in range(k)]
