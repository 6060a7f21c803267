"""Published inference-perf figures on the engine's token basis (`servetwin validate`, cluster cases).

inference-perf (the llm-d reports' harness) counts a streamed completion's output tokens by re-tokenising its
text on the client (`inference_perf/apis/completion.py`), so its output tok/s, TPOT and ITL are per *client*
token; servetwin's are per token the engine decoded. Where the workload fixes the engine's count E (ignore_eos
and a fixed max_tokens: the case's `workload.output_tokens` with `finish: max_tokens`) and published.json
records the report's own client count C for the same figures, the published figure is also put on the engine
basis. Each metric's conversion follows from inference-perf's definitions (`inference_perf/reportgen/base.py`,
`summarize_requests`, over a run's or a stage's successful requests):

- output tok/s = sum of client counts / total_time and requests/s = count / total_time (the same total_time:
  last end - first start), so out_tok_s / req_s = C exactly and the engine's output tok/s is out_tok_s x E / C;
  total tok/s moves by the same output part: tot_tok_s - out_tok_s x (1 - E / C).
- TPOT of a request = (last token's time - first token's time) / (its client count - 1), TTFT = first token's
  time - start, request latency (E2E) = end - start. With E tokens each, the mean TPOT on the engine basis is
  mean(last - first) / (E - 1) = (E2E mean - TTFT mean) / (E - 1); exact up to the time between the last
  token's chunk and the response's end (the stream's closing chunks), which no report gives. It needs neither C
  nor the published TPOT.
- Not convertible: TPOT percentiles (percentiles of per-request ratios whose per-request client counts no report
  gives) and every ITL figure: each re-tokenised token of a chunk gets the chunk's arrival time, so the gaps'
  count depends on how the stream was chunked (the P/D report's ITL mean is its decode span over ~329 tokens per
  request, its output count 282.7). On the engine basis the pooled ITL mean equals the TPOT mean's conversion
  (E tokens per request, each timestamped): it would be the same figure counted twice.
- TTFT, E2E, requests/s and durations count no output tokens: the same on both bases.

The reports do not say which inference-perf version they ran. These conversions hold for every version read:
throughput and requests/s have shared total_time since 2025, TTFT has been the first token's time - start
throughout; TPOT divided the span by the chunk count before kubernetes-sigs/inference-perf#410 (April 2026)
and by the client count since, and the engine-basis TPOT uses neither. Where a version counts the server's
tokens (`use_server_output_tokens`, #577 / #607), C = E and converting changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

# published figures that count output tokens (the rest are the same on both bases)
TOKEN_COUNT_PREFIXES = ("out_tok_s", "tot_tok_s", "tpot", "itl")

NOT_CONVERTIBLE = {
    "tpot": "a percentile of per-request ratios; the report gives no per-request client counts",
    "itl": "token gaps of re-tokenised chunks (every token of a chunk at its arrival time): the count depends "
           "on the chunking, which the report does not give",
}


@dataclass(slots=True, frozen=True)
class Conversion:
    value: Optional[float]  # the figure on the engine basis; None: not converted (the published one stands)
    how: str  # the formula used, or why not


def counts_tokens(metric: str) -> bool:
    return metric.split("@")[0].startswith(TOKEN_COUNT_PREFIXES)


def convert_figures(figures: Mapping[str, float], engine: int, client: Optional[float]) -> dict[str, Conversion]:
    """The engine-basis value of every token-counting figure of one run or stage (its published figures, one
    `{metric: value}`), `engine` tokens decoded per request, `client` counted per request by the report (None:
    not given). Figures that count no tokens are not in the answer (they stand as published)."""
    out: dict[str, Conversion] = {}
    for metric, value in figures.items():
        if metric == "rate" or not counts_tokens(metric):
            continue
        out[metric] = _convert_one(metric, float(value), figures, engine, client)
    return out


def _convert_one(metric: str, value: float, figures: Mapping[str, float], engine: int,
                 client: Optional[float]) -> Conversion:
    if metric in ("out_tok_s", "tot_tok_s"):
        if client is None:
            return Conversion(None, "the report gives no client-side output count per request for these figures")
        ratio = engine / client
        if metric == "out_tok_s":
            return Conversion(value * ratio, f"x {engine} / {client:g} (engine / client tokens per request)")
        if "out_tok_s" not in figures:
            return Conversion(None, "needs out_tok_s of the same figures")
        out_tok_s = float(figures["out_tok_s"])
        return Conversion(value - out_tok_s * (1.0 - ratio), f"- out_tok_s x (1 - {engine} / {client:g})")
    if metric == "tpot_mean":
        if "e2e_mean" not in figures or "ttft_mean" not in figures or engine < 2:
            return Conversion(None, "needs the E2E and TTFT means of the same figures")
        span = float(figures["e2e_mean"]) - float(figures["ttft_mean"])
        return Conversion(span / (engine - 1), f"(E2E mean - TTFT mean) / ({engine} - 1)")
    return Conversion(None, NOT_CONVERTIBLE["itl" if metric.startswith("itl") else "tpot"])


def engine_tokens(workload_spec: Any) -> Optional[int]:
    """Output tokens the engine decodes for every request of a workload, where the workload fixes it (a
    constant `output_tokens`, every request finishing at max_tokens as with ignore_eos); None otherwise."""
    from servetwin.sim.lengths import Fixed  # noqa: PLC0415
    length = getattr(workload_spec, "output_tokens", None)
    if getattr(workload_spec, "finish", None) != "max_tokens" or not isinstance(length, Fixed):
        return None
    cap = getattr(workload_spec, "max_output_tokens", None)
    return int(length.value) if cap is None else min(int(length.value), int(cap))


@dataclass(slots=True)
class BasisCase:
    """One case on the engine basis: its rows with the published figure converted where it can be."""
    name: str
    engine: Optional[int]
    counts: str  # the factor(s) used and their source, or why none
    # (metric, published, published on the engine basis, predicted, how it was converted or why not)
    rows: list[tuple[str, float, Optional[float], Optional[float], str]]


def basis_case(result: Any, entry: Mapping[str, Any], engine: Optional[int]) -> BasisCase:
    """The engine-basis rows of one validated case (`CaseResult`), its published.json entry and the
    engine's fixed count (None: the workload does not fix it, nothing is converted)."""
    basis = entry.get("token_basis") or {}
    figures: dict[str, tuple[Mapping[str, Any], Optional[float]]] = {"": (entry.get("published") or {},
                                                                          basis.get("client_tokens_per_request"))}
    per_stage_counts = {float(s["rate"]): s.get("client_tokens_per_request") for s in basis.get("per_stage") or []}
    for st in (entry.get("stages") or {}).get("per_stage") or []:
        figures[f"@{st['rate']:g}"] = (st, per_stage_counts.get(float(st["rate"])))
    conversions: dict[str, Conversion] = {}
    if engine is not None:
        for suffix, (figs, client) in figures.items():
            conversions.update({m + suffix: c for m, c in convert_figures(figs, engine, client).items()})
    rows = []
    for metric, published, predicted in result.rows:
        if not counts_tokens(metric):
            rows.append((metric, published, published, predicted, "same on both bases"))
            continue
        conv = conversions.get(metric)
        if engine is None:
            conv = Conversion(None, "the workload does not fix the engine's output count")
        elif conv is None:
            conv = Conversion(None, "no conversion")
        rows.append((metric, published, published if conv.value is None else conv.value, predicted,
                     conv.how if conv.value is not None else f"as published: {conv.how}"))
    return BasisCase(result.name, engine, _counts_line(basis, engine) + _tpot_check(figures), rows)


