"""Whether a `calibrate --from-vllm` fit on bench files reaches its own files, and if not, which term.

A fit passes when every case runs and its in-sample TPOT and request throughput are within
`FIT_BOUND` of the file's. A fit that fails writes nothing: `FitFailed` says, per failing case,
the errors, what bounds the fitted run (servetwin.experiments.run.binding) and the term the fit cannot
move:

- the case does not run (a model that does not fit the GPUs, ...): the run's error;
- the modelled API server bounds the run: the front end (docs/frontend_model.md), which the bench fit
  does not search. The check measures it: the same case with requests reaching the engine at the
  file's own request rate and no API server gives the engine's TPOT alone; when that one is within the
  bound, the engine terms are right and the front end's admission is the term;
- otherwise the engine's step terms: the searched parameters at the edge of their ranges are named.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional

FIT_BOUND = 0.15  # |in-sample error| a fit must reach on TPOT and request throughput
TPOT_METRICS = ("tpot_p50", "tpot_mean", "itl_p50", "itl_mean")  # the first one a file has
THROUGHPUT_METRICS = ("req_s", "out_tok_s", "dur_s", "lat_ms")


class FitFailed(Exception):
    """The fit missed its own files: nothing is written; the message names the term."""


def checked_errors(errors: dict[str, float]) -> dict[str, float]:
    """{metric: signed error} of the TPOT and the throughput figure the check uses (the first each file has)."""
    out = {}
    for group in (TPOT_METRICS, THROUGHPUT_METRICS):
        for m in group:
            if m in errors:
                out[m] = errors[m]
                break
    return out


def failures(results) -> list[tuple[Any, dict[str, float]]]:
    """(CaseResult, its checked errors) for every case that did not run or is past `FIT_BOUND`."""
    out = []
    for r in results:
        errs = checked_errors(r.errors())
        if r.error or not errs or any(not math.isfinite(e) or abs(e) > FIT_BOUND for e in errs.values()):
            out.append((r, errs))
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def at_bounds(values: dict[tuple[str, str], float], params: list) -> list[str]:
    """The searched parameters that ended at an edge of their range (the fit wanted to go further)."""
    out = []
    for section, name, lo, hi in params:
        v = values.get((section, name))
        if v is not None and (math.isclose(v, lo, rel_tol=1e-6) or math.isclose(v, hi, rel_tol=1e-6)):
            out.append(f"{name} = {v:.4g} (range {lo:g}..{hi:g})")
    return out


def _slow_edge(values: dict[tuple[str, str], float], param: tuple) -> bool:
    """A parameter at the end of its range that makes steps slower (a low efficiency, a high CPU cost, a
    large half-efficiency row count)."""
    section, name, lo, hi = param
    higher_is_slower = section != "efficiency" or "half" in name
    return math.isclose(values[(section, name)], hi if higher_is_slower else lo, rel_tol=1e-6)


def engine_alone(path: Path, hardware: Any, published: dict[str, float], engine_version: Any) -> Optional[float]:
    """The engine's TPOT p50 (s) when requests reach it at the file's request rate without an API server
    (None: the file has no request rate)."""
    from servetwin.experiments.validate.published import run_case  # noqa: PLC0415

    rate = published.get("req_s")
    if not rate:
        return None
    overrides = [f"workload.arrival={{type: poisson, rate: {rate:.6g}}}", "frontend={type: offline}"]
    summary, _ = run_case(path, hardware, overrides, engine_version)
    return (summary.get("engine_tpot_s") or summary.get("tpot_s") or {}).get("p50")


def diagnose(result, errs: dict[str, float], case_dir: Path, hardware: Any, published: dict[str, Any],
             values: dict[tuple[str, str], float], params: list) -> str:
    """One paragraph for a failing case: its errors, what bounds the run, the term the fit cannot move."""
    from servetwin.experiments.run.binding import binding_resource  # noqa: PLC0415
    from servetwin.experiments.validate.published import run_case  # noqa: PLC0415

    head = f"{result.name}: " + (", ".join(f"{m} {_pct(e)}" for m, e in errs.items()) or "no TPOT or throughput")
    if result.error:
        return f"{head}: the case does not run ({result.error}); term: the setup, not a coefficient"
    entry = published[result.name]
    path = case_dir / "cases" / f"{result.name}.yaml"
    summary, _ = run_case(path, hardware, None, entry.get("engine_version"))
    bound = binding_resource(summary, None, None)
    if bound["resource"] == "api_server_cpu":
        pub = {m: float(v) for m, v in entry["published"].items()}
        tpot = engine_alone(path, hardware, pub, entry.get("engine_version"))
        pub_tpot = pub.get("tpot_p50") or pub.get("tpot_mean")
        measured = ""
        if tpot is not None and pub_tpot:
            err = (1000 * tpot - pub_tpot) / pub_tpot
            measured = (f"; with requests reaching the engine at the file's {pub['req_s']:.4g} req/s and no API "
                        f"server, the engine's TPOT p50 is {1000 * tpot:.3g} ms ({_pct(err)} against the file's "
                        f"{pub_tpot:.3g} ms)" + (": the engine terms fit, the admission does not"
                                                  if abs(err) <= FIT_BOUND else ""))
        return (f"{head}; {bound['line']}{measured}; term: the API server's admission of the requests (the bench "
                "fit does not search the front end; its ingress is `frontend.ingress: shared` unless the version "
                "says in_order - the assumption block; docs/vllm_import.md)")
    edged = [p for p in params if at_bounds(values, [p])]
    term = (f"the engine's step terms at the edge of their range: {'; '.join(at_bounds(values, edged))}" if edged
            else "the engine's step terms (GPU efficiencies, c_step, c_req) cannot reach both figures")
    sides = {_slow_edge(values, p) for p in edged}
    tpot_err = next((e for m, e in errs.items() if m in TPOT_METRICS), 0.0)
    # a side hint only where the case's own TPOT error points the same way as the parameters at the edge
    if sides == {True} and tpot_err < 0:  # predicted too fast, and the fit wanted a slower machine still
        term += (" - all on the slow side: the run was slower than this GPU can be; check --hardware (no bench "
                 "file records the GPU) and, with TP > 1, the interconnect (not searched)")
    elif sides == {False} and tpot_err > 0:
        term += (" - all on the fast side: the server did not pay a cost the model charges; check the version's "
                 "differences and the settings in the assumption block")
    if entry.get("client") == "sglang":
        term = "the server is SGLang, modelled as vLLM's engine and API server (its scheduler and streaming differ); " + term
    return f"{head}; {bound['line']}; term: {term}"


def check_bench_fit(results, case_dir: Path, hardware: Any, values: dict[tuple[str, str], float], params: list,
                    log: Callable[[str], None] = lambda m: None) -> None:
    """Raise `FitFailed` naming the term when any case misses `FIT_BOUND` (or does not run)."""
    from servetwin.experiments.validate.published import load_published  # noqa: PLC0415

    failed = failures(results)
    if not failed:
        return
    _, published = load_published(case_dir)
    log("calibrate: the fit misses its own files; measuring which term")
    lines = [diagnose(r, errs, case_dir, hardware, published, values, params) for r, errs in failed]
    raise FitFailed(f"the fit does not reach its own files within {100 * FIT_BOUND:.0f}% (TPOT and request "
                    "throughput, in sample); nothing written.\n" + "\n".join(f"  {line}" for line in lines))
