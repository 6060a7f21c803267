"""Executor-side request state, rebuilt from `SchedulerOutput`s exactly as vLLM's model runner does.

Every executor (fake, simulated, torch) keeps one `RunnerState`: it learns new requests, block
growth, resumptions and finishes from each `SchedulerOutput`, and knows the tokens it sampled itself.
`update()` returns the step's rows in `num_scheduled_tokens` order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servetwin.core.sched.output import SchedulerOutput


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far (as the runner knows them)
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]  # per KV cache group, group order (vLLM's `block_ids`)
    sampling_params: Any
    num_computed_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class ScheduledRow:
    """One request of the flattened batch."""
    req_id: str
    state: CachedRequestState
    num_computed_before: int
    num_scheduled: int
    # speculative decoding: the drafts scheduled after the known tokens (-1: a padded, empty draft)
    spec_token_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token (a partial prefill samples nothing)."""
        return self.num_computed_before + self.num_scheduled >= len(self.state.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_before < self.state.num_prompt_tokens


class RunnerState:
    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, so: SchedulerOutput) -> list[ScheduledRow]:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=tuple(list(ids) for ids in new.block_ids),
                sampling_params=new.sampling_params,
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state = self.requests.get(req_id)
                tokens = cached.all_token_ids[req_id]
                if state is None:  # preempted before the runner ever saw it run
                    raise RuntimeError(f"resumed request {req_id} unknown to the runner")
                state.token_ids = list(tokens)
                state.block_ids = tuple(list(ids) for ids in new_blocks)
            else:
                state = self.requests[req_id]
                if cached.new_token_ids:
                    _learn_new_tokens(state, cached.num_computed_tokens[i], cached.new_token_ids[i])
                if new_blocks:  # per group: the blocks appended to each group's table
                    for ids, new_ids in zip(state.block_ids, new_blocks):
                        ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens[i]
        rows = []
        spec = so.scheduled_spec_decode_tokens
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            rows.append(ScheduledRow(req_id, state, state.num_computed_tokens, n, tuple(spec.get(req_id, ()))))
            state.num_computed_tokens += n
        return rows

    def append_sampled(self, req_id: str, token_ids: list[int]) -> None:
        state = self.requests.get(req_id)
        if state is not None:
            state.token_ids.extend(token_ids)


def _learn_new_tokens(state: CachedRequestState, num_computed: int, token_ids: list[int]) -> None:
    """A pipeline stage that did not sample learns the tokens from the scheduler (vLLM 0.33
    v1/worker/gpu_model_runner.py `_update_states`, not the last PP rank): those past what it knows."""
    num_new = num_computed + len(token_ids) - len(state.token_ids)
    if num_new > 0:
        state.token_ids.extend(token_ids[-num_new:])
