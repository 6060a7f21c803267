"""What the scheduler hands an executor each step (vLLM v1 `core/sched/output.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(slots=True)
class NewRequestData:
    """A request admitted from WAITING this step (`block_ids` holds all of its blocks, hits included)."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit length: KV already present


@dataclass(slots=True)
class CachedRequestData:
    """Running requests scheduled this step, then resumed (PREEMPTED -> RUNNING) ones.

    `new_block_ids[i]` is None when nothing was allocated; for a resumed request it is the *full*
    block list. `num_computed_tokens` is the value before this step's advance. `all_token_ids` holds
    prompt + outputs for resumed requests (the V1 runner lost their state at preemption).
    """
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Optional[list[int]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # running first, then new/resumed, in scheduling order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    step: int = 0
    # Filled by the scheduler for the benefit of traces and cost models (not in vLLM's struct):
    # per scheduled request, computed tokens *before* this step and whether the chunk samples.
    num_computed_before: dict[str, int] = field(default_factory=dict)
    preempted_order: list[str] = field(default_factory=list)
    scheduler_step: int = 0  # the scheduler's own step index (`step` is renumbered by the engine)
    # KV tokens of blocks held by more than one request, counted once per extra holder: block_size x
    # sum of (ref_cnt - 1) over held blocks after scheduling (prefix-cache sharing, for the cost model)
    shared_kv_tokens: int = 0
    lazy: Any = None  # servetwin.core.sched.lazy_decode.LazyStep: implicit decode rows (simulator only), else None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
