"""Validate the simulator against published vLLM measurements (`servetwin validate`).

A case directory holds `cases/NAME.yaml` (a servetwin experiment, sim backend) and `published.json`
(`{NAME: {source, engine_version, published: {metric: value}}}`); metric names (times in ms):
`req_s`, `out_tok_s`, `tot_tok_s`, `dur_s`, `lat_ms`/`lat_p50_ms`/`lat_p99_ms` (an offline batch's
end-to-end time, `benchmark_latency`), and `ttft_*`, `tpot_*`, `itl_*`, `e2e_*` with `mean`, `p50`,
`p99` as `vllm bench serve` reports them. Every case is run as it is (its YAML, optionally on other
hardware) and each published figure is compared with the prediction from the run's `summary.json`:
signed error = (predicted - published) / published. Groups (median |error| each):
throughput/duration (req_s, out_tok_s, tot_tok_s, dur_s, lat_*), TPOT/ITL, TTFT, E2E. A case's optional
`token_basis` (the harness's own output count per request, with its source) also puts the token-counting
figures on the engine's basis (experiments/validate/token_basis.py).
"""
from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

from servetwin.experiments.validate.token_basis_entry import check_token_basis

GROUPS = ("throughput/duration", "TPOT/ITL", "TTFT", "E2E")
# published metric -> (summary.json key, statistic or None, scale to the published unit)
_DIST = {"mean": "mean", "p50": "p50", "p99": "p99"}

# Scheduler behaviour of the vLLM versions a case may be measured on, where it differs from vLLM
# 0.33's (which core/ implements) and an engine setting expresses it: (newest version it applies to,
# settings). Applied where neither the case file nor `--set` gives the setting; the case's notes say so.
VERSION_ENGINE_SETTINGS: tuple[tuple[tuple[int, int], dict[str, Any]], ...] = (
    # up to 0.11 a waiting request is admitted when its first chunk fits the free blocks; 0.33 admits it
    # only when its whole prompt does. It matters where the KV pool holds few prompts (32k prompts, a
    # 32B model on 80 GB).
    ((0, 11), {"engine.scheduler_reserve_full_isl": False}),
)
_VERSION = re.compile(r"\bvLLM\s+v?(\d+)\.(\d+)")


def version_settings(engine_version: Any) -> dict[str, Any]:
    """{dotted key: value} for a published.json `engine_version` such as "vLLM 0.11.0 (V1)"."""
    m = _VERSION.search(engine_version) if isinstance(engine_version, str) else None
    if m is None:
        return {}
    version = (int(m.group(1)), int(m.group(2)))
    out: dict[str, Any] = {}
    for newest, settings in VERSION_ENGINE_SETTINGS:
        if version <= newest:
            out.update(settings)
    return out


