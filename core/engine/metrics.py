"""Serving metrics in Prometheus text format with vLLM's metric names (no prometheus_client needed).

Engine-side values come from the `EngineStats` attached to the engine core's outputs (gauges: running /
waiting requests, KV-cache usage; counters kept as totals in the engine: prefix-cache queries and
hits, preemptions), one sample per engine (DP rank) labelled `engine="<rank>"` as vLLM's per-engine
labels; the request-level counters and histograms are the front end's, under `engine="0"`. Request latencies are measured in the front end when outputs arrive, like vLLM:
TTFT = first token - arrival, ITL = time between consecutive outputs of a request, E2E = finish -
arrival, all on the front end's monotonic clock (with a paced `sim` backend they follow simulated
time mapped onto the wall clock). Counter samples get prometheus_client's `_total` suffix.

On the `sim` backend (paced or not) servetwin adds the twin's predictions, from the engine's
simulated clock (`RequestMetrics.predicted_*`, engine boundary): the histograms
`servetwin:predicted_time_to_first_token_seconds`, `servetwin:predicted_inter_token_latency_seconds`
and `servetwin:predicted_e2e_request_latency_seconds`, with vLLM's buckets.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

# vLLM's bucket boundaries (v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


def _fmt(v: float) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    return f"{float(v)!r}"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in labels.items())
    return "{" + body + "}"


class Histogram:
    def __init__(self, buckets: list[float]) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def render(self, name: str, labels: dict[str, str]) -> list[str]:
        lines = []
        cum = 0
        for bound, c in zip(self.bounds + [math.inf], self.counts):
            cum += c
            lines.append(f"{name}_bucket{_labels(dict(labels, le=_fmt(float(bound))))} {_fmt(float(cum))}")
        lines.append(f"{name}_count{_labels(labels)} {_fmt(float(self.count))}")
        lines.append(f"{name}_sum{_labels(labels)} {_fmt(self.sum)}")
        return lines


@dataclass(slots=True)
class _ReqTimes:
    arrival: float
    prompt_tokens: int
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_tokens: int = 0
    sim_last_token: Optional[float] = None


@dataclass(slots=True)
class EngineGauges:
    """One engine's latest scheduler state and its running totals (kept as totals in the engine)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    sim_busy_s: float = 0.0  # sim backend: total predicted duration of the engine's steps
    spec_decode: Any = None  # the latest EngineStats: its spec-decode totals (counters since start)

    def update(self, stats: Any) -> None:
        self.spec_decode = stats
        self.num_running = stats.num_running
        self.num_waiting = stats.num_waiting
        self.kv_cache_usage = stats.kv_cache_usage
        self.prefix_queries = max(self.prefix_queries, stats.prefix_cache_queries)
        self.prefix_hits = max(self.prefix_hits, stats.prefix_cache_hits)
        self.num_preemptions = max(self.num_preemptions, stats.num_preemptions)
        self.num_steps = max(self.num_steps, stats.num_steps)
        self.sim_busy_s = max(self.sim_busy_s, stats.sim_busy_s)


