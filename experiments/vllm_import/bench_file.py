"""Result files of serving benchmark clients, parsed once into `BenchRecord`s.

Three shapes, told apart by their keys (one JSON object, or one object per line):

- vLLM's `benchmarks/benchmark_serving.py` / `vllm bench serve --save-result` (every version seen:
  0.5 to 0.25; `vllm bench sweep` adds `run_number` and the serve parameters it swept, e.g.
  `max_num_seqs`). Pre-2025 files and `--save-detailed` ones carry per-request `input_lens`,
  `output_lens`, `ttfts`, `itls` (seconds), `errors`;
- SGLang's `bench_serving` JSONL (no `num_prompts`; `random_input_len` / `random_range_ratio`);
- InferenceMAX's aggregated result (`utils/process_result.py`: `hw`, `tp`, `conc`, `*_per_gpu`
  throughputs, the `*_ms` latencies renamed without the suffix and in seconds).

Differences handled (all seen in real files, tests/data/README): `request_rate` is the string "inf" or
a number; `max_concurrency` null or an int; the upstream typo key `"request_goodput:"`; `*_e2el_ms`
only with `--percentile-metrics e2el`; LambdaLabs' non-upstream `*_latency_ms` (the same end-to-end
latency); successful requests with `output_lens` 0. Summary figures are milliseconds (`*_ms`),
seconds (`duration`) and per-second rates; every bad or missing field is a `ConfigError` naming it.
"""
from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import (MAX_IMPORT_NUMBER, MAX_TOKENS_PER_REQUEST, bounded_number, load_json_text, printable,
                                   read_import_text)

# (file key stem, published metric head): `{mean,median,p99}_{stem}_ms` -> `{head}_{mean,p50,p99}`
_LATENCY_STEMS = (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2el", "e2e"), ("latency", "e2e"),
                  ("e2e_latency", "e2e"))
_STATS = (("mean", "mean"), ("median", "p50"), ("p99", "p99"))
_RATES = (("request_throughput", "req_s"), ("output_throughput", "out_tok_s"),
          ("total_token_throughput", "tot_tok_s"), ("duration", "dur_s"))
CLIENTS = ("vllm", "sglang", "inferencemax")


@dataclass(slots=True)
class DetailedRequests:
    """Per-request arrays of a detailed result, in the client's request order."""
    input_lens: list[int]
    output_lens: list[int]
    ttfts_s: list[float]
    errors: list[str]

    @property
    def failed(self) -> list[int]:
        return [i for i, e in enumerate(self.errors) if e]


@dataclass(slots=True)
class BenchRecord:
    where: str  # the file, with `:LINE` for one record of a JSONL file
    client: str  # one of CLIENTS
    backend: Optional[str]
    endpoint_type: Optional[str]
    date: Optional[str]
    model_id: Optional[str]
    num_prompts: Optional[int]
    completed: Optional[int]
    request_rate: float  # math.inf: all at once
    burstiness: float  # gamma shape of the arrival gaps (1.0: Poisson)
    max_concurrency: Optional[int]
    duration_s: Optional[float]
    total_input_tokens: Optional[int]
    total_output_tokens: Optional[int]
    metrics: dict[str, float]  # published metric name (servetwin.experiments.validate.published) -> value
    dataset_name: Optional[str] = None
    random_input_len: Optional[int] = None
    random_output_len: Optional[int] = None
    random_range_ratio: Optional[float] = None
    tensor_parallel_size: Optional[int] = None
    hardware_name: Optional[str] = None  # what the file calls the GPU (InferenceMAX's `hw`)
    engine: dict[str, Any] = field(default_factory=dict)  # serve parameters the file records (a sweep's)
    detailed: Optional[DetailedRequests] = None
    notes: list[str] = field(default_factory=list)


# Bounds on a result file's figures, checked before anything is built from them: request counts as a
# run allows (servetwin.sim.workload.MAX_REQUESTS), lengths as one request may have, rates a client can send.
MAX_COUNT = 10_000_000  # num_prompts, completed, max_concurrency, per-request arrays
MIN_REQUEST_RATE = 1e-6  # requests/s (one in 11.6 days); "inf" is all at once
MAX_REQUEST_RATE = 1e9


def _num(rec: dict, key: str, where: str, required: bool = False, high: float = MAX_IMPORT_NUMBER,
         integer: bool = False) -> Optional[float]:
    v = rec.get(key)
    if v is None:
        if required:
            raise ConfigError(f"{where}.{key}", "required field is missing")
        return None
    return bounded_number(v, f"{where}.{key}", high=high, integer=integer)


