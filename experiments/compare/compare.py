"""`servetwin compare`: one workload on the simulator (predicted) and the torch backend (measured).

Both backends get the same request list, engine settings, KV pool (`num_gpu_blocks` and
`max_model_len` are taken from the torch engine and given to the simulator) and model dtype (the
simulator's model spec uses the dtype the torch backend really runs). The simulator's hardware is the
calibration file (`--calibration`, else the config's `hardware:`).

Offline (every request at t = 0) both backends must schedule identical step sequences (same requests,
same token counts, same computed-before counts, same preemptions) in every measured repeat: otherwise
`CompositionMismatch` names the first differing step and nothing is scored. Then each step's predicted
duration is paired with its measured one.

Online (open-loop arrivals in wall time on the torch backend; the simulator replays the same arrival
times) decisions may diverge because timing differs. The share of steps whose composition is
identical at the same position is reported, request-latency percentiles are compared, and the
per-step error is the cost model's prediction for each *measured* step's own composition.

Errors are in percent: `abs_pct = |predicted - measured| / measured * 100`; `*_signed_pct_error` keep
the sign (positive: the simulator predicts more). With `--repeats N` the torch backend runs N times
(one warm-up run first, not scored): the headline step errors pool every (step, repeat) pair, the
makespan / latency / throughput errors use the median over repeats of the measured value, and
`noise` gives the same metrics measured-vs-measured between repeats (machine noise: the floor no
model can beat).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

from servetwin.experiments.calibrate.calibrate import calibration_mismatches
from servetwin.experiments.calibrate.design import pct_stats, predicted_durations, step_phase_class, step_rows
from servetwin.core.config_error import ConfigError
from servetwin.experiments.config.schema import ExperimentConfig, engine_field_path, load_yaml, validate_config
from servetwin.experiments.calibrate.torch_measure import (CONTENDED_BELOW, apply_threads, calibration_info, contention_summary,
                                                 load_average, measure, warm_up)

PHASES = ("prefill", "decode", "mixed")
TARGETS = {"step_p50": 5.0, "step_p90": 15.0, "makespan": 3.0, "e2e_p50": 5.0}
DRIFT_REFRESH_PCT = 10.0  # `hardware: auto`: a probe further off than this re-measures the calibration
LATENCIES = (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2e", "e2e_s"))


class CompositionMismatch(ValueError):
    """Offline step sequences of the two backends differ."""


# -- config ---------------------------------------------------------------------------------------
def load_compare_config(path: str, calibration: Optional[str] = None, overrides: Optional[list[str]] = None,
                        requests: Optional[int] = None) -> ExperimentConfig:
    """The experiment config with backends [sim, torch] and, if given, `hardware: <calibration>`."""
    from pathlib import Path  # noqa: PLC0415

    from servetwin.experiments.config.schema import apply_requests_override, parse_override, set_dotted  # noqa: PLC0415

    p = Path(path)
    raw = load_yaml(p)
    if not isinstance(raw, dict):
        raise ConfigError("config", f"{p} must hold a mapping at the top level")
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(raw, key, value)
    if requests is not None:
        apply_requests_override(raw, requests)
    if calibration is not None:
        cal = Path(calibration).expanduser()
        if not cal.is_file():
            raise ConfigError("--calibration", f"file not found: {calibration}")
        raw["hardware"] = str(cal.resolve())
    raw["backends"] = ["sim", "torch"]
    raw.pop("sweep", None)
    import re  # noqa: PLC0415

    return validate_config(raw, p.parent, default_name=re.sub(r"[^A-Za-z0-9._+=-]", "-", p.stem))


# -- engines ----------------------------------------------------------------------------------------
def build_torch_engine(exp: ExperimentConfig):
    from servetwin.experiments.run.runner import create_engine  # noqa: PLC0415

    return create_engine(exp, "torch")


def sim_engine_args(exp: ExperimentConfig, torch_info) -> Any:
    """The simulator's engine args: the config's, with the torch engine's pool, length and dtype."""
    args = exp.engine_args("sim")
    ex = torch_info.executor
    dtype = str(getattr(ex, "dtype", "auto")).replace("torch.", "")
    return dataclasses.replace(args, num_gpu_blocks=int(torch_info.num_gpu_blocks),
                               max_model_len=int(torch_info.max_model_len), dtype=dtype,
                               enforce_eager=args.enforce_eager or getattr(ex, "graph_runner", None) is None)


def _beyond(drift: Optional[float]) -> bool:
    return drift is not None and abs(drift) > DRIFT_REFRESH_PCT


