"""What the scheduler hands an executor each step (vLLM v1 `core/sched/output.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(slots=True)
class NewRequestData:
    """A request admitted from WAITING this step (`block_ids` holds all of its blocks, hits included,
    one list per KV cache group in group order; a window group's skipped blocks are the null block 0)."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int  # prefix-cache hit length: KV already present


@dataclass(slots=True)
class CachedRequestData:
    """Running requests scheduled this step, then resumed (PREEMPTED -> RUNNING) ones.

    `new_block_ids[i]` (one list per KV cache group) is None when nothing was allocated in any group;
    for a resumed request it is the *full* block lists. `num_computed_tokens` is the value before this step's advance. `all_token_ids` holds
    prompt + outputs for resumed requests (the V1 runner lost their state at preemption).
    """
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[Optional[tuple[list[int], ...]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # pipeline parallelism without async scheduling: per request, the tokens it is scheduled for this
    # step (vLLM's `new_token_ids`): the first stage never sees what the last one sampled
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class ImplicitDecodes:
    """Decode rows scheduled in aggregate, not listed (an extension point; vLLM has none).

    The core `Scheduler` never produces them. A `Scheduler` subclass may schedule some decode rows
    - one token each, sampling, after `s` computed tokens - without listing them in
    `num_scheduled_tokens` / `scheduled_cached_reqs` (servetwin's simulator does, for speed:
    `servetwin.sim.scheduler`). The contract:
    - they count in `total_num_scheduled_tokens` (one token each) and are summarised here;
    - an executor paired with such a subclass runs them (its cost includes them) but returns no
      tokens for them: their outputs never reach `update_from_output`, the subclass applies them
      itself later and reports them to the trace as `servetwin.core.testbed.trace.LateTokens`;
    - the trace counts them in the step row (`num_reqs`, attention sums, `max_kv`).
    """
    num_reqs: int
    sum_computed_before: int  # sum of s over the rows
    max_computed_before: int  # max of s over the rows


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # running first, then new/resumed, in scheduling order
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    step: int = 0
    # speculative decoding: the drafts scheduled for verification per request (vLLM's field; -1
    # entries are padding or async placeholders)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Filled by the scheduler for the benefit of traces and cost models (not in vLLM's struct):
    # per scheduled request, computed tokens *before* this step and whether the chunk samples.
    num_computed_before: dict[str, int] = field(default_factory=dict)
    preempted_order: list[str] = field(default_factory=list)
    scheduler_step: int = 0  # the scheduler's own step index (`step` is renumbered by the engine)
    # KV tokens of blocks held by more than one request, counted once per extra holder: block_size x
    # sum of (ref_cnt - 1) over held blocks after scheduling (prefix-cache sharing, for the cost model)
    shared_kv_tokens: int = 0
    implicit_decodes: Optional[ImplicitDecodes] = None  # unlisted decode rows (see ImplicitDecodes)
    kv_connector_metadata: Any = None  # what the KV connector's worker side must do this step

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
