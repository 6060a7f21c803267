"""vLLM-shaped results: `RequestOutput` with one `CompletionOutput` per sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, float]]] = None  # per token: {token id: logprob}
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | ...
    stop_reason: Optional[int | str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Host times (`time.monotonic()` in the front end, like vLLM) and, on the `sim` backend, the
    twin's predictions: simulated times (`sim_*`, seconds on the engine's simulated clock,
    `servetwin.core.engine.sim_clock`) and the predicted latencies they give (`predicted_*`, at the
    engine boundary: from the request reaching the engine to its tokens being computed). The
    predictions are None on the other backends."""
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0
    sim_arrival_time: Optional[float] = None
    sim_first_token_time: Optional[float] = None
    sim_last_token_time: Optional[float] = None
    sim_finished_time: Optional[float] = None
    predicted_ttft_s: Optional[float] = None
    predicted_e2e_s: Optional[float] = None
    predicted_tpot_s: Optional[float] = None  # (finish - first token) / (output tokens - 1), all samples


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, later: "RequestOutput") -> None:
        """Merge the DELTA output that followed this one (vLLM's `RequestOutput.add`, used when the
        consumer had not taken this one yet): text and token ids appended per sample, the newer
        finish, metrics and cached-token count kept."""
        by_index = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            old.text += new.text
            old.token_ids.extend(new.token_ids)  # a delta's lists are its own (slices): extended in place
            if new.logprobs is not None:
                if old.logprobs is None:
                    old.logprobs = []
                old.logprobs.extend(new.logprobs)
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