def _pct_text(x: Optional[float]) -> str:
    return "unknown (the calibration has no probe of its own)" if x is None else f"{x:+.1f}%"


def build_sim_engine(exp: ExperimentConfig, torch_info):
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415

    args = sim_engine_args(exp, torch_info)
    try:
        return create_engine_core(args)
    except ConfigError as e:
        e = engine_field_path(e)
        raise ConfigError(e.path, f"{e.message} [sim backend]") from None


def calibration_probe(exp: ExperimentConfig, info, cost_model, frames: Optional[dict] = None) -> Optional[dict[str, Any]]:
    """The drift probe (`servetwin.experiments.calibrate.drift_probe`) on the torch executor just before
    the scored runs (or its `frames`, measured already), scored with the simulator's cost model; with the
    calibration's own probe, the machine's drift since it was calibrated. None: the engine cannot run
    the probe."""
    from servetwin.experiments.calibrate.drift_probe import (drift_pct, measure_probe,  # noqa: PLC0415
                                                              probe_at_calibration, score_probe)

    if frames is None:
        frames = measure_probe(exp.engine_args("torch"), info)
    if frames is None:
        return None
    res = score_probe(frames, cost_model)
    _, prov = calibration_info(exp)
    res["at_calibration"] = probe_at_calibration(prov)
    res["drift_pct"] = drift_pct(res["signed_pct_error_median"], res["at_calibration"])
    res["definition"] = ("signed median (predicted - measured) / measured over fixed designed steps measured "
                         "just before the scored runs; drift_pct compares it with the same probe measured "
                         "right after the calibration (negative: the machine is slower now; null: the "
                         "calibration has no probe of its own)")
    return res


def refresh_drifted_calibration(exp: ExperimentConfig, probe: Optional[dict[str, Any]], threads: int,
                                log: Callable[[str], None]) -> Optional[dict[str, Any]]:
    """`hardware: auto` only: when two drift probes in a row find the machine more than
    `DRIFT_REFRESH_PCT` off the speed it had when calibrated, in the same direction, measure a candidate
    calibration now (`auto_calibration.recalibrate`; the cached file is untouched until `judge_candidate`)
    and say so; the reason is in `servetwin.experiments.calibrate.drift_probe`. One probe alone was not
    enough on the 2-vCPU VM: its 0.3 s of steps swung +-30% with the host. Returns None (nothing
    measured) or the record written to comparison.json."""
    from servetwin.experiments.calibrate.auto_calibration import is_auto_calibration, recalibrate  # noqa: PLC0415

    probe = probe or {}
    drift, again = probe.get("drift_pct"), probe.get("drift_pct_confirming")
    path = exp.hardware if isinstance(exp.hardware, str) else ""
    if not (_beyond(drift) and _beyond(again) and drift * again > 0) or not is_auto_calibration(path):
        return None  # within the limit, unknown, or not confirmed by the second probe (machine noise)
    drift = (drift + again) / 2.0
    _, prov = calibration_info(exp)
    log(f"compare: the drift probe finds this machine {drift:+.1f}% off its speed when calibrated "
        f"({prov.get('date', '?')}; limit +-{DRIFT_REFRESH_PCT:.0f}%): re-measuring the calibration now "
        "(hardware: auto)")
    dtype = str(prov.get("dtype") or "float32")
    wall = recalibrate(path, exp.model, dtype, threads, log=log)
    return {"reason": f"drift probe {drift:+.1f}% (limit +-{DRIFT_REFRESH_PCT:.0f}%)", "drift_before": drift,
            "limit_pct": DRIFT_REFRESH_PCT,
            "calibrated_before": prov.get("date"), "calibration_wall_s": round(wall, 1), "file": path}


