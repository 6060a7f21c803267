"""Turns `EngineCoreOutput`s into `RequestOutput`s: detokenisation, stop strings, n > 1 aggregation.

What a request gets follows its `SamplingParams.output_kind`, as in vLLM: CUMULATIVE (the default) the
whole text and token ids so far at every step, DELTA only what is new since the last output (the server's
streams: O(new tokens) per step instead of a copy of the whole output), FINAL_ONLY one output when the
request finished (the server's non-streaming requests)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from servetwin.core.engine.detokenizer import IncrementalDetokenizer
from servetwin.core.outputs import EngineCoreOutput, Logprobs
from servetwin.core.request import FinishReason
from servetwin.core.engine.request_output import CompletionOutput, RequestMetrics, RequestOutput
from servetwin.core.sampling_params import RequestOutputKind, SamplingParams

# (parent request id, output tokens so far over all samples, finished, each sample's finish reason (when
# finished, else empty), RequestMetrics): what `ServingMetrics.on_progress` takes, for every step that
# touched the request
ProgressObserver = Callable[[str, int, bool, list, Any], None]


def logprobs_to_dict(lp: Logprobs) -> dict[int, float]:
    return dict(zip(lp.token_ids, lp.logprobs))


@dataclass(slots=True)
class ChildState:
    request_id: str
    parent_id: str
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    logprobs: Optional[list[dict[int, float]]] = None
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    sent_text: int = 0  # DELTA: characters / tokens already delivered, whether the finish was
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass(slots=True)
class ParentState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.children[0].params.output_kind

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.detok.token_ids) for c in self.children)


def _sim_update(parent: ParentState, out: EngineCoreOutput, sim_time_s: float,
                sim_arrivals: Optional[dict[str, float]]) -> None:
    """Simulated arrival and token times of a parent request (the predicted latencies follow)."""
    m = parent.metrics
    if m.sim_arrival_time is None and sim_arrivals:
        stamps = [sim_arrivals.pop(c.request_id) for c in parent.children if c.request_id in sim_arrivals]
        if stamps:
            m.sim_arrival_time = min(stamps)
    if out.new_token_ids:
        if m.sim_first_token_time is None:
            m.sim_first_token_time = sim_time_s
            if m.sim_arrival_time is not None:
                m.predicted_ttft_s = sim_time_s - m.sim_arrival_time
        m.sim_last_token_time = sim_time_s


def _sim_finish(parent: ParentState, sim_time_s: float) -> None:
    m = parent.metrics
    m.sim_finished_time = sim_time_s
    if m.sim_arrival_time is not None:
        m.predicted_e2e_s = sim_time_s - m.sim_arrival_time
    n = sum(len(c.detok.token_ids) for c in parent.children)
    samples = len(parent.children)
    if m.sim_first_token_time is not None and n > samples:
        m.predicted_tpot_s = (sim_time_s - m.sim_first_token_time) / (n / samples - 1)


def _completion(c: ChildState, text: str, from_char: int = 0, from_token: int = 0) -> CompletionOutput:
    """A sample's output from its `from_char`-th character and `from_token`-th token on (0, 0: all of it,
    CUMULATIVE; the delivered counts: DELTA). The lists are new (slices): the caller may extend them."""
    return CompletionOutput(index=c.index, text=text[from_char:], token_ids=c.detok.token_ids[from_token:],
                            cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                            logprobs=c.logprobs[from_token:] if c.logprobs is not None else None,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}

    def add_request(self, parent_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    children: list[tuple[str, SamplingParams]], arrival_time: Optional[float] = None) -> None:
        if parent_id in self.parents:
            raise ValueError(f"request_id: duplicate request id {parent_id!r}")
        parent = ParentState(parent_id, prompt, prompt_token_ids)
        parent.metrics.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        for i, (cid, params) in enumerate(children):
            child = ChildState(cid, parent_id, i, params,
                               IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids),
                               logprobs=[] if params.logprobs is not None else None)
            parent.children.append(child)
            self.children[cid] = child
        self.parents[parent_id] = parent

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [c.request_id for c in parent.children if c.finish_reason is None] if parent else []

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput], sim_time_s: Optional[float] = None,
                        sim_arrivals: Optional[dict[str, float]] = None,
                        observe: Optional[ProgressObserver] = None) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated parents' outputs (as their output kind asks: a FINAL_ONLY request only
        when it finished), and child ids the engine must abort (stop strings).

        `sim_time_s` (sim backend): the simulated end of the step that computed `outputs`;
        `sim_arrivals`: engine request id -> simulated arrival (entries of these requests are taken);
        `observe`: called for every parent these outputs touched (metrics), whatever it is delivered."""
        touched: dict[str, ParentState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            child = self.children.get(out.request_id)
            if child is None or child.finish_reason is not None:
                continue
            parent = self.parents[child.parent_id]
            if sim_time_s is not None:
                _sim_update(parent, out, sim_time_s, sim_arrivals)
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None if lp is None else logprobs_to_dict(lp)
                                          for lp in out.new_prompt_logprobs]
            if out.new_token_ids and parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.num_cached_tokens = out.num_cached_tokens
            n_before = len(child.detok.token_ids)
            stopped_by_string = child.detok.update(out.new_token_ids)
            kept = len(child.detok.token_ids) - n_before
            if child.logprobs is not None and out.new_logprobs:
                # the sampled token is the output token itself (`Logprobs.sampled_rank` is its rank in
                # the vocabulary, 1-based as in vLLM, not an index into `token_ids`)
                for tid, lp in zip(out.new_token_ids[:kept], out.new_logprobs[:kept]):
                    d = logprobs_to_dict(lp)
                    child.logprobs.append(d)
                    if tid in d:
                        child.cumulative_logprob += d[tid]
            if stopped_by_string:
                child.finish_reason = str(FinishReason.STOP)
                child.stop_reason = child.detok.stop_reason
                if out.finish_reason is None:
                    to_abort.append(child.request_id)
            elif out.finish_reason is not None:
                child.finish_reason = str(FinishReason(out.finish_reason))
                child.stop_reason = out.stop_reason
            if child.finish_reason is not None:
                self.children.pop(child.request_id, None)
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                if sim_time_s is not None:
                    _sim_finish(parent, sim_time_s)
            if observe is not None:
                observe(parent.request_id, parent.num_output_tokens, finished,
                        [c.finish_reason for c in parent.children] if finished else [], parent.metrics)
            kind = parent.output_kind
            if kind == RequestOutputKind.DELTA:
                delta = self._make_delta(parent, finished)
                if delta.outputs or finished:
                    results.append(delta)
            elif finished or kind != RequestOutputKind.FINAL_ONLY:
                results.append(self._make_output(parent, finished))
            if finished:
                del self.parents[parent.request_id]
        return results, to_abort

    def abort(self, parent_id: str) -> list[str]:
        parent = self.parents.pop(parent_id, None)
        if parent is None:
            return []
        ids = []
        for c in parent.children:
            if c.finish_reason is None:
                ids.append(c.request_id)
            self.children.pop(c.request_id, None)
        return ids

    def _make_output(self, parent: ParentState, finished: bool) -> RequestOutput:
        completions = [_completion(c, c.detok.visible_text(c.finish_reason is not None)) for c in parent.children]
        return self._request_output(parent, completions, finished)

    def _make_delta(self, parent: ParentState, finished: bool) -> RequestOutput:
        """What is new since the last output of each sample: text, token ids, logprobs, and its finish
        (once). Samples with nothing new are left out; `RequestOutput.add` merges consecutive deltas."""
        completions = []
        for c in parent.children:
            done = c.finish_reason is not None
            text = c.detok.visible_text(done)
            n_ids = len(c.detok.token_ids)
            if len(text) == c.sent_text and n_ids == c.sent_tokens and (c.sent_finish or not done):
                continue
            completions.append(_completion(c, text, c.sent_text, c.sent_tokens))
            c.sent_text, c.sent_tokens, c.sent_finish = len(text), n_ids, done
        return self._request_output(parent, completions, finished)

    @staticmethod
    def _request_output(parent: ParentState, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids, outputs=completions, finished=finished,
                             prompt_logprobs=parent.prompt_logprobs,
                             num_cached_tokens=parent.metrics.num_cached_tokens, metrics=parent.metrics)