def _count(rec: dict, key: str, where: str, required: bool = False, high: float = MAX_IMPORT_NUMBER) -> Optional[int]:
    v = _num(rec, key, where, required, high=high, integer=True)
    return None if v is None else int(v)


def _request_rate(rec: dict, where: str) -> float:
    v = rec.get("request_rate", "inf")
    if isinstance(v, str) and v.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(v, str):
        raise ConfigError(f"{where}.request_rate", f"must be a number or \"inf\", got {printable(repr(v), 40)}")
    return bounded_number(v, f"{where}.request_rate", low=MIN_REQUEST_RATE, high=MAX_REQUEST_RATE)


def _int_list(rec: dict, key: str, where: str) -> list[int]:
    v = rec.get(key)
    if not isinstance(v, list):
        raise ConfigError(f"{where}.{key}", f"must be a list of integers, got {type(v).__name__}")
    if len(v) > MAX_COUNT:
        raise ConfigError(f"{where}.{key}", f"{len(v)} entries, more than the limit of {MAX_COUNT:,} requests")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_TOKENS_PER_REQUEST:
            raise ConfigError(f"{where}.{key}[{i}]", f"must be an integer in [0, {MAX_TOKENS_PER_REQUEST}] "
                                                     f"(tokens of one request), got {printable(repr(x), 40)}")
    return v


def _detailed(rec: dict, where: str) -> Optional[DetailedRequests]:
    if "input_lens" not in rec and "output_lens" not in rec:
        return None
    ins, outs = _int_list(rec, "input_lens", where), _int_list(rec, "output_lens", where)
    n = len(ins)
    ttfts = rec.get("ttfts", [0.0] * n)
    errors = rec.get("errors", [""] * n)
    for key, arr in (("output_lens", outs), ("ttfts", ttfts), ("errors", errors)):
        if not isinstance(arr, list) or len(arr) != n:
            got = len(arr) if isinstance(arr, list) else type(arr).__name__
            raise ConfigError(f"{where}.{key}", f"must be a list as long as input_lens ({n}), got {got}")
    for i, t in enumerate(ttfts):
        bounded_number(t, f"{where}.ttfts[{i}]")  # seconds
    return DetailedRequests(ins, outs, [float(t) for t in ttfts], [str(e or "") for e in errors])