def judge_candidate(exp: ExperimentConfig, tinfo, old_engine, old_model, refresh: dict[str, Any],
                    log: Callable[[str], None]):
    """A re-measured calibration replaces the cached one only if it predicts the machine as it runs now
    better: one fresh probe measurement, scored by both models (|signed median error|, lower wins). A
    re-calibration can therefore never make the prediction worse than the probe shows. Returns
    (the sim engine, its cost model) of the calibration in force (`old_engine` when the cached one stays: it
    has run nothing yet); `exp.hardware_spec` follows it."""
    from servetwin.experiments.calibrate.auto_calibration import adopt_candidate, candidate_path  # noqa: PLC0415
    from servetwin.experiments.calibrate.drift_probe import measure_probe, score_probe  # noqa: PLC0415
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415

    old_spec = exp.hardware_spec
    exp.hardware_spec = load_hardware(candidate_path(refresh["file"]))
    new_engine, new_info = build_sim_engine(exp, tinfo)
    frames = measure_probe(exp.engine_args("torch"), tinfo)
    err_old = score_probe(frames, old_model)["signed_pct_error_median"] if frames else None
    err_new = score_probe(frames, new_info.executor.cost_model)["signed_pct_error_median"] if frames else None
    keep = err_old is not None and err_new is not None and abs(err_new) < abs(err_old)
    adopt_candidate(refresh["file"], keep)
    refresh.update(adopted=keep, probe_error_old_pct=err_old, probe_error_new_pct=err_new, probe_frames=frames)
    log(f"compare: one probe scored by both calibrations: signed median error {_pct_text(err_old)} (cached) vs "
        f"{_pct_text(err_new)} (re-measured): " + ("the re-measured one replaces the cache" if keep else
                                                   "the cached one is kept (the re-measured one is no better)"))
    if keep:
        exp.hardware_spec = load_hardware(refresh["file"])
        return new_engine, new_info.executor.cost_model
    exp.hardware_spec = old_spec
    return old_engine, old_model


def probe_drift(exp: ExperimentConfig, tinfo, threads: int, log: Callable[[str], None]):
    """The drift probe before the scored runs; a second one when the first reads beyond the limit (one
    probe is ~0.3 s of steps); with `hardware: auto` and both agreeing, a calibration re-measured and
    adopted only if it predicts a fresh probe better (`judge_candidate`). Returns (the sim engine over
    the calibration in force, the last probe or None, the refresh record or None)."""
    sim_engine, sinfo = build_sim_engine(exp, tinfo)
    model = sinfo.executor.cost_model
    probe = calibration_probe(exp, tinfo, model)
    if not probe:
        return sim_engine, None, None
    log(f"compare: drift probe: {probe['steps']} steps, signed median error "
        f"{probe['signed_pct_error_median']:+.2f}%, drift since calibrated {_pct_text(probe['drift_pct'])}")
    if _beyond(probe["drift_pct"]):
        probe["drift_pct_confirming"] = calibration_probe(exp, tinfo, model)["drift_pct"]
        log(f"compare: drift probe again: {_pct_text(probe['drift_pct_confirming'])}")
    refresh = refresh_drifted_calibration(exp, probe, threads, log)
    if refresh is not None:
        sim_engine, model = judge_candidate(exp, tinfo, sim_engine, model, refresh, log)
        probe = calibration_probe(exp, tinfo, model, frames=refresh.pop("probe_frames")) or probe
        refresh["drift_after"] = probe["drift_pct"]
        log(f"compare: drift since the calibration in force: {_pct_text(probe['drift_pct'])}")
    return sim_engine, probe, refresh