def _has_dotted(raw: Any, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(raw, Mapping) or part not in raw:
            return False
        raw = raw[part]
    return True


def metric_group(metric: str) -> str:
    if metric.startswith(("tpot", "itl")):
        return "TPOT/ITL"
    if metric.startswith("ttft"):
        return "TTFT"
    if metric.startswith("e2e"):
        return "E2E"
    return "throughput/duration"


def predicted_value(metric: str, sim: Mapping[str, Any]) -> Optional[float]:
    """The prediction for one published metric from a sim summary (None: the run has no such figure)."""
    if metric == "req_s":
        return sim.get("request_throughput_s")
    if metric == "out_tok_s":
        return sim.get("output_tok_s")
    if metric == "tot_tok_s":
        return sim.get("throughput_tok_s")
    if metric == "dur_s":
        return sim.get("duration_s")
    if metric in ("lat_ms", "lat_p50_ms", "lat_p99_ms"):  # one offline batch: its makespan, every iteration alike
        d = sim.get("duration_s")
        return None if d is None else 1000.0 * d
    head, _, stat = metric.partition("_")
    if head in ("ttft", "tpot", "itl", "e2e") and stat in _DIST:
        dist = sim.get(f"{head}_s") or {}
        v = dist.get(_DIST[stat])
        return None if v is None else 1000.0 * v
    raise ValueError(f"published.json: unknown metric {metric!r}")


@dataclass(slots=True)
class CaseResult:
    name: str
    source: str
    rows: list[tuple[str, float, Optional[float]]]  # (metric, published, predicted)
    notes: list[str] = field(default_factory=list)
    error: Optional[str] = None
    pending: Optional[str] = None  # recorded but not runnable yet (what it needs)

    def errors(self) -> dict[str, float]:
        """Signed relative error per metric (predicted - published) / published."""
        return {m: (p - pub) / pub for m, pub, p in self.rows if p is not None and pub}


IMPORT_INCOMPLETE_MARKER = ".servetwin-import-incomplete"  # in a case directory while an import writes to it


def load_published(case_dir: str | Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """({case name: yaml path}, published.json) of a case directory; names must match."""
    d = Path(case_dir)
    pub_path = d / "published.json"
    if (d / IMPORT_INCOMPLETE_MARKER).exists():  # `servetwin import vllm-bench` was cut short
        raise ValueError(f"validate: {d} holds {IMPORT_INCOMPLETE_MARKER}: an import into it did not finish "
                         "(run the import again, with --overwrite)")
    if not pub_path.is_file():
        raise ValueError(f"validate: {d} has no published.json (expected DIR/published.json and DIR/cases/*.yaml)")
    with open(pub_path, encoding="utf-8") as f:
        try:
            published = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"validate: {pub_path} is not valid JSON: {e}") from None
    cases_dir = d / "cases"
    cases = {p.stem: p for p in sorted(cases_dir.glob("*.yaml"))} if cases_dir.is_dir() else {}
    if not cases:
        raise ValueError(f"validate: no case files under {cases_dir}")
    missing = sorted(set(cases) - set(published))
    if missing:
        raise ValueError(f"validate: published.json has no entry for case {missing[0]!r}")
    for name, entry in published.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("published"), Mapping):
            raise ValueError(f"published.json.{name}.published: must be a mapping of metric -> value")
        for metric in entry["published"]:
            predicted_value(metric, {})  # unknown metric names fail before any run
        _check_stages(name, entry.get("stages"))
        check_token_basis(name, entry)
        if entry.get("pending") and name not in cases:  # a recorded case that cannot run yet has no YAML
            cases[name] = d / "cases" / f"{name}.yaml"
    return cases, published


def _check_stages(name: str, staged: Any) -> None:
    from servetwin.experiments.validate.cluster_stages import STAGE_METRICS  # noqa: PLC0415
    if staged is None:
        return
    where = f"published.json.{name}.stages"
    if not isinstance(staged, Mapping) or not isinstance(staged.get("per_stage"), list):
        raise ValueError(f"{where}: must be {{first, per_stage: [{{rate, metric: value}}]}}")
    for i, st in enumerate(staged["per_stage"]):
        if not isinstance(st, Mapping) or "rate" not in st:
            raise ValueError(f"{where}.per_stage[{i}]: must be a mapping with `rate`")
        unknown = sorted(set(st) - {"rate", *STAGE_METRICS})
        if unknown:
            raise ValueError(f"{where}.per_stage[{i}]: unknown metric {unknown[0]!r} "
                             f"(known: {', '.join(STAGE_METRICS)})")


