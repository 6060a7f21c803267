"""`servetwin calibrate --from-vllm FILES... -o my_gpu.yaml`: a hardware file fitted on what vLLM wrote.

Files are told apart by content: Chrome traces (`traceEvents`, plain or gzip) are profiler traces,
JSON / JSONL benchmark results are `vllm bench serve` files (`bench_file`), anything else a server log
(`server_log`: its engine settings go into the bench files' cases). Two fits, from the nearest
preset (`--hardware`: a preset, or a GPU name such as "NVIDIA H100 80GB HBM3"):

- profiler traces (with `--experiment`, the measured run's workload and engine settings: one YAML for
  all traces = the ranks of one run, or one per trace): each measured step is matched with the
  simulator's step (`measured_steps`) and the cost model's coefficients - engine CPU terms per step,
  request and token, and the corrections of the roofline terms (GEMMs, prefill and decode attention,
  LM head) on top of the preset's efficiencies - are fitted to the measured durations by
  non-negative least squares (`servetwin.experiments.calibrate.calibrate.fit_from_tables`, the torch
  calibration's fit). Bench files given with traces are only predicted (their figures as a check);
- benchmark results alone: the end-to-end search of `servetwin.experiments.validate.preset_fit` (GPU
  efficiencies and the engine's per-step / per-request CPU) on the files imported as validate cases; a
  fit that misses its own files' TPOT or request throughput by more than 15% (or a case that cannot
  run) raises `fit_check.FitFailed` naming the term, before anything is written.

The provenance lists every file, the errors in sample (per file) and leave-one-file-out (refit
without the file, predict it); fewer than two files: no leave-one-out.
"""
from __future__ import annotations

import datetime as dt
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.experiments.vllm_import.bench_case import ImportOptions

GZIP_MAGIC = b"\x1f\x8b"
STEP_OFFSET = 1_000_000  # step numbers of run k are shifted by k * STEP_OFFSET when runs are pooled


def nearest_preset(hardware: Optional[str]) -> str:
    """A preset name, or the preset whose GPU name a device string contains."""
    from servetwin.experiments.calibrate.calibrate import CUDA_PRESET_BY_NAME  # noqa: PLC0415
    from servetwin.sim.hardware_presets import HARDWARE_PRESETS  # noqa: PLC0415

    if not hardware:
        raise ConfigError("--hardware", "the GPU the files were measured on is not in them: give --hardware "
                                        f"(a preset: {', '.join(HARDWARE_PRESETS)}, or a GPU name)")
    if hardware in HARDWARE_PRESETS:
        return hardware
    for key, preset in CUDA_PRESET_BY_NAME:
        if key.lower() in hardware.lower():
            return preset
    raise ConfigError("--hardware", f"{hardware!r} is no preset and names no GPU servetwin has a preset for "
                                    f"({', '.join(HARDWARE_PRESETS)})")


@dataclass(slots=True)
class StartSet:
    """Where a fit starts: `base` is the preset the written file names; `hardware` what the simulator runs on
    first (the preset, or a given hardware file's values); `efficiency` / `values` a given file's (e.g. a
    CPU calibration's measured GEMM curve, which a profiler trace cannot give: its GEMMs are in native
    kernels the CPU profiler does not list)."""
    base: str
    hardware: Any
    efficiency: Any = None
    values: Optional[dict[str, Any]] = None


def start_set(hardware: Optional[str]) -> StartSet:
    """`--hardware`: a preset, a GPU name (the nearest preset), or a hardware YAML naming its `base` preset."""
    from servetwin.core.safe_yaml import load_yaml_file  # noqa: PLC0415
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415
    from servetwin.sim.hardware_presets import HARDWARE_PRESETS  # noqa: PLC0415

    if not hardware or not Path(hardware).is_file():
        base = nearest_preset(hardware)
        return StartSet(base, base)
    raw = load_yaml_file(hardware, "--hardware")
    base = raw.get("base") if isinstance(raw, dict) else None
    if base not in HARDWARE_PRESETS:
        raise ConfigError("--hardware", f"{hardware}: a hardware file to start from must name its preset (base: "
                                        f"{', '.join(HARDWARE_PRESETS)})")
    hw = load_hardware(hardware)
    values = {"efficiency": hw.efficiency.to_dict(), "coefficients": hw.coefficients.to_dict()}
    return StartSet(base, {"base": base, **values}, hw.efficiency, values)


