"""A servetwin run's results in `vllm bench serve --save-result --save-detailed`'s JSON shape
(`servetwin run ... --save-vllm-bench FILE`), so scripts written for vLLM's files read servetwin's too.

Keys as vLLM 0.2x writes them: the run's setup (`backend` is `servetwin-<backend>`, `request_rate`
"inf" for an offline batch or a closed loop, `max_concurrency` the closed loop's clients), the
totals and throughputs, `{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms`, and the per-request arrays
`input_lens`, `output_lens`, `ttfts` (seconds), `errors`. TTFT, TPOT and E2E come from the run's request
table (client boundary, as vLLM's client measures them); ITL from the run's summary (its mean, median
and p99; no std). Per-request `itls` are not written (the tables keep ITLs pooled, not per request).
"""
from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

import numpy as np


def _stats(values: np.ndarray, head: str) -> dict[str, float]:
    v = values[np.isfinite(values)] * 1000.0
    if not v.size:
        return {}
    return {f"mean_{head}_ms": float(v.mean()), f"median_{head}_ms": float(np.median(v)),
            f"std_{head}_ms": float(v.std()), f"p99_{head}_ms": float(np.percentile(v, 99))}


def _setup(exp: Any) -> dict[str, Any]:
    arrival = exp.workload.arrival
    kind = type(arrival).__name__
    rate: Any = "inf"
    burstiness, concurrency = 1.0, None
    if kind in ("Poisson", "Gamma"):
        rate = float(arrival.rate)
        burstiness = 1.0 / float(arrival.cv) ** 2 if kind == "Gamma" else 1.0
    elif kind == "ClosedLoop":
        concurrency = int(arrival.clients)
    return {"request_rate": rate, "burstiness": burstiness, "max_concurrency": concurrency}


def bench_document(exp: Any, backend: str, requests, summary: dict[str, Any]) -> dict[str, Any]:
    done = requests.finish_reason.notna() & (requests.finish_reason != "abort")
    ok = requests[done]
    dur = float(summary.get("duration_s") or 0.0)
    tin, tout = int(ok.prompt_tokens.sum()), int(ok.output_tokens.sum())
    doc: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S"), "endpoint_type": "servetwin",
        "backend": f"servetwin-{backend}", "label": exp.name, "model_id": str(exp.model), "tokenizer_id": str(exp.model),
        "num_prompts": int(len(requests)), **_setup(exp), "duration": dur, "completed": int(done.sum()),
        "failed": int((~done).sum()), "total_input_tokens": tin, "total_output_tokens": tout,
        "request_throughput": done.sum() / dur if dur else None, "output_throughput": tout / dur if dur else None,
        "total_token_throughput": (tin + tout) / dur if dur else None}
    doc.update(_stats(ok.ttft_s.to_numpy(dtype=float), "ttft"))
    doc.update(_stats(ok.tpot_s.to_numpy(dtype=float), "tpot"))
    itl = summary.get("itl_s") or {}
    if itl.get("mean") is not None:
        doc.update({"mean_itl_ms": 1000 * itl["mean"], "median_itl_ms": 1000 * itl["p50"],
                    "p99_itl_ms": 1000 * itl["p99"]})
    doc.update(_stats(ok.e2e_s.to_numpy(dtype=float), "e2el"))
    doc.update({"input_lens": [int(x) for x in requests.prompt_tokens],
                "output_lens": [int(x) if d else 0 for x, d in zip(requests.output_tokens, done)],
                "ttfts": [float(t) if d and math.isfinite(t) else 0.0 for t, d in zip(requests.ttft_s, done)],
                "errors": ["" if d else str(r or "aborted") for d, r in zip(done, requests.finish_reason)]})
    return doc


def write_vllm_bench(exp: Any, run_dir: str | Path, path: str | Path) -> list[Path]:
    """One file per backend of a finished run folder (`path` itself for one backend, else
    `<stem>.<backend>.json`)."""
    import pandas as pd  # noqa: PLC0415

    from servetwin.core.testbed.atomic import atomic_open  # noqa: PLC0415

    run = Path(run_dir)
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    backends = list(summary["backends"])
    out = []
    for backend in backends:
        target = Path(path) if len(backends) == 1 else Path(path).with_suffix(f".{backend}.json")
        requests = pd.read_parquet(run / backend / "requests.parquet")
        doc = bench_document(exp, backend, requests, summary["backends"][backend])
        with atomic_open(str(target)) as f:
            json.dump(doc, f)
        out.append(target)
    return out
