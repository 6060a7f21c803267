"""What an executor returns (vLLM v1 `v1/outputs.py`) and what the engine core emits per request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec


@dataclass(slots=True)
class StepTiming:
    """How long the executor took for one step (measured by `gpu/`, predicted by `sim/`)."""
    duration_s: float
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    padded_batch_size: int = 0
    cpu_s: Optional[float] = None  # process CPU time of the step (measured backends; None: not measured)


@dataclass(slots=True)
class Logprobs:
    """Per sampled token: the top-k (token id, logprob) pairs plus the sampled token's own."""
    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int = 0


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]  # [] for a non-final prefill chunk
    logprobs: Optional[list[Optional[list[Logprobs]]]] = None  # per request, per sampled token
    prompt_logprobs_dict: dict[str, list[Optional[Logprobs]]] = field(default_factory=dict)
    timing: Optional[StepTiming] = None
    kv_connector_output: Optional[Any] = None  # servetwin.core.kv_connector.base.KVConnectorOutput


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class EngineCoreOutput(msgspec.Struct):
    """One request's new tokens from one step (a msgspec Struct: built once per request per step,
    where a dataclass's Python `__init__` showed in simulator profiles)."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[int] = None  # servetwin.core.request.FinishReason
    stop_reason: Optional[int | str] = None
    new_logprobs: Optional[list[Logprobs]] = None
    new_prompt_logprobs: Optional[list[Optional[Logprobs]]] = None
    num_cached_tokens: int = 0
    kv_transfer_params: Optional[dict[str, Any]] = None  # a KV connector's hand-off (P/D)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
