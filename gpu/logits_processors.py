"""Batch-level logits processors with vLLM v1's interface (`vllm/v1/sample/logits_processor/`).

A `LogitsProcessor` keeps per-row state for the current batch. Before every step the caller hands it
a `BatchUpdate` (or None when the batch did not change) through `update_state`; `apply` then edits
the `[num_reqs, vocab]` float32 logits of that step (in place or not) and returns them.

Order of operations inside an update (as in vLLM): removed, then added, then moved. An added request
may replace whatever occupied its index. Indices at or past `batch_size` are dropped.

Built-ins (in the order the sampler applies them, all *not* argmax-invariant):
- `MinTokensLogitsProcessor`: while `len(output) < min_tokens`, stop ids (and EOS) get -inf.
- `LogitBiasLogitsProcessor`: adds `extra_args["logit_bias"]` ({token id: bias}).
- `AdapterLogitsProcessor`: runs the per-request callables in `SamplingParams.logits_processors`,
  `fn(output_token_ids, logits_row)` or `fn(prompt_token_ids, output_token_ids, logits_row)`.

Min-p is done by the sampler from `SamplingMetadata.min_p` (vLLM runs it as an argmax-invariant
built-in at the same point: after temperature, before top-k/top-p).

Processors keep a *reference* to each request's `output_token_ids` list (as vLLM does). If the
caller's lists are copies rather than live lists, re-add the rows every step
(`BatchUpdate.from_batch`), which is what `SamplingMetadata.from_requests` does by default.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from functools import partial
from typing import Optional, TypeVar

import torch

from servetwin.core.sampling_params import SamplingParams

T = TypeVar("T")


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # a -> b; a becomes empty
    SWAP = auto()  # a <-> b


RemovedRequest = int
# (index, params, prompt_token_ids, output_token_ids)
AddedRequest = tuple[int, SamplingParams, Optional[list[int]], list[int]]
# (from index, to index, direction)
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the previous step (vLLM's `BatchUpdate`)."""
    batch_size: int
    removed: Sequence[RemovedRequest] = field(default_factory=tuple)
    added: Sequence[AddedRequest] = field(default_factory=tuple)
    moved: Sequence[MovedRequest] = field(default_factory=tuple)

    @classmethod
    def from_batch(cls, params: Sequence[SamplingParams],
                   prompt_token_ids: Sequence[Optional[list[int]]],
                   output_token_ids: Sequence[list[int]]) -> "BatchUpdate":
        """Every row (re)added at its index; rows past `len(params)` dropped."""
        added = [(i, p, prompt_token_ids[i], output_token_ids[i]) for i, p in enumerate(params)]
        return cls(batch_size=len(params), added=added)


def build_batch_update(prev_req_ids: Sequence[str], req_ids: Sequence[str],
                       params: Sequence[SamplingParams],
                       prompt_token_ids: Sequence[Optional[list[int]]],
                       output_token_ids: Sequence[list[int]]) -> Optional[BatchUpdate]:
    """Diff two batch orders: each index whose occupant changed is re-added, indices past the new
    batch size are removed. Returns None when nothing changed (still call `update_state(None)`)."""
    added = [(i, params[i], prompt_token_ids[i], output_token_ids[i])
             for i, rid in enumerate(req_ids) if i >= len(prev_req_ids) or prev_req_ids[i] != rid]
    removed = list(range(len(req_ids), len(prev_req_ids)))
    if not added and not removed:
        return None
    return BatchUpdate(batch_size=len(req_ids), removed=removed, added=added)


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: Optional[BatchUpdate],
    new_state: Callable[[SamplingParams, Optional[list[int]], list[int]], Optional[T]],
) -> bool:
    """Apply a `BatchUpdate` to sparse per-row state {index: state}; True if anything changed."""
    if batch_update is None:
        return False
    updated = False
    for index in batch_update.removed:
        if req_entries.pop(index, None) is not None:
            updated = True
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    for a, b, direction in batch_update.moved:
        a_entry = req_entries.pop(a, None)
        b_entry = req_entries.pop(b, None)
        if a_entry is not None:
            req_entries[b] = a_entry
            updated = True
        if b_entry is not None:
            updated = True
            if direction == MoveDirectionality.SWAP:
                req_entries[a] = b_entry
    for index in [i for i in req_entries if i >= batch_update.batch_size]:
        del req_entries[index]
        updated = True
    return updated


