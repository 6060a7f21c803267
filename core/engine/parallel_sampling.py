"""Parallel sampling fan-out (`n > 1`): n independent engine requests `{i}_{parent_id}` (vLLM B.2)."""
from __future__ import annotations

from typing import Optional

from servetwin.core.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def fan_out(parent_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """Children ids and params: `n = 1`, and `seed + i` when the parent has a seed."""
    if params.n == 1:
        return [(parent_id, params)]
    shared: Optional[SamplingParams] = None
    children = []
    for i in range(params.n):
        if params.seed is not None:
            child = params.clone()
            child.n = 1
            child.seed = params.seed + i
        else:
            if shared is None:
                shared = params.clone()
                shared.n = 1
            child = shared
        children.append((child_request_id(i, parent_id), child))
    return children


class ParentRequest:
    """Aggregates the children's outputs; finished when every child finished."""

    def __init__(self, parent_id: str, params: SamplingParams) -> None:
        self.request_id = parent_id
        self.params = params
        self.n = params.n
        self.child_ids = [cid for cid, _ in fan_out(parent_id, params)]
        self.index_of = {cid: i for i, cid in enumerate(self.child_ids)}
        self.unfinished = set(self.child_ids)
        self.outputs: list = [None] * self.n

    def observe(self, child_id: str, completion, finished: bool) -> Optional[list]:
        """Record a child's completion; returns the outputs to publish now (None: nothing yet)."""
        idx = self.index_of[child_id]
        self.outputs[idx] = completion
        if finished:
            self.unfinished.discard(child_id)
        if self.params.output_kind == RequestOutputKind.FINAL_ONLY:
            return list(self.outputs) if not self.unfinished else None
        return [completion]

    @property
    def finished(self) -> bool:
        return not self.unfinished