def run_torch(exp: ExperimentConfig, info, requests, offline: bool, run_name: str):
    """One measured run on a fresh engine over `info`'s executor; returns (trace frames, wall seconds)."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.core.testbed.realtime import run_realtime  # noqa: PLC0415
    from servetwin.core.testbed.trace import TraceRecorder  # noqa: PLC0415

    info.executor.reset()
    engine, _ = create_engine_core(exp.engine_args("torch"), info=info)
    recorder = TraceRecorder(run_name, "torch")
    reqs = [dataclasses.replace(r) for r in requests]
    t0 = time.perf_counter()
    run_realtime(engine, reqs, recorder, offline=offline, seed=exp.seed, rejected={})
    return recorder.frames(), time.perf_counter() - t0


def run_sim(exp: ExperimentConfig, engine, requests, arrival, rng, run_name: str):
    from servetwin.sim.engine import Simulation  # noqa: PLC0415

    sim = Simulation(engine, [dataclasses.replace(r) for r in requests], arrival, rng=rng, run=run_name,
                     record_step_requests=True)
    t0 = time.perf_counter()
    sim.run()
    return sim.recorder, time.perf_counter() - t0, dict(sim.result.rejected)


# -- step composition ---------------------------------------------------------------------------------
def step_signatures(frames: dict) -> list[tuple[int, tuple, int]]:
    """Per recorded step: (step number, sorted (request, tokens, computed before) rows, preemptions)."""
    steps, sr = frames["steps"], frames["step_requests"]
    rows: dict[int, list[tuple[str, int, int]]] = {}
    for step, rid, q, s in zip(sr.step.to_numpy(), sr.request_id.to_numpy(), sr.num_tokens.to_numpy(),
                               sr.num_computed_before.to_numpy()):
        rows.setdefault(int(step), []).append((str(rid), int(q), int(s)))
    return [(int(step), tuple(sorted(rows.get(int(step), []))), int(npre))
            for step, npre in zip(steps.step.to_numpy(), steps.num_preempted.to_numpy())]


def _describe(sig: Optional[tuple], annotation: Optional[str]) -> str:
    if sig is None:
        return "no step (the run had ended)"
    step, rows, npre = sig
    shown = ", ".join(f"{rid}:{q}@{s}" for rid, q, s in rows[:8]) + (" ..." if len(rows) > 8 else "")
    return f"engine step {step} {annotation or ''} [{shown}] preempted={npre}"


def first_difference(sim_frames: dict, torch_frames: dict) -> Optional[tuple[int, str]]:
    """None when the step sequences are identical, else (index, message naming the first differing step)."""
    a, b = step_signatures(sim_frames), step_signatures(torch_frames)
    ann_a = sim_frames["steps"].annotation.tolist()
    ann_b = torch_frames["steps"].annotation.tolist()
    for i in range(max(len(a), len(b))):
        sa = a[i] if i < len(a) else None
        sb = b[i] if i < len(b) else None
        if sa != sb:
            return i, (f"step sequences differ at recorded step #{i}: sim ran "
                       f"{_describe(sa, ann_a[i] if i < len(ann_a) else None)}; torch ran "
                       f"{_describe(sb, ann_b[i] if i < len(ann_b) else None)} "
                       "(rows are request:tokens@computed_before)")
    return None


def identical_share(sim_frames: dict, torch_frames: dict) -> tuple[float, Optional[int]]:
    """(share of positions with identical step composition over the longer sequence, first divergent index)."""
    a, b = step_signatures(sim_frames), step_signatures(torch_frames)
    n = max(len(a), len(b))
    if n == 0:
        return 1.0, None
    same = [i < len(a) and i < len(b) and a[i][1:] == b[i][1:] for i in range(n)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return float(sum(same)) / n, first


# -- metrics --------------------------------------------------------------------------------------------
def signed_pct(pred: float, meas: float) -> Optional[float]:
    if pred is None or meas is None or not (math.isfinite(pred) and math.isfinite(meas)) or meas == 0:
        return None
    return (pred - meas) / meas * 100.0


def _abs(x: Optional[float]) -> Optional[float]:
    return None if x is None else abs(x)


def phases_of(steps) -> np.ndarray:
    return np.array([step_phase_class(int(c), int(g)) for c, g in
                     zip(steps.num_context_reqs.to_numpy(), steps.num_generation_reqs.to_numpy())])


def makespan(frames: dict) -> float:
    st = frames["steps"]
    return float(st.t_end_s.max()) if len(st) else 0.0


def throughput(frames: dict, output_only: bool = False) -> Optional[float]:
    """Tokens of completed sequences per second of makespan: prompt + output (vLLM's "total token
    throughput"), or output only (its headline "output token throughput")."""
    reqs = frames["requests"]
    done = reqs[reqs.finish_reason.notna() & (reqs.finish_reason != "abort")]
    span = makespan(frames)
    tokens = done.output_tokens.sum() if output_only else done.prompt_tokens.sum() + done.output_tokens.sum()
    return float(tokens) / span if span > 0 else None


def latency_percentiles(frames: dict) -> dict[str, dict[str, Optional[float]]]:
    out = {}
    reqs = frames["requests"]
    for name, col in LATENCIES:
        v = reqs[col].to_numpy(dtype=float)
        v = v[np.isfinite(v)]
        if v.size:
            p50, p90, p99 = np.percentile(v, [50, 90, 99])
            out[name] = {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(v.mean())}
        else:
            out[name] = {"p50": None, "p90": None, "p99": None, "mean": None}
    return out


def _median(values: list[Optional[float]]) -> Optional[float]:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return float(np.median(v)) if v else None


def _pairwise_noise(values: list[Optional[float]]) -> Optional[dict[str, float]]:
    """|a - b| / b * 100 over ordered pairs of repeats (both orders): machine noise of one metric."""
    v = [x for x in values if x is not None and math.isfinite(x) and x != 0]
    if len(v) < 2:
        return None
    d = [abs(a - b) / b * 100.0 for a, b in itertools.permutations(v, 2)]
    return {"mean": float(np.mean(d)), "max": float(np.max(d)), "pairs": len(d) // 2}


def _pooled_step_noise(measured: np.ndarray) -> Optional[dict[str, Any]]:
    """Per-step |m_i - m_j| / m_j over every ordered pair of repeats (measured: steps x repeats)."""
    if measured.shape[1] < 2:
        return None
    d = [np.abs(measured[:, i] - measured[:, j]) / measured[:, j] * 100.0
         for i, j in itertools.permutations(range(measured.shape[1]), 2)]
    return pct_stats(np.concatenate(d))


# -- the comparison -------------------------------------------------------------------------------------
def compare(exp: ExperimentConfig, out_dir: str, *, repeats: int = 1, threads: Optional[int] = None,
            plots: bool = True, config_path: Optional[str] = None, retry_contended: int = 0,
            max_contended_share: float = 0.05, probe_steps: bool = True,
            log: Callable[[str], None] = lambda m: print(m, file=sys.stderr), overwrite: bool = False,
            folder: Optional[Any] = None) -> dict[str, Any]:
    """Run the comparison, write tables / plots / comparison.md / comparison.json (last); returns the
    JSON dict. The output folder follows `servetwin.experiments.run.run_folder` (locked, a non-empty one
    refused unless `overwrite`, nothing touched until the measurements are done).

    Raises `CompositionMismatch` (offline) after writing the traces and a comparison.json marked
    `identical_composition: false`.

    `retry_contended`: a measured repeat in which more than `max_contended_share` of the steps lost
    their CPU to other processes (see `contention`) is run again, at most this many times in all;
    the discarded attempts are listed in `discarded_repeats` (default 0: every repeat counts)."""
    from servetwin.experiments.run.run_folder import RunFolder  # noqa: PLC0415
    from servetwin.experiments.config.workloads import build_requests  # noqa: PLC0415

    if repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {repeats}")
    if folder is None:
        with RunFolder(out_dir, overwrite=overwrite) as owned:
            return compare(exp, out_dir, repeats=repeats, threads=threads, plots=plots, config_path=config_path,
                           retry_contended=retry_contended, max_contended_share=max_contended_share,
                           probe_steps=probe_steps, log=log, folder=owned)
    import yaml  # noqa: PLC0415
    cal_label, cal_prov = calibration_info(exp)
    nthreads, _ = apply_threads(exp, threads)
    cal_model = cal_prov.get("model")
    notes: list[str] = []
    if cal_prov.get("calibrated") and cal_model:
        from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

        try:
            same = load_model_spec(cal_model).name == load_model_spec(exp.model).name
        except ValueError:
            same = str(cal_model) == str(exp.model)
        if not same:
            notes.append(f"the calibration was fitted for model {cal_model!r}, this config runs {exp.model!r}")
    elif not cal_prov.get("calibrated"):
        notes.append(f"hardware {cal_label!r} is not a calibration (uncalibrated coefficients)")
    for n in notes:
        log(f"compare: warning: {n}")
    load_before = load_average()
    t0 = time.perf_counter()
    torch_engine, tinfo = build_torch_engine(exp)
    del torch_engine  # each run builds its own EngineCore over this executor
    ex = tinfo.executor
    log(f"compare: torch engine ready in {time.perf_counter() - t0:.1f}s ({tinfo.num_gpu_blocks} KV blocks, "
        f"dtype {str(getattr(ex, 'dtype', '?')).replace('torch.', '')}, "
        f"attention {getattr(ex, 'attention_backend_name', '?')}, {nthreads} torch threads)")
    for n in calibration_mismatches(exp, ex, nthreads):
        notes.append(n)
        log(f"compare: warning: {n}")
    requests, arrival, rng = build_requests(exp, tinfo.vocab_size)
    from servetwin.sim.arrivals import Offline  # noqa: PLC0415

    offline = isinstance(arrival, Offline)
    warm_s = warm_up(exp.engine_args("torch"), tinfo, requests)
    sim_engine, probe, refresh = probe_drift(exp, tinfo, nthreads, log) if probe_steps else (
        build_sim_engine(exp, tinfo)[0], None, None)
    if refresh is not None:  # the replaced calibration's provenance would be reported otherwise
        cal_label, cal_prov = calibration_info(exp)
    cost_model = sim_engine.executor.cost_model
    sim_rec, sim_wall, sim_rej = run_sim(exp, sim_engine, requests, arrival, rng, exp.name)
    sim_frames = sim_rec.frames()
    log(f"compare: sim {len(sim_frames['steps'])} steps, {makespan(sim_frames):.3f}s simulated in {sim_wall:.2f}s")

    def once(cpu_s: dict[int, float]):
        fr, wall = run_torch(exp, tinfo, requests, offline, exp.name)
        return fr, fr["steps"], wall

    measured = measure(once, ex, nthreads, repeats=repeats, retry_contended=retry_contended,
                       max_contended_share=max_contended_share, log=log, label="compare: torch repeat")
    torch_frames = [m.result for m in measured.kept]
    torch_walls = [m.wall_s for m in measured.kept]
    discarded = measured.discarded
    for m in measured.kept:
        m.result["steps"]["cpu_share"] = m.cpu_share
    load_after = load_average()
    close = getattr(ex, "close", None)
    if callable(close):
        close()
    # the write phase: the folder is cleared (with overwrite) only now, every file renamed into place
    from servetwin.experiments.run.report import portable_config  # noqa: PLC0415

    folder.write_text("config.yaml", yaml.safe_dump(portable_config(exp.to_dict(), out_dir), sort_keys=False))
    for path in sim_rec.write(folder.subdir("sim")).values():
        folder.record(os.path.relpath(path, out_dir))
    for r, fr in enumerate(torch_frames):
        d = "torch" if r == 0 else f"torch_r{r}"
        for name, df in fr.items():  # the standard trace schema (the CPU columns go to steps_paired)
            df = df.drop(columns=["cpu_share"], errors="ignore")
            folder.write_with(os.path.join(d, f"{name}.parquet"), lambda tmp, df=df: df.to_parquet(tmp, index=False))
    base = {
        "mode": "offline" if offline else "online",
        "workload": {"requests": len(requests), "arrival": type(arrival).__name__}, "name": exp.name, "config": config_path,
        "model": exp.model, "calibration": cal_label,
        "calibration_provenance": {k: cal_prov.get(k) for k in ("source", "calibrated", "date", "device", "model",
                                                                "dtype", "attention_backend", "cuda_graphs",
                                                                "torch_threads", "samples", "versions", "machine")
                                   if k in cal_prov},
        "repeats": repeats, "torch_threads": nthreads, "units": "percent (abs_pct = |pred - meas| / meas * 100)",
        "load_average": {"before": load_before, "after": load_after}, "notes": notes,
        "num_gpu_blocks": int(tinfo.num_gpu_blocks), "max_model_len": int(tinfo.max_model_len),
        "dtype": str(getattr(ex, "dtype", "")).replace("torch.", ""),
        "attention_backend": getattr(ex, "attention_backend_name", None),
        "wall_s": {"sim": sim_wall, "torch": torch_walls, "torch_warmup": warm_s},
        "targets": TARGETS, "discarded_repeats": discarded, "calibration_probe": probe,
        "calibration_refresh": refresh,
        "retry_contended": {"retries": retry_contended, "max_contended_share": max_contended_share},
    }
    if offline:
        for r, fr in enumerate(torch_frames):
            diff = first_difference(sim_frames, fr)
            if diff is not None:
                idx, msg = diff
                msg = (f"offline composition mismatch (torch repeat {r + 1}/{repeats}): {msg}")
                result = dict(base, identical_composition=False, identical_step_share=identical_share(sim_frames, fr)[0],
                              first_differing_step=idx, error=msg)
                folder.write_json("comparison.json", result)
                raise CompositionMismatch(msg)
    result = _score(base, exp, sim_frames, torch_frames, cost_model, offline)
    paired = result.pop("_paired")
    folder.write_with("steps_paired.parquet", lambda tmp: paired.to_parquet(tmp, index=False))
    plot_paths = {}
    if plots:
        from servetwin.experiments.compare.compare_plots import comparison_plots  # noqa: PLC0415
        from servetwin.experiments.run.plots import context_for  # noqa: PLC0415

        plot_paths = comparison_plots(sim_frames, torch_frames, paired, out_dir, context_for(exp))  # PNGs renamed into place
    result["plots"] = {k: os.path.basename(v) for k, v in plot_paths.items() if v}
    for name in result["plots"].values():
        folder.record(name)
    from servetwin.experiments.compare.compare_report import write_comparison_md  # noqa: PLC0415

    folder.record(os.path.basename(write_comparison_md(result, exp, out_dir)))
    folder.write_json("comparison.json", result)  # last: the comparison of record
    return result


def _score(base: dict, exp, sim_frames: dict, torch_frames: list[dict], cost_model, offline: bool) -> dict:
    import pandas as pd  # noqa: PLC0415

    R = len(torch_frames)
    res = dict(base)
    # per-step pairs
    if offline:
        pred = sim_frames["steps"].duration_s.to_numpy(dtype=float)
        meas = np.stack([fr["steps"].duration_s.to_numpy(dtype=float) for fr in torch_frames], axis=1)
        st = torch_frames[0]["steps"]
        res["identical_composition"] = True
        res["identical_step_share"] = 1.0
        res["first_divergent_step"] = None
        res["step_error_basis"] = "sim step vs the torch step at the same position (identical composition)"
        repeat_of = None
    else:
        preds, meas_list, phase_list, rep_list = [], [], [], []
        shares, firsts = [], []
        for r, fr in enumerate(torch_frames):
            p = predicted_durations(fr, cost_model)
            preds.append(p)
            meas_list.append(fr["steps"].duration_s.to_numpy(dtype=float))
            rep_list.append(np.full(len(p), r))
            share, first = identical_share(sim_frames, fr)
            shares.append(share)
            firsts.append(first)
        res["identical_composition"] = all(s == 1.0 for s in shares)
        res["identical_step_share"] = float(np.mean(shares))
        res["identical_step_share_per_repeat"] = shares
        res["first_divergent_step"] = firsts[0]
        res["step_error_basis"] = ("cost model prediction for each measured torch step's own composition "
                                   "(decisions diverge online, so steps are not paired with the sim's)")
        pred = np.concatenate(preds)
        meas = np.concatenate(meas_list)[:, None]
        st = pd.concat([fr["steps"] for fr in torch_frames], ignore_index=True)
        repeat_of = np.concatenate(rep_list)
    phase = phases_of(st)
    abs_pct = np.abs(pred[:, None] - meas) / meas * 100.0  # steps x repeats (online: x 1)
    res["steps"] = int(len(pred))
    res["step_counts"] = {"sim": int(len(sim_frames["steps"])), "torch": [int(len(fr["steps"])) for fr in torch_frames]}
    res["step_abs_pct_error"] = pct_stats(abs_pct.ravel())
    res["step_signed_pct_error_mean"] = float(np.nanmean((pred[:, None] - meas) / meas * 100.0)) if len(pred) else None
    res["by_phase"] = {}
    for ph in PHASES:
        m = phase == ph
        if m.any():
            stats = pct_stats(abs_pct[m].ravel())
            stats["signed_mean"] = float(np.nanmean(((pred[:, None] - meas) / meas * 100.0)[m]))
            stats["share_of_measured_time"] = float(meas[m].sum() / meas.sum())
            res["by_phase"][ph] = stats
    if offline and R > 1:
        med = np.median(meas, axis=1)
        res["step_abs_pct_error_vs_median_of_repeats"] = pct_stats(np.abs(pred - med) / med * 100.0)
    # makespan, throughput, latencies
    pred_span = makespan(sim_frames)
    spans = [makespan(fr) for fr in torch_frames]
    meas_span = _median(spans)
    res["makespan_s"] = {"predicted": pred_span, "measured": meas_span, "measured_per_repeat": spans}
    res["makespan_signed_pct_error"] = signed_pct(pred_span, meas_span)
    res["makespan_pct_error"] = _abs(res["makespan_signed_pct_error"])
    busy = [float(fr["steps"].duration_s.sum()) for fr in torch_frames]
    res["torch_time_between_steps_share"] = (None if not meas_span else
                                             float(np.median([(s - b) / s for s, b in zip(spans, busy) if s > 0])))
    pred_tp = throughput(sim_frames)
    tps = [throughput(fr) for fr in torch_frames]
    res["throughput_tok_s"] = {"predicted": pred_tp, "measured": _median(tps), "measured_per_repeat": tps}
    res["throughput_signed_pct_error"] = signed_pct(pred_tp, _median(tps))
    res["throughput_pct_error"] = _abs(res["throughput_signed_pct_error"])
    out_tps = [throughput(fr, output_only=True) for fr in torch_frames]
    res["output_throughput_tok_s"] = {"predicted": throughput(sim_frames, output_only=True),
                                      "measured": _median(out_tps), "measured_per_repeat": out_tps}
    pred_lat = latency_percentiles(sim_frames)
    meas_lat_reps = [latency_percentiles(fr) for fr in torch_frames]
    res["latency_s"] = {}
    for name, _ in LATENCIES:
        m = {q: _median([ml[name][q] for ml in meas_lat_reps]) for q in ("p50", "p90", "p99", "mean")}
        res["latency_s"][name] = {"predicted": pred_lat[name], "measured": m,
                                  "measured_per_repeat": [ml[name] for ml in meas_lat_reps]}
        signed = {q: signed_pct(pred_lat[name][q], m[q]) for q in ("p50", "p90", "p99")}
        res[f"{name}_signed_pct_error"] = signed
        res[f"{name}_pct_error"] = {q: _abs(v) for q, v in signed.items()}
    if offline:  # per-request pairs (same requests, same decisions)
        sreq = sim_frames["requests"][["request_id", "e2e_s"]]
        e2e = []
        for fr in torch_frames:
            j = sreq.merge(fr["requests"][["request_id", "e2e_s"]], on="request_id", suffixes=("_sim", "_torch"))
            e2e.append(np.abs(j.e2e_s_sim - j.e2e_s_torch) / j.e2e_s_torch * 100.0)
        res["request_e2e_abs_pct_error"] = pct_stats(np.concatenate([x.to_numpy(dtype=float) for x in e2e]))
    # noise: measured vs measured between repeats
    if R > 1:
        noise: dict[str, Any] = {"repeats": R}
        if offline:
            noise["step_abs_pct_error"] = _pooled_step_noise(meas)
            for ph in PHASES:
                m = phase == ph
                if m.any():
                    noise.setdefault("by_phase", {})[ph] = _pooled_step_noise(meas[m])
        noise["makespan_pct_error"] = _pairwise_noise(spans)
        noise["throughput_pct_error"] = _pairwise_noise(tps)
        for name, _ in LATENCIES:
            noise[f"{name}_pct_error"] = {q: _pairwise_noise([ml[name][q] for ml in meas_lat_reps])
                                          for q in ("p50", "p90", "p99")}
        res["noise"] = noise
    else:
        res["noise"] = None
    # per repeat headline figures
    per = []
    for r, fr in enumerate(torch_frames):
        if offline:
            a = abs_pct[:, r]
        else:
            a = abs_pct[repeat_of == r, 0]
        lat = latency_percentiles(fr)
        per.append({"repeat": r + 1, "step_abs_pct_error": pct_stats(a),
                    "makespan_signed_pct_error": signed_pct(pred_span, spans[r]),
                    "e2e_p50_signed_pct_error": signed_pct(pred_lat["e2e"]["p50"], lat["e2e"]["p50"]),
                    "throughput_signed_pct_error": signed_pct(pred_tp, tps[r])})
    res["per_repeat"] = per
    e2e50 = res["e2e_pct_error"]["p50"]
    res["meets_targets"] = {
        "step_p50": res["step_abs_pct_error"]["p50"] is not None and res["step_abs_pct_error"]["p50"] <= TARGETS["step_p50"],
        "step_p90": res["step_abs_pct_error"]["p90"] is not None and res["step_abs_pct_error"]["p90"] <= TARGETS["step_p90"],
        "makespan": res["makespan_pct_error"] is not None and res["makespan_pct_error"] <= TARGETS["makespan"],
        "e2e_p50": e2e50 is not None and e2e50 <= TARGETS["e2e_p50"],
    }
    # the paired table (one row per measured step and repeat)
    rows = {"repeat": (np.repeat(np.arange(1, R + 1)[None, :], len(pred), axis=0).ravel() if offline
                       else repeat_of + 1),
            "step": (np.repeat(st.step.to_numpy()[:, None], R, axis=1).ravel() if offline else st.step.to_numpy()),
            "annotation": (np.repeat(st.annotation.to_numpy()[:, None], R, axis=1).ravel() if offline
                           else st.annotation.to_numpy()),
            "phase": np.repeat(phase[:, None], R, axis=1).ravel() if offline else phase,
            "total_tokens": (np.repeat(st.total_tokens.to_numpy()[:, None], R, axis=1).ravel() if offline
                             else st.total_tokens.to_numpy()),
            "num_reqs": (np.repeat(st.num_reqs.to_numpy()[:, None], R, axis=1).ravel() if offline
                         else st.num_reqs.to_numpy()),
            "t_start_s": (np.concatenate([fr["steps"].t_start_s.to_numpy() for fr in torch_frames]) if not offline
                          else np.stack([fr["steps"].t_start_s.to_numpy() for fr in torch_frames], axis=1).ravel()),
            "predicted_s": np.repeat(pred[:, None], R, axis=1).ravel() if offline else pred,
            "measured_s": meas.ravel() if offline else meas[:, 0]}
    rows["cpu_share"] = (np.stack([fr["steps"].cpu_share.to_numpy(dtype=float) for fr in torch_frames], axis=1).ravel()
                         if offline else np.concatenate([fr["steps"].cpu_share.to_numpy(dtype=float)
                                                         for fr in torch_frames]))
    paired = pd.DataFrame(rows)
    paired["signed_pct_error"] = (paired.predicted_s - paired.measured_s) / paired.measured_s * 100.0
    paired["abs_pct_error"] = paired.signed_pct_error.abs()
    share = paired.cpu_share.to_numpy(dtype=float)
    full = share >= CONTENDED_BELOW
    res["contention"] = dict(contention_summary(share),
                             step_abs_pct_error_uncontended=pct_stats(paired.abs_pct_error.to_numpy()[full]))
    res["_paired"] = paired
    return res
