"""The scheduler-side connector API (vLLM 0.33 `kv_connector/v1/base.py`, `KVConnectorBase_V1`).

The scheduler calls, per step:
- `get_num_new_matched_tokens(request, num_computed_tokens)` for a waiting request with no computed
  tokens: (tokens the connector can supply beyond the local hit, whether they load asynchronously);
  `(None, False)` means "ask again later" (the request is skipped this step);
- `update_state_after_alloc(request, blocks, num_external_tokens)` once its blocks are allocated;
- `build_connector_meta(scheduler_output)` at the end of `schedule()`: what the worker side must do;
- `update_connector_output(output)` with what the worker reported (`KVConnectorOutput`);
- `request_finished(request, block_ids)` when a request finishes: (delay the block free until
  `finished_sending`, kv_transfer_params for the request's output);
- `has_pending_push_work()`: keeps the engine stepping while the connector still has work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_connector.config import KVTransferConfig

if TYPE_CHECKING:
    from servetwin.core.request import Request
    from servetwin.core.sched.output import SchedulerOutput


class KVConnectorOutputError(ConfigError):
    """A worker report the connector cannot accept (a job reported done that is not in flight);
    `path` names the report's field."""


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker side reports in a step's `ModelRunnerOutput` (vLLM `v1/outputs.py`)."""
    finished_sending: Optional[set[str]] = None
    finished_recving: Optional[set[str]] = None
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    # OffloadingConnector's worker metadata: job id -> completions
    completed_jobs: dict[int, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving
                    or self.invalid_block_ids or self.completed_jobs)


@dataclass(slots=True)
class KVConnectorStats:
    """Scheduler-side connector counters (servetwin's; vLLM's connectors keep their own dicts)."""
    num_loads_started: int = 0
    num_loaded_tokens: int = 0
    num_sends_started: int = 0
    num_failed_loads: int = 0
    num_stores_started: int = 0

    def is_empty(self) -> bool:
        return not (self.num_loads_started or self.num_sends_started or self.num_failed_loads
                    or self.num_stores_started)


class KVConnectorBase:
    """Scheduler side of a KV connector. Subclasses override what they need; the defaults are a
    connector that never has external KV and never delays a free."""

    #: Whether a preempted request's in-flight output must be dropped (vLLM's requires_kv_delivery).
    requires_kv_delivery = False

    def __init__(self, config: KVTransferConfig, block_size: int,
                 kv_cache_groups: Optional[tuple] = None) -> None:
        """`kv_cache_groups`: the model's KV cache group specs (None: one full-attention group)."""
        self.config = config
        self.block_size = block_size
        self.kv_cache_groups = kv_cache_groups
        self.stats = KVConnectorStats()

    @property
    def role(self) -> str:
        return self.config.kv_role

    def on_new_request(self, request: "Request") -> None:
        """A request entered the scheduler."""

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        """`blocks`: the request's blocks per KV cache group after the allocation."""

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> Any:
        return None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker's report for one step, before the scheduler frees or promotes anything."""

    def request_finished(self, request: "Request",
                         block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return False, None

    def has_pending_push_work(self) -> bool:
        return False

    def take_stats(self) -> Optional[KVConnectorStats]:
        """The counters since the last call (None when nothing happened)."""
        stats, self.stats = self.stats, KVConnectorStats()
        return None if stats.is_empty() else stats
