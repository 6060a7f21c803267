"""Messages between an engine-core client and the EngineCore process (msgspec + msgpack over ZMQ).

Two sockets: input (client -> engine: add, abort, utility, shutdown) and output (engine -> client:
ready / start-up error, step outputs with scheduler stats, utility results, engine errors). Every
message is a tagged `msgspec.Struct`, so one decoder per socket decodes the whole union.

`SamplingParams` crosses explicitly field by field (`SamplingParamsMsg`): per-request
`logits_processors` are Python callables and cannot cross a process boundary; `encode_params`
rejects them with a `ValueError` naming the field. `EngineCoreOutput` / `Logprobs` are plain
dataclasses that msgspec encodes and decodes natively.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional, Union

import msgspec

from servetwin.core.outputs import EngineCoreOutput
from servetwin.core.sampling_params import RequestOutputKind, SamplingParams


# -- sampling params ---------------------------------------------------------------------------
class SamplingParamsMsg(msgspec.Struct, array_like=True, omit_defaults=True):
    """Every `SamplingParams` slot except `logits_processors`, including the derived ones."""
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logprobs_mode: str = "raw_logprobs"
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = 0
    skip_reading_prefix_cache: Optional[bool] = None
    extra_args: Optional[dict[str, Any]] = None
    output_text_buffer_length: int = 0
    eos_token_id: Optional[int] = None
    all_stop_token_ids: list[int] = []


# SamplingParams slot -> SamplingParamsMsg field (the three derived private ones are renamed).
_PARAM_FIELDS: dict[str, str] = {
    "_eos_token_id": "eos_token_id",
    "_all_stop_token_ids": "all_stop_token_ids",
}
NOT_TRANSFERABLE = frozenset({"logits_processors"})


def sampling_params_fields() -> set[str]:
    return {f.name for f in fields(SamplingParams)}


def transferable_param_fields() -> set[str]:
    """SamplingParams slots that `encode_params` carries (checked by tests against the class)."""
    msg_fields = set(SamplingParamsMsg.__struct_fields__)
    return {name for name in sampling_params_fields() if _PARAM_FIELDS.get(name, name) in msg_fields}


def check_transferable(params: SamplingParams) -> None:
    """Raise a `ValueError` naming the field when `params` cannot cross the process boundary."""
    if params.logits_processors:
        raise ValueError("logits_processors: per-request logits processors are Python callables and "
                         "cannot cross the process boundary to the EngineCore process; use "
                         "LLM(..., multiprocess=False) to run them in-process")
    if params.extra_args:
        try:
            msgspec.msgpack.encode(params.extra_args)
        except (TypeError, msgspec.EncodeError) as e:
            raise ValueError(f"extra_args: cannot be sent to the EngineCore process ({e}); use plain "
                             "JSON-like values") from None


def encode_params(params: SamplingParams) -> SamplingParamsMsg:
    check_transferable(params)
    return SamplingParamsMsg(
        n=params.n, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, seed=params.seed, stop=list(params.stop or []),
        stop_token_ids=list(params.stop_token_ids or []), ignore_eos=params.ignore_eos,
        max_tokens=params.max_tokens, min_tokens=params.min_tokens, logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs, logprobs_mode=params.logprobs_mode,
        detokenize=params.detokenize, skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output, output_kind=int(params.output_kind),
        skip_reading_prefix_cache=params.skip_reading_prefix_cache, extra_args=params.extra_args,
        output_text_buffer_length=params.output_text_buffer_length, eos_token_id=params._eos_token_id,
        all_stop_token_ids=sorted(params._all_stop_token_ids))


def decode_params(msg: SamplingParamsMsg) -> SamplingParams:
    """Rebuild the exact object (no re-validation, no warnings: the client already validated it)."""
    sp = object.__new__(SamplingParams)
    for name in sampling_params_fields():
        if name in NOT_TRANSFERABLE:
            setattr(sp, name, None)
            continue
        setattr(sp, name, getattr(msg, _PARAM_FIELDS.get(name, name)))
    sp.stop = list(msg.stop)
    sp.stop_token_ids = list(msg.stop_token_ids)
    sp.output_kind = RequestOutputKind(msg.output_kind)
    sp.all_stop_token_ids = set(msg.all_stop_token_ids)
    return sp


# -- client -> engine ----------------------------------------------------------------------------
class AddRequestMsg(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParamsMsg
    arrival_time: Optional[float] = None
    priority: int = 0
    cache_salt: Optional[str] = None
    parent_id: Optional[str] = None


class AbortMsg(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityMsg(msgspec.Struct, tag="util", array_like=True):
    call_id: int
    name: str
    args: list[Any] = []


class ShutdownMsg(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class BatchMsg(msgspec.Struct, tag="batch", array_like=True):
    """Several adds / aborts sent as one message (e.g. all prompts of one `LLM.generate` call), so the
    engine sees them together - exactly like the in-process client, which adds them all before stepping."""
    msgs: list[Union[AddRequestMsg, AbortMsg]]


class StartDPWaveMsg(msgspec.Struct, tag="start_dp_wave", array_like=True):
    """Front end -> an MoE data-parallel rank: another rank started lockstep wave `wave` (vLLM's
    START_DP_WAVE, `v1/engine/coordinator.py:426-456`, relayed here by the front end)."""
    wave: int


InputMsg = Union[AddRequestMsg, AbortMsg, UtilityMsg, ShutdownMsg, BatchMsg, StartDPWaveMsg]


# -- engine -> client ----------------------------------------------------------------------------
class EngineConfig(msgspec.Struct, tag="ready", array_like=True):
    """The final configuration the EngineCore process settled on (its ready message).

    Same attribute names as `servetwin.core.engine.executor.ExecutorInfo`, minus the executor object.
    """
    num_gpu_blocks: int
    max_model_len: int
    vocab_size: Optional[int] = None
    eos_token_ids: list[int] = []
    model_path: Optional[str] = None
    block_size: int = 16
    backend: str = ""
    pid: int = 0
    paced: bool = False
    time_scale: float = 1.0


class StartupErrorMsg(msgspec.Struct, tag="startup_error", array_like=True):
    exc_type: str
    message: str
    traceback: str


class EngineErrorMsg(msgspec.Struct, tag="engine_error", array_like=True):
    """The engine loop raised; the process exits right after sending this."""
    exc_type: str
    message: str
    traceback: str


class EngineDeadMsg(msgspec.Struct, tag="dead", array_like=True):
    """Sent by the client's own monitor thread (not by the engine) when the process is gone."""
    exitcode: Optional[int] = None