class LogitsProcessor(ABC):
    """vLLM v1 batch-level logits processor."""

    def __init__(self, device: torch.device | str = "cpu", vocab_size: Optional[int] = None) -> None:
        self.device = torch.device(device)
        self.vocab_size = vocab_size

    @abstractmethod
    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        """Called before every step; `batch_update` is None when the batch did not change."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return the processed `[num_reqs, vocab]` logits (may edit them in place)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes the argmax (then greedy rows skip it)."""

    def _index_tensors(self, rows: list[int], cols: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(rows, dtype=torch.long).to(self.device),
                torch.tensor(cols, dtype=torch.long).to(self.device))

    def _check_token_ids(self, name: str, token_ids: Iterable[int]) -> None:
        if self.vocab_size is None:
            return
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids {bad} are out of vocabulary (size {self.vocab_size}).")


class MinTokensLogitsProcessor(LogitsProcessor):
    """Bans every stop token id (EOS included) while `len(output_token_ids) < min_tokens`."""

    def __init__(self, device: torch.device | str = "cpu", vocab_size: Optional[int] = None) -> None:
        super().__init__(device, vocab_size)
        # index -> (min_tokens, live output list, stop ids)
        self.min_toks: dict[int, tuple[int, Sequence[int], set[int]]] = {}
        self.logits_slice = self._index_tensors([], [])

    def is_argmax_invariant(self) -> bool:
        return False

    def _new_state(self, params: SamplingParams, _prompt: Optional[list[int]],
                   output_ids: list[int]) -> Optional[tuple[int, Sequence[int], set[int]]]:
        if not params.min_tokens or len(output_ids) >= params.min_tokens:
            return None
        stop_ids = set(params.all_stop_token_ids)
        if params.eos_token_id is not None:
            stop_ids.add(params.eos_token_id)
        if not stop_ids:
            return None
        self._check_token_ids("min_tokens stop ids", stop_ids)
        return params.min_tokens, output_ids, stop_ids

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        needs_update = process_dict_updates(self.min_toks, batch_update, self._new_state)
        reached = [i for i, (n, out, _) in self.min_toks.items() if len(out) >= n]
        for i in reached:
            del self.min_toks[i]
        if needs_update or reached:
            rows = [i for i, (_, _, ids) in self.min_toks.items() for _ in ids]
            cols = [t for _, (_, _, ids) in self.min_toks.items() for t in ids]
            self.logits_slice = self._index_tensors(rows, cols)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits[self.logits_slice] = float("-inf")
        return logits