def run_case(path: Path, hardware: Any = None, overrides: Optional[list[str]] = None,
             engine_version: Any = None, stage_counts: Optional[list[int]] = None
             ) -> tuple[dict[str, Any], list[str]]:
    """Run one case's sim backend (hardware: a preset name, YAML path or mapping replacing the
    case's; engine_version: published.json's, for `VERSION_ENGINE_SETTINGS`); returns (the sim
    summary, notes). `stage_counts`: the requests of each stage of a `stages` arrival; the summary then
    gets `stages`, the per-stage figures (experiments/validate/cluster_stages.py)."""
    from servetwin.experiments.run.experiment import run_experiment  # noqa: PLC0415
    from servetwin.experiments.config.schema import ExperimentConfig, load_config, load_yaml, parse_override  # noqa: PLC0415

    values: dict[str, Any] = {"backends": ["sim"], "output.plots": False, "output.step_requests": False}
    given = {parse_override(text)[0] for text in overrides or []}
    raw = load_yaml(path)
    notes = []
    for key, value in version_settings(engine_version).items():
        if key not in given and not _has_dotted(raw, key):
            values[key] = value
            notes.append(f"{key}={json.dumps(value)} (as {engine_version})")
    if hardware is not None:  # a CLI value: a path in it is relative to the working directory
        values["hardware"] = (str(Path(hardware).resolve()) if isinstance(hardware, (str, Path))
                              and Path(hardware).is_file() else hardware)
    exp: ExperimentConfig = load_config(path, overrides=list(overrides or []), values=values)
    with tempfile.TemporaryDirectory(prefix="servetwin-validate-") as out:
        summary = run_experiment(exp, out, progress=False, log=lambda msg: None)
        sim = summary["backends"]["sim"]
        if stage_counts is not None:
            from servetwin.experiments.validate.cluster_stages import run_stage_figures  # noqa: PLC0415
            sim = {**sim, "stages": run_stage_figures(out, stage_counts)}
    return sim, notes


def read_run(run_dir: Path, stage_counts: Optional[list[int]] = None) -> dict[str, Any]:
    """The sim summary of an earlier `servetwin run` of a case (its output folder), with `stages` as
    `run_case` gives them."""
    with open(run_dir / "summary.json", encoding="utf-8") as f:
        sim = json.load(f)["backends"]["sim"]
    if stage_counts is not None:
        from servetwin.experiments.validate.cluster_stages import run_stage_figures  # noqa: PLC0415
        sim = {**sim, "stages": run_stage_figures(str(run_dir), stage_counts)}
    return sim


def validate_cases(case_dir: str | Path, hardware: Any = None, only: Optional[list[str]] = None,
                   overrides: Optional[list[str]] = None,
                   log: Callable[[str], None] = lambda msg: None,
                   runs_dir: Optional[str | Path] = None) -> list[CaseResult]:
    """`runs_dir`: read each case's prediction from `runs_dir/NAME` (an earlier `servetwin run` of
    cases/NAME.yaml as it is) instead of running it."""
    cases, published = load_published(case_dir)
    if only:
        unknown = sorted(set(only) - set(cases))
        if unknown:
            raise ValueError(f"--case: no case {unknown[0]!r} (cases: {', '.join(cases)})")
    results = []
    for name, path in cases.items():
        if only and name not in only:
            continue
        entry = published[name]
        pub = {m: float(v) for m, v in entry["published"].items()}
        if entry.get("pending"):  # recorded, not runnable yet: reported as such, never silently dropped
            results.append(CaseResult(name, str(entry.get("source", "")), [], pending=str(entry["pending"])))
            log(f"{name}: not runnable yet ({entry['pending']})")
            continue
        staged = entry.get("stages")
        try:
            counts = _stage_counts(path, overrides) if staged else None
            if runs_dir is not None:
                sim, notes = read_run(Path(runs_dir) / name, counts), [f"read from {Path(runs_dir) / name}"]
            else:
                sim, notes = run_case(path, hardware, overrides, entry.get("engine_version"), stage_counts=counts)
        except (ValueError, FileNotFoundError) as e:  # the case cannot run: reported, the others still run
            results.append(CaseResult(name, str(entry.get("source", "")), [(m, v, None) for m, v in pub.items()],
                                      error=str(e)))
            log(f"{name}: ERROR {e}")
            continue
        rows = [(m, v, predicted_value(m, sim)) for m, v in pub.items()]
        if staged:
            rows += stage_rows(staged, sim["stages"])
        results.append(CaseResult(name, str(entry.get("source", "")), rows, notes))
        log(f"{name}: ran ({sim.get('num_steps')} steps, {sim.get('simulated_s', 0):.2f} s simulated)")
    return results


