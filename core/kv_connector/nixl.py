"""A P/D connector with vLLM 0.33's NixlConnector scheduler semantics (the pull mode:
`kv_connector/v1/nixl/base_scheduler.py`, `pull_scheduler.py`).

- Consumer (decode side, `kv_transfer_params.do_remote_prefill`): the whole prompt beyond the local
  hit is offered as external tokens, loaded asynchronously (the request waits in
  WAITING_FOR_REMOTE_KVS); the read is requested once (`reqs_to_recv`), with the request's newly
  allocated (unhashed) blocks as the destination.
- Producer (prefill side, `do_remote_decode`): a request that finishes by length or stop keeps its
  blocks (`request_finished` -> delay free) until the worker reports `finished_sending`; its output
  carries the kv_transfer_params a decode engine reads them with (`reqs_to_send`).
- The lease (`kv_lease_duration`, seconds) is enforced by the worker, never by the scheduler; the
  scheduler only stamps it on `reqs_to_send`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from servetwin.core.kv_connector.base import KVConnectorBase, KVConnectorOutput
from servetwin.core.kv_cache.kv_cache_interface import SLIDING_WINDOW
from servetwin.core.kv_cache.kv_sizing import cdiv
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.request import RequestStatus

if TYPE_CHECKING:
    from servetwin.core.request import Request

REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(slots=True)
class RecvMeta:
    """One read the worker must start (`awaiting_kvs` False: only a notice to the remote engine)."""
    local_block_ids: list[list[int]]
    awaiting_kvs: bool
    kv_transfer_params: dict[str, Any]


@dataclass(slots=True)
class NixlConnectorMetadata:
    reqs_to_recv: dict[str, RecvMeta] = field(default_factory=dict)
    reqs_to_send: dict[str, float] = field(default_factory=dict)  # id -> lease (seconds)
    reqs_in_batch: set[str] = field(default_factory=set)
    reqs_not_processed: set[str] = field(default_factory=set)


class NixlConnector(KVConnectorBase):
    """vLLM's `NixlPullConnectorScheduler` (reported class name `NixlPullConnector`)."""

    class_name = "NixlPullConnector"

    def __init__(self, config: KVTransferConfig, block_size: int, kv_cache_groups: Optional[tuple] = None) -> None:
        super().__init__(config, block_size, kv_cache_groups)
        # blocks a sliding-window group hands over: its window, plus one for a misaligned boundary
        # (base_scheduler.py `blocks_per_sw`); 0 = the whole group
        self.blocks_per_window = [cdiv(g.sliding_window, block_size) + 1 if g.type == SLIDING_WINDOW else 0
                                  for g in kv_cache_groups or ()]
        self.engine_id = config.get_from_extra_config("engine_id", "engine-local")
        self.kv_lease_duration = config.get_from_extra_config("kv_lease_duration", 30)
        self.kv_recompute_threshold = int(config.get_from_extra_config("kv_recompute_threshold", 64))
        # where this engine's worker serves reads (vLLM's NIXL side channel, VLLM_NIXL_SIDE_CHANNEL_*)
        self.side_channel = (config.get_from_extra_config("side_channel_host", "localhost"),
                             int(config.get_from_extra_config("side_channel_port", 5600)))
        self._reqs_need_recv: dict[str, RecvMeta] = {}
        self._reqs_need_send: dict[str, float] = {}
        self._reqs_in_batch: set[str] = set()
        self._reqs_not_processed: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:  # base.py: the producer role hands KV off
        return self.config.is_kv_producer

    @staticmethod
    def prefill_backoff() -> int:
        """Trailing prompt tokens the decoder recomputes (base_scheduler.py `_prefill_backoff`):
        only Mamba, DSV41 replay or multi-module MTP need any; 0 here."""
        return 0

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):  # pull_scheduler.py:59-64
            count = request.num_prompt_tokens - self.prefill_backoff() - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            self._reqs_in_batch.add(request.request_id)
        elif params.get("do_remote_prefill"):
            if params.get("remote_block_ids") and all(k in params for k in REMOTE_KEYS):
                # the read lands in the blocks the prefix cache did not supply (pull_scheduler.py:136-165)
                local = ([[b.block_id for b in group if b.block_hash is None and not b.is_null]
                          for group in blocks] if num_external_tokens > 0 else [])
                self._reqs_need_recv[request.request_id] = RecvMeta(local, num_external_tokens > 0, params)
            params["do_remote_prefill"] = False  # only one transfer per request
            params["_remote_blocks_processed"] = True

    def exchange_clipped_blocks(self, block_ids: tuple[list[int], ...]) -> tuple[list[int], ...]:
        """A sliding-window group hands over only its in-window tail (`get_exchange_clipped_blocks`)."""
        if not any(self.blocks_per_window):
            return block_ids
        return tuple(ids[-n:] if n else ids for ids, n in zip(block_ids, self.blocks_per_window))

    def build_connector_meta(self, scheduler_output) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(dict(self._reqs_need_recv), self._reqs_need_send,
                                     self._reqs_in_batch, self._reqs_not_processed)
        if meta.reqs_to_recv:
            self.stats.num_loads_started += sum(m.awaiting_kvs for m in meta.reqs_to_recv.values())
        self.stats.num_sends_started += len(meta.reqs_to_send)
        self._reqs_need_recv.clear()
        self._reqs_need_send, self._reqs_in_batch, self._reqs_not_processed = {}, set(), set()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.stats.num_failed_loads += len(connector_output.failed_recving)

    def request_finished(self, request: "Request",
                         block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # never allocated (aborted while queued): an empty read tells the prefill engine to free
            self._reqs_need_recv[request.request_id] = RecvMeta([], False, params)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None  # decode side (no bidirectional transfer)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self._reqs_not_processed.add(request.request_id)  # aborted: freed at once
            return False, None
        delay = any(len(g) > 0 for g in block_ids)
        remote_num_tokens = 0
        if delay:  # kept for the decode engine's read until finished_sending (pull_scheduler.py:262-282)
            self._reqs_need_send[request.request_id] = self.kv_lease_duration
            remote_num_tokens = request.num_computed_tokens
            block_ids = self.exchange_clipped_blocks(block_ids)
        return delay, dict(
            do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[list(g) for g in block_ids],
            remote_engine_id=self.engine_id, remote_request_id=request.request_id,
            remote_host=self.side_channel[0], remote_port=self.side_channel[1], tp_size=1, dcp_size=1, pp_size=1,
            remote_num_tokens=remote_num_tokens, remote_blocks_expiry_time=None,
            remote_registration_generation=0, transfer_mode="pull")