class EngineStats(msgspec.Struct, array_like=True):
    """Scheduler state after the latest step, with running totals accumulated in the engine."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # totals since start (non-preempted requests, like vLLM's counter)
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    sim_busy_s: float = 0.0  # paced mode: total predicted duration of the steps run so far
    # speculative decoding since start (vLLM's spec_decode counters; per_pos empty when off)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    # KV connector since start (engine_client.kv_connector_totals; None: no connector / no CPU tier)
    external_prefix_cache_queries: Optional[int] = None
    external_prefix_cache_hits: Optional[int] = None
    kv_offload_load_bytes: Optional[int] = None
    kv_offload_store_bytes: Optional[int] = None


class RequestErrorMsg(msgspec.Struct, array_like=True):
    """A request the engine refused (e.g. it can never fit the KV pool)."""
    request_id: str
    exc_type: str
    message: str


class OutputsMsg(msgspec.Struct, tag="out", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: Optional[EngineStats] = None
    # >= 0: the engine has no work left after processing input message number `idle_seq`
    idle_seq: int = -1
    errors: Optional[list[RequestErrorMsg]] = None
    # paced (simulated-time) mode: the monotonic time before which these outputs were not released
    release_at: float = 0.0
    # simulated time (sim backend): the end of the step that computed these outputs, and the simulated
    # arrival of each engine request added since the previous outputs message
    sim_time_s: float = 0.0
    sim_arrivals: Optional[dict[str, float]] = None
    # the DP rank whose engine sent it (set by the data-parallel front end; 0 with one engine)
    engine_index: int = 0
    # MoE data parallelism in lockstep (>= 0 when set): this rank started wave `start_wave` (an idle rank got
    # a request; the front end wakes the others), or rank 0 saw wave `wave_complete` end
    start_wave: int = -1
    wave_complete: int = -1


class UtilityResultMsg(msgspec.Struct, tag="util_result", array_like=True):
    call_id: int
    result: Any = None
    error: Optional[str] = None
    exc_type: Optional[str] = None


OutputMsg = Union[EngineConfig, StartupErrorMsg, EngineErrorMsg, EngineDeadMsg, OutputsMsg, UtilityResultMsg]


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(InputMsg)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(OutputMsg)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()