def _tpot_check(figures: Mapping[str, tuple[Mapping[str, Any], Optional[float]]]) -> str:
    """The reading checked on the client basis: (E2E mean - TTFT mean) / (C - 1) against the published TPOT
    mean (they differ by the mean of per-request ratios against the ratio of means, and the stream's end)."""
    notes = []
    for suffix, (figs, client) in figures.items():
        if client and client > 1 and all(k in figs for k in ("tpot_mean", "e2e_mean", "ttft_mean")):
            span = float(figs["e2e_mean"]) - float(figs["ttft_mean"])
            tpot = float(figs["tpot_mean"])
            notes.append(f"check{suffix}: (E2E mean - TTFT mean) / ({client:g} - 1) = {span / (client - 1):.4g} ms "
                         f"against the published TPOT mean {tpot:.4g} ms ({(span / (client - 1) - tpot) / tpot:+.1%})")
    return "".join(f"; {n}" for n in notes)


def _counts_line(basis: Mapping[str, Any], engine: Optional[int]) -> str:
    if engine is None:
        return "not converted: the workload does not fix the engine's output count"
    parts = []
    if "client_tokens_per_request" in basis:
        parts.append(f"{engine} decoded / {basis['client_tokens_per_request']:g} counted per request "
                     f"(source: {basis['source']})")
    for st in basis.get("per_stage") or []:
        parts.append(f"@{st['rate']:g}: {engine} / {st['client_tokens_per_request']:g} (source: {st['source']})")
    if basis.get("not_converted"):
        parts.append(f"output counts not converted: {basis['not_converted']}")
    if not parts:
        parts.append("output counts not converted: published.json gives no token_basis")
    return f"{engine} tokens decoded per request; " + "; ".join(parts)