class ServingMetrics:
    """Aggregates engine stats and per-request latencies; `render()` gives the /metrics text."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.engines: dict[int, EngineGauges] = {0: EngineGauges()}  # by DP rank (`engine` label)
        self.sim_time_s = 0.0  # sim backend: simulated time at the end of the latest step sent
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.predicted_ttft = Histogram(TTFT_BUCKETS)
        self.predicted_itl = Histogram(ITL_BUCKETS)
        self.predicted_e2e = Histogram(E2E_BUCKETS)
        self._reqs: dict[str, _ReqTimes] = {}

    # -- engine side --------------------------------------------------------------------------------
    def update_engine(self, stats: Any, engine: int = 0) -> None:
        """The latest `EngineStats` of DP rank `engine` (its samples carry `engine="<rank>"`, as vLLM's)."""
        gauges = self.engines.get(engine)
        if gauges is None:
            gauges = self.engines[engine] = EngineGauges()
        gauges.update(stats)

    # -- requests -----------------------------------------------------------------------------------
    def on_arrival(self, request_id: str, prompt_tokens: int, t: Optional[float] = None) -> None:
        self._reqs[request_id] = _ReqTimes(time.monotonic() if t is None else t, prompt_tokens)

    def on_progress(self, request_id: str, num_tokens: int, finished: bool, finish_reasons: list[Optional[str]],
                    req_metrics: Any, now: float) -> None:
        """A request's state after an engine step: its output tokens so far (all samples), whether it
        finished (and each sample's finish reason), its `RequestMetrics`. Called for every step that
        touched the request, whatever its output kind delivers to the caller."""
        rt = self._reqs.get(request_id)
        if rt is None:
            return
        if num_tokens > rt.num_tokens:
            if rt.first_token is None:
                rt.first_token = now
                self.ttft.observe(now - rt.arrival)
            else:
                self.itl.observe(now - rt.last_token)
            rt.last_token = now
            self.generation_tokens += num_tokens - rt.num_tokens
            rt.num_tokens = num_tokens
            self._on_predicted_token(rt, req_metrics)
        if finished:
            del self._reqs[request_id]
            self.e2e.observe(now - rt.arrival)
            if req_metrics.predicted_e2e_s is not None:
                self.predicted_e2e.observe(req_metrics.predicted_e2e_s)
            self.prompt_tokens += rt.prompt_tokens
            for reason in finish_reasons:
                reason = reason or "abort"
                self.finished[reason] = self.finished.get(reason, 0) + 1

    def _on_predicted_token(self, rt: _ReqTimes, m: Any) -> None:
        t = m.sim_last_token_time
        if t is None:
            return
        if rt.sim_last_token is None:
            if m.predicted_ttft_s is not None:
                self.predicted_ttft.observe(m.predicted_ttft_s)
        elif t > rt.sim_last_token:
            self.predicted_itl.observe(t - rt.sim_last_token)
        rt.sim_last_token = t

    def on_abort(self, request_id: str, num_children: int = 1) -> None:
        rt = self._reqs.pop(request_id, None)
        if rt is not None:
            self.prompt_tokens += rt.prompt_tokens
            self.finished["abort"] = self.finished.get("abort", 0) + num_children

    def _render_spec_decode(self, out: list[str]) -> None:
        """vLLM's spec-decode counters (v1/spec_decode/metrics.py:229-262), once drafting is on, one sample per
        engine (DP rank, `engine="<rank>"`); the per-position one has a `position` label per draft position."""
        ranks = [r for r in sorted(self.engines) if self.engines[r].spec_decode is not None
                 and self.engines[r].spec_decode.spec_decode_num_accepted_tokens_per_pos]
        if not ranks:
            return
        for name, help_, attr in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decode_num_drafts"),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decode_num_draft_tokens"),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                 "spec_decode_num_accepted_tokens")):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} counter")
            for rank in ranks:
                value = getattr(self.engines[rank].spec_decode, attr)
                out.append(f"{name}_total{_labels(dict(self.labels, engine=str(rank)))} {_fmt(float(value))}")
        name = "vllm:spec_decode_num_accepted_tokens_per_pos"
        out.append(f"# HELP {name} Accepted tokens per draft position.")
        out.append(f"# TYPE {name} counter")
        for rank in ranks:
            for pos, n in enumerate(self.engines[rank].spec_decode.spec_decode_num_accepted_tokens_per_pos):
                labels = dict(self.labels, engine=str(rank), position=str(pos))
                out.append(f"{name}_total{_labels(labels)} {_fmt(float(n))}")

    # -- exposition ---------------------------------------------------------------------------------
    def _render_kv_connector(self, out: list[str]) -> None:
        """vLLM's KV-connector counters, once a connector is on, one sample per engine: the external
        prefix cache (v1/metrics/loggers.py:685-706) and the offloading connector's transfer bytes
        (distributed/kv_transfer/kv_connector/v1/offloading/metrics.py:42-47, 82-97; the sim backend counts
        the bytes of the jobs it started)."""
        for name, help_, attr in (
                ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                 "cross-instance cache sharing, in terms of number of queried tokens.", "external_prefix_cache_queries"),
                ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                 "cross-instance cache sharing, in terms of number of cached tokens.", "external_prefix_cache_hits"),
                ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.",
                 "kv_offload_load_bytes"),
                ("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.",
                 "kv_offload_store_bytes")):
            ranks = [r for r in sorted(self.engines) if self.engines[r].spec_decode is not None
                     and getattr(self.engines[r].spec_decode, attr, None) is not None]
            if not ranks:
                continue
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} counter")
            for rank in ranks:
                value = getattr(self.engines[rank].spec_decode, attr)
                out.append(f"{name}_total{_labels(dict(self.labels, engine=str(rank)))} {_fmt(float(value))}")

    def render(self) -> str:
        lb = self.labels
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float, labels: Optional[dict] = None) -> None:
            sample = f"{name}_total" if kind == "counter" else name
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.append(f"{sample}{_labels(labels or lb)} {_fmt(float(value))}")

        def engine_metric(name: str, kind: str, help_: str, attr: str) -> None:
            """One sample per engine (DP rank), labelled `engine="<rank>"` as vLLM labels them."""
            sample = f"{name}_total" if kind == "counter" else name
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for rank in sorted(self.engines):
                value = getattr(self.engines[rank], attr)
                out.append(f"{sample}{_labels(dict(lb, engine=str(rank)))} {_fmt(float(value))}")

        engine_metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                      "num_running")
        engine_metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                      "num_waiting")
        engine_metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                      "kv_cache_usage")
        engine_metric("vllm:prefix_cache_queries", "counter",
                      "Prefix cache queries, in terms of number of queried tokens.", "prefix_queries")
        engine_metric("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
                      "prefix_hits")
        engine_metric("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.",
                      "num_preemptions")
        metric("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", self.prompt_tokens)
        metric("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
               self.generation_tokens)
        engine_metric("servetwin:engine_steps", "counter", "Engine steps run by the engine core.", "num_steps")
        metric("servetwin:simulated_time_seconds", "gauge",
               "Sim backend: simulated time at the end of the latest step whose outputs were sent.", self.sim_time_s)
        engine_metric("servetwin:simulated_busy_seconds", "counter",
                      "Sim backend: total predicted duration of the engine's steps.", "sim_busy_s")
        self._render_spec_decode(out)
        self._render_kv_connector(out)
        out.append("# HELP vllm:request_success Count of successfully processed requests.")
        out.append("# TYPE vllm:request_success counter")
        for reason in sorted(set(self.finished) | {"stop", "length", "abort"}):
            out.append(f"vllm:request_success_total{_labels(dict(lb, finished_reason=reason))} "
                       f"{_fmt(float(self.finished.get(reason, 0)))}")
        for name, help_, hist in (
                ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
                ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
                ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e),
                ("servetwin:predicted_time_to_first_token_seconds",
                 "Sim backend: predicted (simulated) time to first token at the engine.", self.predicted_ttft),
                ("servetwin:predicted_inter_token_latency_seconds",
                 "Sim backend: predicted (simulated) inter-token latency at the engine.", self.predicted_itl),
                ("servetwin:predicted_e2e_request_latency_seconds",
                 "Sim backend: predicted (simulated) e2e request latency at the engine.", self.predicted_e2e)):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            out.extend(hist.render(name, lb))
        return "\n".join(out) + "\n"


def render_engine_health(dead: bool) -> str:
    """`servetwin:engine_dead`: 1 once the engine process died (the server then exits), else 0."""
    return ("# HELP servetwin:engine_dead 1 when the engine process died (the server is about to exit).\n"
            f"# TYPE servetwin:engine_dead gauge\nservetwin:engine_dead {int(dead)}\n")


def parse_prometheus_text(text: str) -> dict[str, float]:
    """`{sample name with labels: value}` from exposition text (for tests and quick checks)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        values[name] = float(value)
    return values


def sample(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of samples called `name` whose labels include `labels`."""
    total, found = 0.0, False
    for key, v in values.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
            found = True
    if not found:
        raise KeyError(name)
    return total