def _logit_bias_of(params: SamplingParams) -> Optional[dict[int, float]]:
    bias = getattr(params, "logit_bias", None)
    if bias is None and params.extra_args:
        bias = params.extra_args.get("logit_bias")
    if not bias:
        return None
    try:
        return {int(tok): float(b) for tok, b in bias.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"logit_bias must map token ids to numbers, got logit_bias={bias!r}.") from exc


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds `extra_args["logit_bias"]` ({token id: bias}) to each request's row."""

    def __init__(self, device: torch.device | str = "cpu", vocab_size: Optional[int] = None) -> None:
        super().__init__(device, vocab_size)
        self.biases: dict[int, dict[int, float]] = {}
        self.logits_slice = self._index_tensors([], [])
        self.bias_tensor = torch.empty(0, device=self.device)

    def is_argmax_invariant(self) -> bool:
        return False

    def _new_state(self, params: SamplingParams, _prompt: Optional[list[int]],
                   _output: list[int]) -> Optional[dict[int, float]]:
        bias = _logit_bias_of(params)
        if bias is not None:
            self._check_token_ids("logit_bias", bias)
        return bias

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if not process_dict_updates(self.biases, batch_update, self._new_state):
            return
        rows = [i for i, b in self.biases.items() for _ in b]
        cols = [t for b in self.biases.values() for t in b]
        self.logits_slice = self._index_tensors(rows, cols)
        values = [v for b in self.biases.values() for v in b.values()]
        self.bias_tensor = torch.tensor(values, dtype=torch.float32).to(self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.biases:
            logits.index_put_(self.logits_slice, self.bias_tensor.to(logits.dtype), accumulate=True)
        return logits


RequestLogitsProcessor = Callable[..., torch.Tensor]


def _bind_request_processor(fn: RequestLogitsProcessor, prompt_ids: Optional[list[int]],
                            output_ids: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Pre-fill the token-id arguments: 3 parameters means (prompt, output, logits)."""
    try:
        n_params = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n_params = 2
    if n_params == 3:
        return partial(fn, prompt_ids if prompt_ids is not None else [], output_ids)
    return partial(fn, output_ids)


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs old-style per-request callables row by row.

    By default the callables come from `SamplingParams.logits_processors` (applied in list order);
    subclasses may override `new_req_logits_processor`. The bound callables hold a reference to
    the output-token list given in the `BatchUpdate`.
    """

    def __init__(self, device: torch.device | str = "cpu", vocab_size: Optional[int] = None) -> None:
        super().__init__(device, vocab_size)
        self.req_info: dict[int, list[Callable[[torch.Tensor], torch.Tensor]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Optional[list[RequestLogitsProcessor]]:
        return list(params.logits_processors) if params.logits_processors else None

    def _new_state(self, params: SamplingParams, prompt_ids: Optional[list[int]],
                   output_ids: list[int]) -> Optional[list[Callable[[torch.Tensor], torch.Tensor]]]:
        fns = self.new_req_logits_processor(params)
        if not fns:
            return None
        return [_bind_request_processor(fn, prompt_ids, output_ids) for fn in fns]

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, fns in self.req_info.items():
            original = logits[index]
            row = original
            for fn in fns:
                row = fn(row)
            if row is not original:
                logits[index] = row
        return logits


class LogitsProcessors:
    """The processors of one batch, split as the sampler needs them (vLLM's `LogitsProcessors`)."""

    def __init__(self, processors: Iterable[LogitsProcessor] = ()) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in processors:
            self.add(proc)

    def add(self, proc: LogitsProcessor) -> None:
        target = self.argmax_invariant if proc.is_argmax_invariant() else self.non_argmax_invariant
        target.append(proc)

    @property
    def all(self) -> list[LogitsProcessor]:
        return self.non_argmax_invariant + self.argmax_invariant

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        for proc in self.all:
            proc.update_state(batch_update)


BUILTIN_LOGITS_PROCESSORS: list[type[LogitsProcessor]] = [
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    AdapterLogitsProcessor,
]


def build_logitsprocs(device: torch.device | str = "cpu", vocab_size: Optional[int] = None,
                      custom: Sequence[type[LogitsProcessor] | LogitsProcessor] = ()) -> LogitsProcessors:
    """Built-ins (min-tokens, logit bias, per-request adapter) then `custom` (classes or instances)."""
    procs: list[LogitsProcessor] = [cls(device, vocab_size) for cls in BUILTIN_LOGITS_PROCESSORS]
    for item in custom:
        procs.append(item(device, vocab_size) if isinstance(item, type) else item)
    return LogitsProcessors(procs)


__all__ = [
    "AdapterLogitsProcessor", "AddedRequest", "BatchUpdate", "BUILTIN_LOGITS_PROCESSORS",
    "LogitBiasLogitsProcessor", "LogitsProcessor", "LogitsProcessors", "MinTokensLogitsProcessor",
    "MovedRequest", "MoveDirectionality", "RemovedRequest", "build_batch_update",
    "build_logitsprocs", "process_dict_updates",
]