def _stage_counts(path: Path, overrides: Optional[list[str]]) -> list[int]:
    from servetwin.experiments.config.schema import load_config  # noqa: PLC0415
    from servetwin.sim.arrivals import StageLadder  # noqa: PLC0415
    arrival = load_config(path, overrides=list(overrides or [])).workload.arrival
    if not isinstance(arrival, StageLadder):
        raise ValueError(f"validate: {path.name} has per-stage results in published.json but its "
                         f"workload.arrival is not `stages`")
    return arrival.stage_counts()


# TTFT is compared only where the published figure is below this (a saturated stage's TTFT is queueing
# that depends on how long the ladder has been overloaded, not on the engines' speed).
STAGE_TTFT_LIMIT_MS = 10_000.0


def stage_rows(staged: Mapping[str, Any], predicted: list[dict[str, Any]]
               ) -> list[tuple[str, float, Optional[float]]]:
    """(metric@rate, published, predicted) for each published per-stage figure; published.json's
    `stages`: {"first": index of the first published stage in the ladder, "per_stage": [{rate, metric: value}]}."""
    first = int(staged.get("first", 0))
    rows = []
    for i, st in enumerate(staged["per_stage"]):
        pred = predicted[first + i] if first + i < len(predicted) else {}
        for m, v in st.items():
            if m == "rate" or (m.startswith("ttft") and float(v) >= STAGE_TTFT_LIMIT_MS):
                continue
            rows.append((f"{m}@{st['rate']:g}", float(v), pred.get(m)))
    return rows


def group_medians(results: list[CaseResult]) -> dict[str, Optional[float]]:
    """Median |error| per group over every compared figure of every case."""
    per: dict[str, list[float]] = {g: [] for g in GROUPS}
    for r in results:
        for m, e in r.errors().items():
            per[metric_group(m)].append(abs(e))
    return {g: (float(np.median(v)) if v else None) for g, v in per.items()}


def format_pct(x: Optional[float], signed: bool = True) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def format_num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.0f}"


def render_table(results: list[CaseResult], title: str = "Published vLLM vs servetwin") -> str:
    lines = [f"| case | metric | published | predicted | error |", "|---|---|---:|---:|---:|"]
    for r in results:
        if r.pending:
            lines.append(f"| {r.name} | (not runnable yet) | | | {r.pending} |")
            continue
        if r.error:
            lines.append(f"| {r.name} | (not run) | | | {r.error} |")
            continue
        errs = r.errors()
        for m, pub, p in r.rows:
            lines.append(f"| {r.name} | {m} | {format_num(pub)} | {format_num(p)} | {format_pct(errs.get(m))} |")
    med = group_medians(results)
    lines += ["", "| group | median abs error |", "|---|---:|"]
    lines += [f"| {g} | {format_pct(v, signed=False)} |" for g, v in med.items()]
    ran = sum(1 for r in results if not r.error and not r.pending)
    pending = sum(1 for r in results if r.pending)
    lines += ["", f"cases run: {ran}/{len(results)}" + (f" ({pending} not runnable yet)" if pending else "")]
    by_note: dict[str, list[str]] = {}
    for r in results:
        for note in r.notes:
            by_note.setdefault(note, []).append(r.name)
    if by_note:
        lines += ["", "Settings taken from the measured vLLM version (where the case file leaves them):"]
        lines += [f"- {note}: {'every case' if len(names) == len(results) else ', '.join(names)}"
                  for note, names in by_note.items()]
    return "\n".join(lines)
