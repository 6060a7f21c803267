"""`LLM.get_metrics()`: vLLM's metric objects (v1/metrics/reader.py: `Metric` with `name` and
`labels`; `Counter`, `Gauge`, and `Vector` for the one per-position counter), built from the engine's
`get_stats` (vLLM reads them back from its Prometheus registry; servetwin has none offline)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Metric:
    name: str
    labels: dict[str, str]


@dataclass(slots=True)
class Counter(Metric):
    value: int


@dataclass(slots=True)
class Gauge(Metric):
    value: float


@dataclass(slots=True)
class Vector(Metric):
    """vLLM's ordered array of counters: only `vllm:spec_decode_num_accepted_tokens_per_pos`."""
    values: list[int]


GAUGES = (("vllm:num_requests_running", "num_running"), ("vllm:num_requests_waiting", "num_waiting"),
          ("vllm:kv_cache_usage_perc", "kv_cache_usage"))
COUNTERS = (("vllm:prefix_cache_queries", "prefix_cache_queries"), ("vllm:prefix_cache_hits", "prefix_cache_hits"),
            ("vllm:num_preemptions", "num_preemptions"), ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens"),
            # KV connector (engine_client.kv_connector_totals): vLLM's v1/metrics/loggers.py:685-706 and
            # distributed/kv_transfer/kv_connector/v1/offloading/metrics.py:42-47
            ("vllm:external_prefix_cache_queries", "external_prefix_cache_queries"),
            ("vllm:external_prefix_cache_hits", "external_prefix_cache_hits"),
            ("vllm:kv_offload_load_bytes", "kv_offload_load_bytes"),
            ("vllm:kv_offload_store_bytes", "kv_offload_store_bytes"))
PER_POS = "spec_decode_num_accepted_tokens_per_pos"


def metrics_from_stats(stats: dict[str, Any], model_name: str) -> list[Metric]:
    """The metrics an engine's `get_stats` answer holds (spec decode ones only when it is on)."""
    labels = {"model_name": model_name, "engine": "0"}
    out: list[Metric] = [Gauge(name, dict(labels), float(stats[key])) for name, key in GAUGES if key in stats]
    out += [Counter(name, dict(labels), int(stats[key])) for name, key in COUNTERS if key in stats]
    if PER_POS in stats:
        out.append(Vector(f"vllm:{PER_POS}", dict(labels), list(stats[PER_POS])))
    return out