def _latency_metrics(rec: dict, where: str, scale: float, suffix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for stem, head in _LATENCY_STEMS:
        for stat, name in _STATS:
            v = _num(rec, f"{stat}_{stem}{suffix}", where)
            if v is not None and f"{head}_{name}" not in out:
                out[f"{head}_{name}"] = v * scale
    return out


def client_of(rec: dict) -> str:
    if "tput_per_gpu" in rec and "hw" in rec:
        return "inferencemax"
    if "num_prompts" not in rec and ("random_input_len" in rec or "total_output_tokens_retokenized" in rec):
        return "sglang"
    return "vllm"


def parse_record(rec: Any, where: str) -> BenchRecord:
    """One result object -> `BenchRecord` (ConfigError naming `where.<field>` on bad input)."""
    if not isinstance(rec, dict):
        raise ConfigError(where, f"must be a JSON object (one benchmark result), got {type(rec).__name__}")
    client = client_of(rec)
    if client == "inferencemax":
        return _inferencemax(rec, where)
    metrics = _latency_metrics(rec, where, 1.0, "_ms")
    for key, name in _RATES:
        v = _num(rec, key, where)
        if v is not None:
            metrics[name] = v
    notes = []
    if "mean_latency_ms" in rec and "mean_e2el_ms" not in rec:
        notes.append("e2e_*: the file's *_latency_ms (not an upstream vLLM key; the request's end-to-end latency)")
    concurrency = rec.get("max_concurrency")
    if concurrency is not None:
        concurrency = _count(rec, "max_concurrency", where, high=MAX_COUNT)
    burst = _num(rec, "burstiness", where)
    record = BenchRecord(
        where=where, client=client, backend=_str(rec, "backend"), endpoint_type=_str(rec, "endpoint_type"),
        date=_str(rec, "date"), model_id=_str(rec, "model_id"), num_prompts=_count(rec, "num_prompts", where, high=MAX_COUNT),
        completed=_count(rec, "completed", where, required=True, high=MAX_COUNT), request_rate=_request_rate(rec, where),
        burstiness=1.0 if burst is None else burst, max_concurrency=concurrency,
        duration_s=_num(rec, "duration", where, required=True),
        total_input_tokens=_count(rec, "total_input_tokens", where, required=True),
        total_output_tokens=_count(rec, "total_output_tokens", where, required=True), metrics=metrics,
        dataset_name=_str(rec, "dataset_name"),
        random_input_len=_count(rec, "random_input_len", where, high=MAX_TOKENS_PER_REQUEST),
        random_output_len=_count(rec, "random_output_len", where, high=MAX_TOKENS_PER_REQUEST),
        random_range_ratio=_num(rec, "random_range_ratio", where), detailed=_detailed(rec, where), notes=notes)
    if record.burstiness <= 0:
        raise ConfigError(f"{where}.burstiness", f"must be > 0, got {rec.get('burstiness')!r}")
    if "max_num_seqs" in rec:  # `vllm bench sweep serve` appends the serve parameters it swept
        record.engine["max_num_seqs"] = _count(rec, "max_num_seqs", where, high=MAX_COUNT)
    if record.completed == 0:
        raise ConfigError(f"{where}.completed", "no request completed: nothing to compare")
    return record


def _str(rec: dict, key: str) -> Optional[str]:
    v = rec.get(key)
    return v if isinstance(v, str) and v else None


def _inferencemax(rec: dict, where: str) -> BenchRecord:
    """InferenceMAX's aggregated file: per-GPU throughputs (x tp) and latencies in seconds; no request
    count, lengths or duration (they come from flags)."""
    tp = _count(rec, "tp", where, required=True, high=4096)
    if not tp:
        raise ConfigError(f"{where}.tp", "must be >= 1")
    metrics = _latency_metrics(rec, where, 1000.0, "")
    for key, name in (("tput_per_gpu", "tot_tok_s"), ("output_tput_per_gpu", "out_tok_s")):
        v = _num(rec, key, where)
        if v is not None:
            metrics[name] = v * tp
    return BenchRecord(
        where=where, client="inferencemax", backend=_str(rec, "framework"), endpoint_type=None, date=None,
        model_id=_str(rec, "model"), num_prompts=None, completed=None, request_rate=math.inf, burstiness=1.0,
        max_concurrency=_count(rec, "conc", where, high=MAX_COUNT), duration_s=None, total_input_tokens=None,
        total_output_tokens=None, metrics=metrics, tensor_parallel_size=tp, hardware_name=_str(rec, "hw"),
        notes=["InferenceMAX aggregate: tot_tok_s / out_tok_s are tput_per_gpu x tp"])


def load_bench_file(path: str | Path) -> list[BenchRecord]:
    """Every result record of a file: one JSON object (any indentation) or JSON lines (one run each),
    read through `core.limits` (regular file, size and inflated-size limits, nesting, UTF-8, digits)."""
    p = Path(path)
    text = read_import_text(path, p.name)
    if not text.strip():
        raise ConfigError(str(path), "is empty")
    lines = _jsonl(text, p)
    if lines is not None:
        return [parse_record(rec, f"{p.name}:{line}") for line, rec in lines]
    whole = load_json_text(text, path, p.name)
    if isinstance(whole, list):  # a list of runs
        return [parse_record(rec, f"{p.name}[{i}]") for i, rec in enumerate(whole)]
    return [parse_record(whole, p.name)]


def _jsonl(text: str, path: Path) -> Optional[list[tuple[int, Any]]]:
    """JSON lines (one object a line, at least two lines, the first a whole object), else None (one
    document, possibly indented, parsed whole). Lines are iterated, never listed (256 MB of newlines
    would be a list of 256M strings)."""
    lines = ((number, line) for number, line in enumerate(io.StringIO(text), start=1) if line.strip())
    first = next(lines, None)
    if first is None or not first[1].lstrip().startswith("{") or not first[1].rstrip().endswith("}"):
        return None
    second = next(lines, None)
    if second is None:
        return None
    try:
        out = [(first[0], load_json_text(first[1], path, path.name))]
    except ConfigError:
        return None  # not one object on its own: the whole-document parse names the problem
    for number, line in itertools.chain([second], lines):
        out.append((number, load_json_text(line, f"{path}:{number}", f"{path.name}:{number}")))
    return out