def is_chrome_trace(head: bytes) -> bool:
    """Whether a file's first bytes (inflated) are a Chrome trace's; a damaged gzip counts (its reader
    names it)."""
    return b"traceEvents" in head or head[:2] == GZIP_MAGIC


def classify(files: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(profiler traces, bench results, server logs): a trace holds `traceEvents`, a bench result starts
    as JSON, anything else is read as a server log (whose readers name a file that is none of them).
    Only each file's first 4 KiB are read, after `core.limits`' file-type check (a FIFO, a folder or a
    device is refused by name)."""
    from servetwin.core.limits import read_head  # noqa: PLC0415

    traces, benches, logs = [], [], []
    for f in files:
        head = read_head(f, "--from-vllm")
        if is_chrome_trace(head):
            traces.append(f)
        else:
            (benches if head.lstrip()[:1] in (b"{", b"[") else logs).append(f)
    return traces, benches, logs


# -- step-level fit from profiler traces ----------------------------------------------------------------
def trace_runs(traces: list[str], experiments: list[str], hardware: Any, log: Callable[[str], None]
               ) -> list[tuple[str, Any]]:
    """[(label, MatchedSteps)] per measured run."""
    from servetwin.experiments.vllm_import.measured_steps import load_sim_experiment, match_steps  # noqa: PLC0415
    from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces  # noqa: PLC0415

    if not experiments:
        raise ConfigError("--experiment", "profiler traces name each step's composition, not its requests: give the "
                                          "measured run's experiment YAML (workload and engine settings)")
    if len(experiments) == 1:
        groups = [traces]
    elif len(experiments) == len(traces):
        groups = [[t] for t in traces]
    else:
        raise ConfigError("--experiment", f"give one (all traces are ranks of one run) or one per trace "
                                          f"({len(traces)}), got {len(experiments)}")
    runs = []
    for group, exp_path in zip(groups, experiments):
        m = match_steps(read_profiler_traces(group), load_sim_experiment(exp_path, hardware=hardware), log)
        log(f"calibrate: {', '.join(Path(g).name for g in group)}: {len(m.measured_index)}/{m.measured_total} "
            f"steps matched with {Path(exp_path).name}")
        runs.append((" + ".join(group), m))
    return runs


def _pooled(runs: list[tuple[str, Any]]):
    import pandas as pd  # noqa: PLC0415

    steps, rows = [], []
    for k, (_, m) in enumerate(runs):
        s, r = m.steps.copy(), m.step_requests.copy()
        s["step"] = s.step + k * STEP_OFFSET
        r["step"] = r.step + k * STEP_OFFSET
        steps.append(s)
        rows.append(r)
    return pd.concat(steps, ignore_index=True), pd.concat(rows, ignore_index=True)


def fit_runs(runs: list[tuple[str, Any]], trim: Optional[float]):
    from servetwin.experiments.calibrate.calibrate import fit_from_tables  # noqa: PLC0415

    steps, rows = _pooled(runs)
    return fit_from_tables(steps, rows, runs[0][1].cost_model, trim=trim)


def coefficients_of(cal, start: StartSet) -> dict[str, float]:
    from servetwin.experiments.calibrate.calibrate import calibration_document  # noqa: PLC0415

    return calibration_document(start.base, cal, {}, efficiency=start.efficiency)["coefficients"]


def step_errors(m, cost_model, coefficients: dict[str, float]) -> np.ndarray:
    """Relative errors (predicted - measured) / measured of a run's matched steps under `coefficients`."""
    from servetwin.experiments.calibrate.calibrate import step_rows  # noqa: PLC0415
    from servetwin.sim.coefficients import BASIS_TERMS  # noqa: PLC0415

    _, summaries, t, _ = step_rows(m.steps, m.step_requests)
    pred = np.array([sum(coefficients[f"c_{k}"] * b[k] for k in BASIS_TERMS)
                     for b in (cost_model.basis(s) for s in summaries)])
    return (pred - t) / t


def _err_stats(rel: np.ndarray) -> dict[str, float]:
    a = np.abs(rel)
    return {"steps": int(a.size), "median_abs_rel_err": float(np.median(a)), "p90_abs_rel_err": float(np.quantile(a, 0.9))}


def trace_fit(runs, start: StartSet, trim: Optional[float], log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """(the pooled fit, {in_sample, leave_one_file_out} errors per run)."""
    cal = fit_runs(runs, trim)
    coeffs = coefficients_of(cal, start)
    cm = runs[0][1].cost_model
    report: dict[str, Any] = {"terms_fitted": list(cal.terms),
                              "in_sample": {label: _err_stats(step_errors(m, cm, coeffs)) for label, m in runs}}
    if len(runs) > 1:
        loo = {}
        for k, (label, m) in enumerate(runs):
            others = runs[:k] + runs[k + 1:]
            loo[label] = _err_stats(step_errors(m, cm, coefficients_of(fit_runs(others, trim), start)))
            log(f"calibrate: without {label}: median |error| {100 * loo[label]['median_abs_rel_err']:.2f}%")
        report["leave_one_file_out"] = loo
    return cal, report


def iterate_trace_fit(traces: list[str], experiments: list[str], start: StartSet, trim: Optional[float],
                      provenance: dict[str, Any], log: Callable[[str], None], rounds: int = 4):
    """Match, fit, and match again on the simulator with the fitted coefficients: an online run's schedule
    (arrivals through a front end) depends on the step times, so the first matching, on the preset's,
    pairs some steps wrongly. Stops when every step matches or the matched count stops growing."""
    from servetwin.experiments.calibrate.calibrate import calibration_document  # noqa: PLC0415

    hardware: Any = start.hardware
    best = None
    for k in range(rounds):
        runs = trace_runs(traces, experiments, hardware, log)
        matched = sum(len(m.measured_index) for _, m in runs)
        total = sum(m.measured_total for _, m in runs)
        if best is not None and matched <= best[0]:
            break
        cal, report = trace_fit(runs, start, trim, log)
        doc = calibration_document(start.base, cal, provenance, name=f"{start.base}-from-vllm",
                                   efficiency=start.efficiency)
        report["matched_steps"] = f"{matched}/{total} (round {k + 1})"
        best = (matched, cal, report, doc)
        if matched == total:
            break
        hardware = {"base": start.base, "efficiency": doc["efficiency"], "coefficients": doc["coefficients"]}
    _, cal, report, doc = best
    return cal, report, doc


# -- end-to-end fit from bench files ----------------------------------------------------------------------
def import_benches(benches: list[str], opts: ImportOptions, case_dir: Path,
                   log: Callable[[str], None] = lambda m: None) -> dict[str, list[str]]:
    """Every record of every bench file as a case under `case_dir`: {file: [case names]}; each case's
    assumptions (what the file does not record) logged as one block."""
    from servetwin.experiments.vllm_import.bench_case import build_case, import_cases  # noqa: PLC0415
    from servetwin.experiments.vllm_import.bench_file import load_bench_file  # noqa: PLC0415

    out: dict[str, list[str]] = {}
    cases = []
    for k, path in enumerate(benches):
        for record in load_bench_file(path):
            cases.append(build_case(record, opts, prefix=f"f{k}_"))
            out.setdefault(path, []).append(cases[-1].name)
    import_cases(cases, case_dir, log=log)
    return out


def _case_errors(results) -> dict[str, Any]:
    from servetwin.experiments.validate.preset_fit import loss  # noqa: PLC0415

    return {r.name: {"mean_abs_log_err": loss([r]), "signed_errors": r.errors()} for r in results}


def bench_fit(benches: list[str], opts: ImportOptions, base: str, start: Optional[dict[str, Any]], fit_params: bool,
              rounds: int, log: Callable[[str], None], params: Optional[list] = None
              ) -> tuple[dict[str, float], dict[str, Any]]:
    """({(section, name) fitted value}, report). `fit_params` False: only predict the files (`start` fitted
    elsewhere). `params`: the `preset_fit` entries searched (default: its FIT set)."""
    from servetwin.experiments.validate.preset_fit import FIT, evaluate, fit, hardware_mapping, start_values  # noqa: PLC0415
    from servetwin.experiments.vllm_import.fit_check import check_bench_fit  # noqa: PLC0415

    params = params or FIT
    with tempfile.TemporaryDirectory(prefix="servetwin-from-vllm-") as tmp:
        by_file = import_benches(benches, opts, Path(tmp), log if fit_params else lambda m: None)
        names = [n for ns in by_file.values() for n in ns]
        values = start_values(params, base, start) if fit_params else {}
        if fit_params:
            values, _ = fit(tmp, values, names, rounds, log, params, base, start)
        in_sample = evaluate(tmp, values, names, base, start)
        report: dict[str, Any] = {"in_sample": _case_errors(in_sample)}
        if fit_params:  # a fit that misses its own files stops here, naming the term (nothing is written)
            check_bench_fit(in_sample, Path(tmp), hardware_mapping(values, base, start), values, params, log)
        if fit_params and len(by_file) > 1:
            loo = {}
            for path, held in by_file.items():
                others = [n for n in names if n not in held]
                v, _ = fit(tmp, values, others, 1, lambda m: None, params, base, start)
                loo.update(_case_errors(evaluate(tmp, v, held, base, start)))
                log(f"calibrate: refit without {Path(path).name} done")
            report["leave_one_file_out"] = loo
    return values, report


# -- the command ------------------------------------------------------------------------------------------
def calibrate_from_vllm(files: list[str], out_path: str, *, hardware: Optional[str], experiments: list[str],
                        opts: ImportOptions, trim: Optional[float] = 4.0, rounds: int = 1,
                        log: Callable[[str], None] = lambda m: None, params: Optional[list] = None) -> dict[str, Any]:
    from servetwin.experiments.calibrate.calibrate import write_calibration  # noqa: PLC0415
    from servetwin.experiments.validate.preset_fit import hardware_mapping  # noqa: PLC0415

    start = start_set(hardware)
    base = start.base
    opts.hardware = base
    traces, benches, logs = classify(files)
    for path in logs:  # the server's engine settings, for the bench files' cases
        from servetwin.experiments.vllm_import.server_log import apply_to_options, read_server_log  # noqa: PLC0415

        apply_to_options(read_server_log(path), opts, path)
    provenance: dict[str, Any] = {
        "source": "servetwin calibrate --from-vllm", "calibrated": True, "base_preset": base,
        "start": hardware if start.values is not None else base,
        "date": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        "files": {"profiler_traces": traces, "bench_results": benches, "server_logs": logs,
                  "experiments": list(experiments)}}
    if traces:
        cal, report, doc = iterate_trace_fit(traces, experiments, start, trim, provenance, log)
        provenance["method"] = ("step-level NNLS on the profiler traces' steps, matched with the simulated run "
                                "(re-simulated with the fitted coefficients until the matching stops improving)")
        provenance["step_errors"] = report
        if benches:
            fitted = {"efficiency": doc["efficiency"], "coefficients": doc["coefficients"]}
            provenance["bench_check"] = bench_fit(benches, opts, base, fitted, False, rounds, log)[1]
    elif benches:
        values, report = bench_fit(benches, opts, base, start.values, True, rounds, log, params)
        mapping = hardware_mapping(values, base, start.values)
        doc = {"base": base, "name": f"{base}-from-vllm", "efficiency": mapping["efficiency"],
               "coefficients": mapping["coefficients"], "provenance": provenance}
        provenance["method"] = "end-to-end search (servetwin.experiments.validate.preset_fit) on the bench results"
        provenance["fitted"] = {f"{s}.{n}": v for (s, n), v in values.items()}
        provenance["bench_errors"] = report
    else:
        raise ConfigError("--from-vllm", "no file given")
    header = ("Written by `servetwin calibrate --from-vllm` - fitted, not hand-edited.\n"
              f"Starts from {provenance['start']}; the files it was fitted on are in provenance.files.\n"
              "Use as `hardware: <this file>` in run, capacity and sweep.")
    write_calibration(out_path, doc, header)
    return doc