def engine_basis_results(case_dir: str | Path, results: list[Any], overrides: Optional[list[str]] = None
                         ) -> list[BasisCase]:
    """`basis_case` of every validated case that ran (the engine's count read from its YAML)."""
    from servetwin.experiments.config.schema import load_config  # noqa: PLC0415
    from servetwin.experiments.validate.published import load_published  # noqa: PLC0415
    cases, published = load_published(case_dir)
    out = []
    for r in results:
        if r.error or r.pending:
            continue
        spec = load_config(cases[r.name], overrides=list(overrides or [])).workload.spec
        out.append(basis_case(r, published[r.name], engine_tokens(spec)))
    return out


def _error(predicted: Optional[float], reference: Optional[float]) -> Optional[float]:
    return None if predicted is None or not reference else (predicted - reference) / reference


def _median_abs(errors: list[float]) -> Optional[float]:
    return float(np.median(np.abs(errors))) if errors else None


def _group_errors(rows: list[tuple[str, float, Optional[float], Optional[float], str]], on_engine_basis: bool
                  ) -> dict[str, list[float]]:
    """Signed errors per group against the published figure as published or on the engine basis."""
    from servetwin.experiments.validate.published import GROUPS, metric_group  # noqa: PLC0415
    per: dict[str, list[float]] = {g: [] for g in GROUPS}
    for metric, published, basis, predicted, _ in rows:
        reference = basis if on_engine_basis else published
        err = _error(predicted, reference)
        if err is not None:
            per[metric_group(metric)].append(err)
    return per


def render_engine_basis(cases: list[BasisCase]) -> str:
    """The engine-basis section of `servetwin validate`: the token-counting figures on both bases, then the
    median |error| per group on both bases for the whole folder and per case (Markdown)."""
    from servetwin.experiments.validate.published import GROUPS, format_num, format_pct  # noqa: PLC0415
    lines = ["Output tokens per request (engine: decoded, fixed by the workload; client: counted by the report's "
             "harness, which re-tokenises the streamed text):"]
    lines += [f"- {c.name}: {c.counts}" for c in cases]
    converted = [c for c in cases if any(_converted(r) for r in c.rows)]
    lines += ["", "Figures that count output tokens, in the cases where any is converted (the other figures are the "
              "same on both bases; the other cases' stand as published, for the reasons above):", "",
              "| case | metric | as published | engine-token basis | predicted | error as published | "
              "error, engine-token basis | conversion |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for c in converted:
        for metric, pub, basis, pred, how in c.rows:
            if counts_tokens(metric):
                lines.append(f"| {c.name} | {metric} | {format_num(pub)} | {format_num(basis)} | {format_num(pred)} | "
                             f"{format_pct(_error(pred, pub))} | {format_pct(_error(pred, basis))} | {how} |")
    lines += ["", "| median abs error | group | as published | engine-token basis | figures (converted) |",
              "|---|---|---:|---:|---:|"]
    scopes = [("whole folder", [r for c in cases for r in c.rows])] + [(c.name, c.rows) for c in cases]
    for scope, rows in scopes:
        as_pub, on_basis = _group_errors(rows, False), _group_errors(rows, True)
        for g in GROUPS:
            if not as_pub[g]:
                continue
            n_converted = sum(1 for r in rows if r[3] is not None and _converted(r) and _same_group(r[0], g))
            lines.append(f"| {scope} | {g} | {format_pct(_median_abs(as_pub[g]), signed=False)} | "
                         f"{format_pct(_median_abs(on_basis[g]), signed=False)} | "
                         f"{len(as_pub[g])} ({n_converted}) |")
    return "\n".join(lines)


def _converted(row: tuple[str, float, Optional[float], Optional[float], str]) -> bool:
    return counts_tokens(row[0]) and not row[4].startswith("as published")


def _same_group(metric: str, group: str) -> bool:
    from servetwin.experiments.validate.published import metric_group  # noqa: PLC0415
    return metric_group(metric) == group
