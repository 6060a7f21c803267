"""`Request`, its status machine and finish reasons (vLLM v1 `request.py`)."""
from __future__ import annotations

import enum
import time
from typing import Any, Callable, Optional

from servetwin.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Order matters: every status after PREEMPTED is a finished one."""
    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> Optional["FinishReason"]:
        return _FINISHED_REASON_MAP.get(status)


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


_FINISHED_REASON_MAP = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}

BlockHasher = Callable[["Request"], list[bytes]]


class Request:
    __slots__ = (
        "request_id", "client_index", "priority", "arrival_time", "sampling_params", "max_tokens",
        "prompt_token_ids", "num_prompt_tokens", "_output_token_ids", "_all_token_ids", "status",
        "num_computed_tokens", "block_hashes", "_block_hasher", "cache_salt", "lora_request",
        "skip_reading_prefix_cache", "stop_reason", "num_preemptions", "is_prefill_chunk",
        "num_output_placeholders", "num_in_flight_tokens", "num_stale_output_tokens",
        "num_cached_tokens", "parent_id", "events", "_next_hash_at", "_hash_block_size",
        "_hash_lookahead",
        "shared_prefix_boundary", "spec_token_ids", "kv_transfer_params", "last_sched_seq",
        "drop_stale_output",
        "__weakref__",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        block_hasher: Optional[BlockHasher] = None,
        hash_block_size: Optional[int] = None,
        lora_request: Any = None,
        client_index: int = 0,
        parent_id: Optional[str] = None,
    ) -> None:
        if sampling_params is None:
            raise ValueError("sampling_params: a Request needs SamplingParams")
        if sampling_params.max_tokens is None:
            raise ValueError(f"max_tokens: request {request_id} has max_tokens=None; the front end "
                             "must set it (max_model_len - prompt_len) before scheduling")
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        # the caller's list, read only from here on, as vLLM keeps it (request.py:134; speed: one copy of the
        # prompt less per request, and a prompt sent again stays one object, which the prompt's caches key on:
        # hashing.py `get_request_block_hasher`, sim/executor.py `request_token_salt`); other sequences as a list
        self.prompt_token_ids = prompt_token_ids if type(prompt_token_ids) is list else list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        # vLLM keeps a copy of the prompt extended by the output (v1/request.py:150); here it is built on its first
        # read (`all_token_ids`) and kept extended from then on (speed: the copy - 6,500 tokens a request on the
        # routing ladder - and its freeing took ~4% of the ladder's loop samples; the scheduler needs only the
        # count, `num_tokens`, and the block hashers a block's tokens, `get_token_ids`: both read the two lists)
        self._all_token_ids: Optional[list[int]] = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.skip_reading_prefix_cache = bool(sampling_params.skip_reading_prefix_cache)
        self.stop_reason: Optional[int | str] = None
        self.num_preemptions = 0
        self.is_prefill_chunk = False
        self.num_output_placeholders = 0  # async scheduling: tokens sampled but not yet returned
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.num_cached_tokens = -1  # prefix hit at first admission
        # the full-attention hit when it was longer than the hit of every KV cache group together
        # (sliding-window groups then retain their blocks before it; kv_cache_manager)
        self.shared_prefix_boundary: Optional[int] = None
        self.parent_id = parent_id
        # speculative decoding: drafts proposed for the next step (vLLM's `spec_token_ids`; the
        # AsyncScheduler stores -1 placeholders here)
        self.spec_token_ids: list[int] = []
        # KV connectors (vLLM request.py): the P/D hand-off parameters ride in extra_args
        extra = sampling_params.extra_args
        self.kv_transfer_params: Optional[dict[str, Any]] = (
            extra.get("kv_transfer_params") if extra else None)
        self.last_sched_seq = 0  # the step that last scheduled it (a consumer's deferred frees)
        # a preemption drops (not delivers) the output still in flight: a producer's hand-off needs
        # KV the preemption freed (vLLM's requires_kv_delivery)
        self.drop_stale_output = False
        self.events: list[tuple[str, float]] = []
        self.block_hashes: list[bytes] = []
        self._block_hasher: Optional[BlockHasher] = None
        self._hash_block_size = 0
        self._hash_lookahead = 0  # tokens past a block its hash covers (spec decode: get_request_block_hasher)
        self._next_hash_at = 1 << 62
        if block_hasher is not None:
            self.set_block_hasher(block_hasher, hash_block_size)

    def set_block_hasher(self, block_hasher: BlockHasher, block_size: Optional[int] = None) -> None:
        """Attach the prefix-cache hasher and hash every full block known so far."""
        if block_size is None:
            block_size = getattr(block_hasher, "block_size", None)
        if not block_size:
            raise ValueError("hash_block_size: unknown for this block hasher; pass hash_block_size")
        self._block_hasher = block_hasher
        self._hash_block_size = block_size
        self._hash_lookahead = getattr(block_hasher, "num_lookahead_tokens", 0)
        self.block_hashes = block_hasher(self)
        self._next_hash_at = (len(self.block_hashes) + 1) * block_size + self._hash_lookahead

    # -- tokens ------------------------------------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt followed by the output: one list, which grows with the output from now on."""
        all_ids = self._all_token_ids
        if all_ids is None:
            all_ids = self._all_token_ids = self.prompt_token_ids + self._output_token_ids
        return all_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` (0 <= start <= end), without building `all_token_ids`."""
        num_prompt = self.num_prompt_tokens
        if start >= num_prompt:
            return self._output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self._output_token_ids[:end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self._output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_prompt_tokens + len(self._output_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        out_ids = self._output_token_ids
        all_ids = self._all_token_ids
        if isinstance(token_ids, int):
            out_ids.append(token_ids)
            if all_ids is not None:
                all_ids.append(token_ids)
        else:
            out_ids.extend(token_ids)
            if all_ids is not None:
                all_ids.extend(token_ids)
        if self.num_prompt_tokens + len(out_ids) >= self._next_hash_at:  # a block just became full
            self.hash_new_blocks()

    def hash_new_blocks(self) -> None:
        self.block_hashes.extend(self._block_hasher(self))
        self._next_hash_at = (len(self.block_hashes) + 1) * self._hash_block_size + self._hash_lookahead

    # -- status ------------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> Optional[FinishReason]:
        return _FINISHED_REASON_MAP.get(self.status)

    def __lt__(self, other: "Request") -> bool:
        """Priority-queue order: priority, then arrival time, then id (vLLM)."""
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
