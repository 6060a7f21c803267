"""The replay's fake worker for speculative decoding: verification, acceptance and the drafter.

It follows the recorded oracle's rules (`docs/scenario_speculative.md`), which stand in for vLLM
0.33's GPU worker (no model runs):
- a row that samples (not a partial prefill chunk) with `m` scheduled drafts accepts `a` of them and
  returns `a + 1` tokens; token `j` of row `r` in step `s` is `(s*7 + r + 17*j) % 1000 + 10` unless the
  request's `stop_at` names that output position (the scripted sampler decides);
- `a = min(m, x)`: `x` from the request's `accept_pattern` (cycled over its verify steps), else the
  scenario's `acceptance` ("all", "none", a cycled pattern, or a sha256 of seed, id and step); a
  request admitted from the waiting queue with padded -1 drafts accepts none;
- sync scheduling: after each update (vLLM's `EngineCore.post_step`) the drafter proposes for every
  row of the executed batch: `draft_lengths[j % len]` (else k) drafts for the request's j-th proposal,
  ids `(s*11 + r + 3*j) % 1000 + 10`; the scheduler ignores those of finished or prefilling requests.
"""
from __future__ import annotations

import hashlib
from typing import Callable

from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.sched.scheduler import Scheduler
from servetwin.core.sched.spec_decode import DraftTokenIds
from servetwin.core.testbed.scenario import ScenarioRequest
from servetwin.core.testbed.spec_scenario import SpecScenario


def seeded_acceptance(seed: int, req_id: str, step: int, num_drafts: int) -> int:
    """The oracle's `{"seed": S}` rule: a stable hash of seed, request id and step, mod m + 1."""
    digest = hashlib.sha256(f"{seed}:{req_id}:{step}".encode()).hexdigest()
    return int(digest[:12], 16) % (num_drafts + 1)


class FakeSpecWorker:
    """Samples `a + 1` tokens per verifying row and proposes the next drafts."""

    def __init__(self, spec: SpecScenario, parents: dict[str, ScenarioRequest],
                 token_fn: Callable[[str, int], int]) -> None:
        self.spec = spec
        self.parents = parents  # engine request id -> its scenario request
        self.token_fn = token_fn
        self.num_verifies: dict[str, int] = {}
        self.num_proposals: dict[str, int] = {}
        self.accepted_total: dict[str, int] = {}

    def num_accepted(self, req_id: str, step: int, num_drafts: int, padded: bool) -> int:
        j = self.num_verifies.get(req_id, 0)
        self.num_verifies[req_id] = j + 1
        if padded:
            return 0
        pattern = self.parents[req_id].accept_pattern
        rule = self.spec.acceptance
        if pattern is not None:
            a = pattern[j % len(pattern)]
        elif rule == "all":
            a = num_drafts
        elif rule == "none":
            a = 0
        elif rule[0] == "pattern":
            a = rule[1][j % len(rule[1])]
        else:
            a = seeded_acceptance(rule[1], req_id, step, num_drafts)
        return min(a, num_drafts)

    def execute_model(self, so: SchedulerOutput, scheduler: Scheduler) -> tuple[ModelRunnerOutput, dict[str, int]]:
        """The step's sampled tokens and `{id: accepted drafts}` for the rows that verified drafts."""
        step = so.step
        from_waiting = {n.req_id for n in so.scheduled_new_reqs} | so.scheduled_cached_reqs.resumed_req_ids
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        accepted: dict[str, int] = {}
        for row, rid in enumerate(ids):
            if scheduler.requests[rid].is_prefill_chunk:
                sampled.append([])
                continue
            a = 0
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                a = accepted[rid] = self.num_accepted(rid, step, len(drafts), rid in from_waiting)
                self.accepted_total[rid] = self.accepted_total.get(rid, 0) + a
            sampled.append([self.token_fn(rid, (step * 7 + row + 17 * j) % 1000 + 10) for j in range(a + 1)])
        return ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled), accepted

    def propose(self, so: SchedulerOutput, scheduler: Scheduler) -> dict[str, int]:
        """Feed the drafter's proposals for the executed batch `so`; `{id: drafts}` for the requests
        still decoding (the ones whose proposal counts)."""
        k = self.spec.config.num_speculative_tokens
        req_ids, drafts, proposed = [], [], {}
        for row, rid in enumerate(so.num_scheduled_tokens):
            q = scheduler.requests.get(rid)
            n = k
            if q is not None and not q.is_finished() and not q.is_prefill_chunk:
                lengths = self.parents[rid].draft_lengths
                if lengths is not None:
                    j = self.num_proposals.get(rid, 0)
                    self.num_proposals[rid] = j + 1
                    n = lengths[j % len(lengths)]
                proposed[rid] = n
            req_ids.append(rid)
            drafts.append([(so.step * 11 + row + 3 * j) % 1000 + 10 for j in range(n)])
        scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))
        return proposed
