"""The simulator's drafter and verifier for speculative decoding (no model runs).

A verifying row with m scheduled drafts accepts a = `AcceptanceModel.num_accepted(id, step, m)`
(sim/spec_acceptance.py: per-position rates, user-set, fitted or the method's default) and samples
a + 1 tokens; a row admitted from the waiting queue carries vLLM's padded -1 drafts and accepts none
(the recorded oracle's rule, docs/scenario_speculative.md). After each step the drafter proposes k
drafts for every row that sampled (vLLM's drafters propose for those rows; n-gram may propose fewer,
which the acceptance model folds into its rates).

`SpecReplay` replaces both draws with a recorded run's: per request, the accepted count of each of
its verify steps and the length of each proposal, in order (e.g. from a torch run), so a simulated
run schedules exactly what the recorded one did.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.sched.spec_decode import SpeculativeConfig
from servetwin.sim.spec_acceptance import DEFAULT_ACCEPTANCE, AcceptanceModel


@dataclass(slots=True)
class SpecReplay:
    """A recorded run's acceptance pattern: request id -> accepted counts (one per verify step) and
    request id -> proposal lengths (one per proposal), both in order."""
    accepted: dict[str, list[int]] = field(default_factory=dict)
    draft_lengths: dict[str, list[int]] = field(default_factory=dict)


class SimDrafter:
    def __init__(self, config: SpeculativeConfig, acceptance: AcceptanceModel | None = None,
                 replay: SpecReplay | None = None) -> None:
        self.k = config.num_speculative_tokens
        # draft_model has no published default: the n-gram placeholder stands in (set your own rates)
        self.acceptance = acceptance or DEFAULT_ACCEPTANCE.get(config.method, DEFAULT_ACCEPTANCE["ngram"])
        self.replay = replay
        self._verifies: dict[str, int] = {}
        self._proposals: dict[str, int] = {}

    def num_accepted(self, so: SchedulerOutput, req_id: str, num_drafts: int) -> int:
        j = self._verifies.get(req_id, 0)
        self._verifies[req_id] = j + 1
        if req_id in so.scheduled_cached_reqs.resumed_req_ids or any(n.req_id == req_id for n in so.scheduled_new_reqs):
            return 0  # padded -1 drafts of a request admitted from the waiting queue
        if self.replay is None:
            return self.acceptance.num_accepted(req_id, so.step, num_drafts)
        return min(self.replay.accepted[req_id][j], num_drafts)

    def proposal_length(self, req_id: str) -> int:
        if self.replay is None:
            return self.k
        j = self._proposals.get(req_id, 0)
        self._proposals[req_id] = j + 1
        lengths = self.replay.draft_lengths.get(req_id, ())
        return lengths[j] if j < len(lengths) else 0

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self._verifies.pop(rid, None)
            self._proposals.pop(rid, None)
