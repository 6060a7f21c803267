"""`servetwin calibrate`: measure a designed set of engine steps on the real backend, fit the cost model.

The design is run through the real `EngineCore` (the shared scheduler over the `TorchExecutor`) with
crafted requests, so every measured step is a step the engine really schedules, and the measured
quantity is exactly what `servetwin run` / `servetwin compare` record for the torch backend: the
wall time of one `EngineCore.step()` (schedule + execute + update), `time.perf_counter()`.

Design (every case is repeated `repeats` times, shapes interleaved so a burst of machine noise does
not hit all repeats of one shape; a warm-up pass of each kind runs first and is not recorded):

- pure prefills: one request of `q` new tokens after a cached prefix of `s` tokens (the prefix was
  computed by an earlier request, the prefix cache supplies it), `q` over `prefill_chunks`, `s` over
  `prefill_prefixes`; `max_tokens=1`, so the step samples and the request ends;
- batched prefills: `k` requests of `q` tokens in one step (`prefill_batches`);
- partial prefills: a prompt longer than the token budget, so one chunk does not sample
  (separates the LM-head term from the per-request one);
- pure decodes: `b` requests with their own prompts of `kv` tokens, `decode_steps` decode steps each,
  `b` over `decode_batches`, `kv` over `decode_kv` (their batched, chunked prefills - many of them
  mixed with the first decodes - are samples too), plus a few decode batches over one shared cached
  prefix (`decode_shared`: prefix-sharing workloads read the same KV blocks);
- mixed steps: `b` decoding requests plus one new prefill chunk of `q` tokens (`mixed`).

Every step's process CPU time is recorded too: a step whose CPU time is below 0.9 x its wall time x
the torch threads lost its core to another process (a shared machine) and is left out of the fit.

The fit is `servetwin.sim.calibration.fit_coefficients` (NNLS on `CostModel.basis`, relative weighting by
default: it minimises per-step percentage error). Terms that are constant or zero on this backend
are left out (`layer` on the CPU, where every step runs eagerly: it is `step` times L; `comm` and
`ipc_*`). Steps slowed by machine noise (other processes) are outliers in relative error: after a
first fit, samples whose relative residual is further than `trim` robust standard deviations (MAD)
from the median are dropped and the fit is repeated; how many were dropped, and the residuals over
all samples, are recorded next to those of the samples used.

The output is a hardware YAML file (`base: <preset>` plus the preset's peak / bandwidth fields, the
fitted `coefficients` and a `provenance` record) that `servetwin.sim.hardware.load_hardware` and an
experiment's `hardware:` field accept.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from servetwin.core.testbed.atomic import atomic_open
from servetwin.experiments.calibrate.cpu_info import cpu_name, isa_flags, torch_version
from servetwin.experiments.calibrate.torch_measure import (CONTENDED_BELOW, calibration_info, cpu_shares, load_average,
                                                 set_torch_threads)
from servetwin.experiments.calibrate.design import DESIGNS, CalibrationDesign, run_design, step_rows
from servetwin.experiments.calibrate.drift_probe import measure_probe, score_probe
from servetwin.sim.coefficients import BASIS_TERMS, GPU_ONLY_TERMS

MEASURED_QUANTITY = ("wall time of one EngineCore.step() (schedule + execute_model + update_from_output), "
                     "time.perf_counter(), in-process engine (no IPC): what `servetwin run`/`compare` record "
                     "for the torch backend")


MAX_LINK_BANDWIDTH = 1e15  # bytes/s: a measured all-reduce with no size dependence (a finite stand-in)


def fit_terms(cost_model) -> list[str]:
    """Basis terms worth fitting on this backend (see the module docstring)."""
    terms = [t for t in BASIS_TERMS if t not in ("comm", "ipc_step", "ipc_req") + GPU_ONLY_TERMS]
    if not cost_model.model.is_moe:
        terms.remove("moe")  # always 0 for a dense model
    if not cost_model.cuda_graphs:
        terms.remove("layer")  # always L on an eager backend: collinear with `step`
    else:
        terms[terms.index("layer")] = "layer_piecewise"  # graphs on: steps outside a full graph
    if cost_model.tp > 1:
        terms.append("comm")
    return terms


def _rel_stats(rel: np.ndarray) -> dict[str, Any]:
    a = np.abs(rel)
    if a.size == 0:
        return {"count": 0}
    return {"count": int(a.size), "median_abs_rel_err": float(np.median(a)),
            "p90_abs_rel_err": float(np.quantile(a, 0.9)), "mean_abs_rel_err": float(a.mean()),
            "max_abs_rel_err": float(a.max()), "mean_rel_err": float(rel.mean())}


@dataclass
class CalibrationFit:
    fit: Any  # servetwin.sim.calibration.FitResult on the samples used
    terms: list[str]
    used: np.ndarray  # bool mask over all samples
    rel_all: np.ndarray  # relative residuals (pred - meas) / meas on all samples
    phases: list[str]
    durations: np.ndarray
    trim_rounds: int = 0
    summary: dict[str, Any] = field(default_factory=dict)


def fit_from_tables(steps, step_requests, cost_model, weighting: str = "relative", trim: Optional[float] = 4.0,
                    terms: Optional[list[str]] = None, max_rounds: int = 3,
                    exclude_steps: Optional[set[int]] = None) -> CalibrationFit:
    """Fit the cost model's coefficients to measured steps (trace tables of one torch run).

    `exclude_steps`: step numbers left out of the fit from the start (e.g. steps that lost their CPU
    to other processes); their residuals still count in `all_samples`."""
    from servetwin.sim.calibration import fit_coefficients  # noqa: PLC0415

    nums, rows, t, phases = step_rows(steps, step_requests)
    if len(rows) < 3:
        raise ValueError(f"calibrate: only {len(rows)} measured steps; need at least 3")
    basis = [cost_model.basis(summary) for summary in rows]
    terms = list(terms) if terms is not None else fit_terms(cost_model)
    A = np.array([[b[k] for k in terms] for b in basis])
    excluded = np.array([n in (exclude_steps or ()) for n in nums], dtype=bool)
    if (~excluded).sum() < len(terms) + 2:
        excluded[:] = False  # too few left: fit on everything rather than fail
    used = ~excluded
    rounds = 0
    while True:
        fit = fit_coefficients([basis[i] for i in np.flatnonzero(used)], t[used], terms=terms,
                               weighting=weighting)
        c = np.array([fit.coefficients.get(k, 0.0) for k in terms])
        rel = (A @ c - t) / t
        if trim is None or rounds >= max_rounds:
            break
        med = float(np.median(rel[used]))
        mad = 1.4826 * float(np.median(np.abs(rel[used] - med)))
        keep = (np.abs(rel - med) <= max(trim * mad, 0.02)) & ~excluded
        if keep.sum() < max(len(terms) + 2, int(0.7 * len(t))) or (keep == used).all():
            break
        used = keep
        rounds += 1
    by_phase = {}
    for ph in ("prefill", "decode", "mixed"):
        m = np.array([p == ph for p in phases])
        if m.any():
            by_phase[ph] = _rel_stats(rel[m])
    summary = {
        "all_samples": _rel_stats(rel), "used_samples": _rel_stats(rel[used]),
        "dropped_as_contended": int(excluded.sum()),
        "dropped_as_outliers": int((~used & ~excluded).sum()), "trim_mad_multiple": trim, "trim_rounds": rounds,
        "by_phase_all_samples": by_phase,
    }
    return CalibrationFit(fit, terms, used, rel, phases, t, rounds, summary)


# -- provenance -----------------------------------------------------------------------------------
def device_name(device: str) -> str:
    import torch  # noqa: PLC0415

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_name()} ({os.cpu_count()} logical CPUs, {platform.machine()})"


def machine_fingerprint(device: str = "cpu") -> dict[str, Any]:
    """What a calibration is only valid for: CPU model and count (the engine's host-side time runs
    there), the ISA flags that change CPU kernel speed, torch's version, the accelerator, the platform.
    Stored in a calibration's provenance as `machine`."""
    fp: dict[str, Any] = {"cpu_model": cpu_name(), "logical_cpus": os.cpu_count(), "arch": platform.machine(),
                          "isa_flags": isa_flags(), "torch": torch_version()}
    if str(device).startswith("cuda"):
        fp["gpu"] = device_name(device)
    return fp


def fingerprint_differences(calibration: dict[str, Any], machine: dict[str, Any], threads: int,
                            dtype: Optional[str] = None) -> list[str]:
    """Warnings for a comparison whose machine, thread count or dtype differ from the calibration's
    (`calibration`: its provenance). Files written before `machine` existed: the `device` text."""
    notes = []
    cal_fp = calibration.get("machine") or {}
    if not cal_fp and calibration.get("device"):
        here = device_name("cpu") if "gpu" not in machine else machine["gpu"]
        if str(calibration["device"]) != here:
            notes.append(f"the calibration was made on {calibration['device']!r}, this machine is {here!r}")
    for key, what in (("cpu_model", "CPU"), ("logical_cpus", "logical CPU count"), ("gpu", "GPU")):
        if key in cal_fp and cal_fp.get(key) != machine.get(key):
            notes.append(f"the calibration was made on another machine: {what} {cal_fp[key]!r}, here "
                         f"{machine.get(key)!r}")
    if "isa_flags" in cal_fp and set(cal_fp["isa_flags"]) != set(machine.get("isa_flags", [])):
        there, here = set(cal_fp["isa_flags"]), set(machine.get("isa_flags", []))
        diff = [f"{f} only here" for f in sorted(here - there)] + [f"{f} only there" for f in sorted(there - here)]
        notes.append(f"the calibration's CPU has other kernel-speed flags ({', '.join(diff)}); use "
                     "`hardware: auto` to calibrate this machine")
    elif "isa_flags" not in cal_fp and cal_fp:
        notes.append("the calibration does not record its CPU's ISA flags (AVX2 / AVX-512 / AMX), so it cannot "
                     f"be checked against this one ({', '.join(machine.get('isa_flags', [])) or 'none known'}); "
                     "`hardware: auto` calibrates this machine")
    if cal_fp.get("torch") and machine.get("torch") and cal_fp["torch"] != machine["torch"]:
        notes.append(f"the calibration was measured with torch {cal_fp['torch']}, here {machine['torch']}")
    cal_threads = calibration.get("torch_threads")
    if isinstance(cal_threads, int) and cal_threads != threads:
        notes.append(f"the calibration was measured with {cal_threads} torch thread(s), this run uses {threads}")
    if dtype and calibration.get("dtype") and calibration["dtype"] != dtype:
        notes.append(f"the calibration was measured in {calibration['dtype']}, the torch backend runs {dtype}")
    return notes


def calibration_mismatches(exp: Any, executor: Any, nthreads: int) -> list[str]:
    """Warnings when `hardware:` is a calibration made on another machine, with another thread count
    or in another dtype than this torch run (its simulated step costs then do not describe this run)."""
    prov = calibration_info(exp)[1]
    if not prov.get("calibrated"):
        return []
    device = str(exp.engine.given.get("device", "cpu"))
    dtype = str(getattr(executor, "dtype", "")).replace("torch.", "")
    return fingerprint_differences(prov, machine_fingerprint(device if device != "auto" else "cpu"), nthreads, dtype)


def versions() -> dict[str, str]:
    import importlib.metadata as md  # noqa: PLC0415

    out = {"python": platform.python_version()}
    for pkg in ("servetwin", "torch", "transformers", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        import torch  # noqa: PLC0415

        if torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
    except Exception:  # noqa: BLE001
        pass
    return out


CUDA_PRESET_BY_NAME = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80g"), ("L40S", "l40s"))


def default_base(device: str) -> str:
    if not str(device).startswith("cuda"):
        return "cpu"
    name = device_name(device)
    for key, preset in CUDA_PRESET_BY_NAME:
        if key.lower() in name.lower():
            return preset
    raise ValueError(f"--base: no hardware preset matches the device {name!r}; give one with --base")


def calibration_document(base: str, cal: CalibrationFit, provenance: dict[str, Any],
                         name: Optional[str] = None, efficiency: Any = None) -> dict[str, Any]:
    """The YAML document: `base`, the preset's fields (self-contained), coefficients, provenance.
    `efficiency`: the one the fit used when it is not the preset's (a measured GEMM curve)."""
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415

    hw = load_hardware(base)
    if efficiency is not None:
        hw = dataclasses.replace(hw, efficiency=efficiency)
    coeffs = cal.fit.to_coefficients(hw.coefficients).to_dict()
    if "layer" not in cal.terms:  # eager backend: the per-layer launch cost is inside `step`
        coeffs["c_layer"] = 0.0
    for term in GPU_ONLY_TERMS:  # not fitted: what they stand for is inside the fitted terms now
        if term not in cal.terms:
            coeffs[f"c_{term}"] = 0.0
    doc: dict[str, Any] = {
        "base": base,
        "name": name or f"{hw.name}-{provenance.get('model', 'model')}-calibrated",
        "device_type": hw.device_type,
        "peak_flops_bf16": hw.peak_flops_bf16, "peak_flops_fp32": hw.peak_flops_fp32,
        "memory_bandwidth": hw.memory_bandwidth, "memory_bytes": hw.memory_bytes,
        "interconnect_bandwidth": hw.interconnect_bandwidth, "interconnect_latency_s": hw.interconnect_latency_s,
        "peak_flops_fp8": hw.peak_flops_fp8,
        "efficiency": hw.efficiency.to_dict(),  # the basis the coefficients were fitted on
        "coefficients": {k: float(v) for k, v in coeffs.items()},
        "provenance": provenance,
    }
    return doc


def measure_gemm_curve(executor: Any, model: str, base: str, max_tokens: int,
                       log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """Time the model's layer GEMMs at every token count the design can schedule
    (`servetwin.gpu.gemm_profile`) and turn them into `Efficiency.gemm_m_curve` on top of the base
    preset's efficiencies: (the efficiency, its provenance with the measured seconds)."""
    from servetwin.gpu.gemm_profile import curve_token_counts, layer_gemm_seconds  # noqa: PLC0415
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415
    from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

    dtype = str(executor.dtype).replace("torch.", "")
    hw = load_hardware(base)
    peak = hw.peak_flops(dtype)
    flops_per_token = 2.0 * load_model_spec(model, dtype=dtype).layer_matmul_params
    t0 = time.perf_counter()
    seconds = layer_gemm_seconds(executor.model, curve_token_counts(max_tokens))
    raw = {m: flops_per_token * m / (peak * t) for m, t in seconds.items()}
    curve = tuple((float(m), min(f, 1.0)) for m, f in raw.items())
    log(f"calibrate: layer GEMMs timed at {len(seconds)} token counts in {time.perf_counter() - t0:.1f}s "
        f"({min(raw.values()) * 100:.1f}-{max(raw.values()) * 100:.1f}% of the {peak / 1e9:.0f} GFLOP/s peak)")
    efficiency = dataclasses.replace(hw.efficiency, gemm_m_curve=curve)
    provenance = {
        "measured": "seconds of one layer's dense projections (qkv, o, gate_up, down) at M tokens, median of 5 "
                    "(servetwin.gpu.gemm_profile); fraction = 2 * M * layer_matmul_params / (peak * seconds)",
        "peak_flops": peak, "seconds": {int(m): float(t) for m, t in seconds.items()},
        "clamped_to_peak": sorted(int(m) for m, f in raw.items() if f > 1.0)}
    return efficiency, provenance


def calibrate_allreduce(doc: dict[str, Any], hw: Any, spec: Any, tp: int, log: Callable[[str], None]) -> None:
    """The CPU's link for tensor parallelism: gloo all-reduces of [T, hidden] between `tp` processes,
    fitted as the cost model prices them (`interconnect_latency_s`, `interconnect_bandwidth` over the comm
    efficiency), written into `doc` with the samples in its provenance."""
    from servetwin.experiments.calibrate.allreduce import measure_allreduce  # noqa: PLC0415

    t0 = time.perf_counter()
    fit = measure_allreduce(spec.hidden_size, spec.dtype, tp)
    bandwidth = min(fit.bandwidth, MAX_LINK_BANDWIDTH) / hw.efficiency.comm_bandwidth
    doc["interconnect_bandwidth"], doc["interconnect_latency_s"] = float(bandwidth), float(fit.latency_s)
    doc["provenance"]["gloo_allreduce"] = {"tp": tp, "hidden_size": spec.hidden_size, "dtype": spec.dtype,
                                           **fit.to_dict()}
    log(f"calibrate: gloo all-reduce at TP={tp} in {time.perf_counter() - t0:.1f}s: {fit.latency_s * 1e6:.0f} us + "
        f"bytes / {fit.bandwidth / 1e9:.2f} GB/s")


def calibrate_tp_step(doc: dict[str, Any], model: str, dtype: str, tp: int, cuda_graphs: bool,
                      log: Callable[[str], None]) -> None:
    """The per-step cost of running the model split over `tp` worker processes that the single-process
    design cannot see (the SchedulerOutput broadcast through shared memory, the workers' wake-up, the
    output's return: `c_tp_step`, docs/parallelism.md): the drift probe's steps on a real, warmed-up TP
    engine, priced by `doc`'s fitted model (the all-reduces included), `c_tp_step` = the median shortfall.
    A model whose heads `tp` does not divide is skipped (recorded)."""
    from servetwin.core.engine.engine_args import EngineArgs  # noqa: PLC0415
    from servetwin.experiments.calibrate.drift_probe import measure_probe  # noqa: PLC0415
    from servetwin.experiments.calibrate.design import predicted_durations  # noqa: PLC0415
    from servetwin.sim.cost_model import CostModel  # noqa: PLC0415
    from servetwin.sim.hardware import hardware_from_dict  # noqa: PLC0415
    from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

    spec = load_model_spec(model, dtype=dtype)
    if spec.num_heads % tp:  # (KV heads fewer than tp are replicated, as vLLM does)
        doc["provenance"]["tp_step"] = {"tp": tp, "skipped": f"{spec.num_heads} heads are not split over {tp}"}
        return
    from servetwin.core.engine.engine_factory import create_executor  # noqa: PLC0415

    t0 = time.perf_counter()
    args = EngineArgs.from_kwargs(model=model, backend="torch", device="cpu", dtype=dtype, tensor_parallel_size=tp,
                                  block_size=16, num_gpu_blocks=256, max_num_batched_tokens=256, max_num_seqs=8,
                                  enable_prefix_caching=True, enable_chunked_prefill=True, max_model_len=1024)
    info = create_executor(args)
    try:
        # twice, the first a warm-up: fresh worker processes pay one-off costs in their first steps (the
        # weights' first touch, each kernel's first use at a shape, gloo's first collectives), which the
        # run they are to predict does not (its engine is warmed up)
        measure_probe(args, info)
        frames = measure_probe(args, info)
    finally:
        close = getattr(info.executor, "close", None)
        if callable(close):
            close()
    if frames is None:
        return
    cm = CostModel(spec, hardware_from_dict(doc, "calibration"), tp=tp, cuda_graphs=cuda_graphs)
    pred = predicted_durations(frames, cm)
    meas = frames["steps"].duration_s.to_numpy(dtype=float)
    ok = np.isfinite(pred)
    shortfall = float(np.median(meas[ok] - pred[ok])) if ok.any() else 0.0
    doc["coefficients"]["c_tp_step"] = max(0.0, shortfall)
    doc["provenance"]["tp_step"] = {"tp": tp, "steps": int(ok.sum()), "median_shortfall_s": shortfall,
                                    "measured": "the drift probe's steps on a TP engine (worker processes, gloo)"}
    log(f"calibrate: TP={tp} step overhead in {time.perf_counter() - t0:.1f}s: {max(0.0, shortfall) * 1e3:.2f} ms "
        f"per step beyond the fitted model ({int(ok.sum())} steps)")


def write_calibration(path: str, doc: dict[str, Any], header: str = "") -> str:
    import yaml  # noqa: PLC0415

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    text = yaml.safe_dump(_plain(doc), sort_keys=False, width=110)
    with atomic_open(path) as f:  # renamed into place complete: never a truncated calibration
        if header:
            f.write("".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()))
        f.write(text)
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415

    load_hardware(path)  # what we wrote must read back
    return path


def _plain(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, float) and not np.isfinite(o):
        return None if np.isnan(o) else str(o)
    return o


# -- the command ------------------------------------------------------------------------------------
def calibrate(model: str, out_path: str, *, device: str = "cpu", dtype: str = "auto", threads: Optional[int] = 1,
              design: str | CalibrationDesign = "default", repeats: Optional[int] = None,
              base: Optional[str] = None, weighting: str = "relative", trim: Optional[float] = 4.0,
              from_run: Optional[str] = None, trace_dir: Optional[str] = None, enforce_eager: bool = False,
              attention_backend: str = "auto", seed: int = 0, gemm_curve: bool = True, allreduce_tp: int = 2,
              log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict[str, Any]:
    """Run (or read) measured steps, fit, write the calibration YAML; returns the document. `gemm_curve`:
    on a CPU, time the layer GEMMs at every token count first and fit on that curve
    (`measure_gemm_curve`). `allreduce_tp`: on a CPU, time gloo all-reduces of the model's hidden states
    between that many processes and fit the link to them (`calibrate_allreduce`; below 2: not measured,
    the CPU keeps no interconnect and TP is refused by the cost model)."""
    import pandas as pd  # noqa: PLC0415

    from servetwin.core.testbed.trace import TraceRecorder  # noqa: PLC0415
    from servetwin.sim.cost_model import CostModel  # noqa: PLC0415
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415
    from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

    t_begin = time.perf_counter()
    load_before = load_average()
    base = base or default_base(device)
    load_hardware(base)  # a bad preset fails before any work
    nthreads = set_torch_threads(threads)
    extra: dict[str, Any] = {}
    efficiency = None  # the base preset's, unless a GEMM curve is measured
    if from_run is not None:
        tdir = os.path.join(from_run, "torch") if os.path.isdir(os.path.join(from_run, "torch")) else from_run
        try:
            steps = pd.read_parquet(os.path.join(tdir, "steps.parquet"))
            step_requests = pd.read_parquet(os.path.join(tdir, "step_requests.parquet"))
        except (OSError, FileNotFoundError) as e:
            raise ValueError(f"--from-run: {from_run}: no torch trace tables ({e})") from None
        if len(steps) and set(steps.backend) != {"torch"}:
            raise ValueError(f"--from-run: {tdir} holds a {sorted(set(steps.backend))} trace; calibration needs a "
                             "measured (torch) one")
        spec_dtype = dtype if dtype not in (None, "auto") else ("float32" if base == "cpu" else "bfloat16")
        attn, cuda_graphs, dev_name = "unknown (read from a run)", (base != "cpu" and not enforce_eager), \
            f"unknown (trace read from {from_run})"
        source = f"servetwin calibrate --from-run {from_run}"
        design_dict: Any = None
        contended: set[int] = set()
        probe_frames = None
        extra["note"] = ("fitted on an existing run's torch trace: device, threads and load of that run are "
                         "not known here")
    else:
        from servetwin.core.engine.engine_args import EngineArgs  # noqa: PLC0415
        from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415

        if isinstance(design, str) and design not in DESIGNS:
            raise ValueError(f"--design: unknown design {design!r} (allowed: {', '.join(DESIGNS)})")
        des = DESIGNS[design] if isinstance(design, str) else design
        if repeats is not None:
            des = CalibrationDesign(**{**asdict(des), "repeats": int(repeats)})
        args = EngineArgs.from_kwargs(model=model, backend="torch", device=device, dtype=dtype, seed=seed,
                                      block_size=des.block_size, num_gpu_blocks=des.num_gpu_blocks,
                                      max_num_batched_tokens=des.max_num_batched_tokens,
                                      max_num_seqs=des.max_num_seqs, enable_prefix_caching=True,
                                      enable_chunked_prefill=True, max_model_len=des.max_model_len,
                                      enforce_eager=enforce_eager, attention_backend=attention_backend)
        t0 = time.perf_counter()
        try:
            engine, info = create_engine_core(args)
        except ValueError as e:
            raise ValueError(f"calibrate: cannot build the torch engine: {e}") from None
        ex = info.executor
        log(f"calibrate: {model} on {device} loaded in {time.perf_counter() - t0:.1f}s "
            f"(dtype {str(ex.dtype).replace('torch.', '')}, attention {ex.attention_backend_name}, "
            f"{nthreads} torch threads)")
        if ex.device.type == "cpu":
            from servetwin.gpu.cpu_kernels import small_m_linear_kernel  # noqa: PLC0415

            kernel = small_m_linear_kernel()  # its row limit is kept per machine: runs use the same kernels
            extra["small_m_linear_max_rows"] = kernel.max_rows() if kernel is not None else None
            if gemm_curve:
                efficiency, extra["gemm_m_curve"] = measure_gemm_curve(ex, model, base, des.max_num_batched_tokens,
                                                                       log)
        recorder = TraceRecorder(f"calibrate-{model}", "torch")
        t0 = time.perf_counter()
        cpu_s = run_design(engine, recorder, des, info.vocab_size or 256, seed=seed, log=log)
        log(f"calibrate: {len(recorder.steps)} steps measured in {time.perf_counter() - t0:.1f}s")
        probe_frames = measure_probe(args, info)  # scored below with the fitted model: the drift baseline
        if trace_dir:
            recorder.write(trace_dir)
        frames = recorder.frames()
        steps, step_requests = frames["steps"], frames["step_requests"]
        share = cpu_shares(steps, cpu_s, nthreads)
        contended = {int(k) for k, sh in zip(steps.step.to_numpy(), share) if sh < CONTENDED_BELOW}
        extra["contention"] = {
            "definition": f"cpu_share = process CPU time / (wall time x threads) per step; < {CONTENDED_BELOW}: "
                          "the step lost its core to other processes and is left out of the fit",
            "median_cpu_share": float(np.nanmedian(share)) if share.size else None,
            "contended_steps": len(contended)}
        spec_dtype = str(ex.dtype).replace("torch.", "")
        attn = ex.attention_backend_name
        cuda_graphs = getattr(ex, "graph_runner", None) is not None
        dev_name = device_name(device)
        source = "servetwin calibrate (designed steps through EngineCore on the torch backend)"
        design_dict = des.to_dict()
        del engine, ex, info
    spec = load_model_spec(model, dtype=spec_dtype)
    hw = load_hardware(base)
    if efficiency is not None:  # the measured GEMM curve: the basis the coefficients are fitted on
        hw = dataclasses.replace(hw, efficiency=efficiency)
    cm = CostModel(spec, hw, cuda_graphs=cuda_graphs)
    cal = fit_from_tables(steps, step_requests, cm, weighting=weighting, trim=trim,
                          exclude_steps=contended)
    fit = cal.fit
    res = fit.stats()
    res.pop("samples", None)
    res["terms_fitted"] = list(cal.terms)
    res.update(cal.summary)
    provenance = {
        "source": source, "calibrated": True,
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "device": dev_name, "device_type": "cuda" if str(device).startswith("cuda") else "cpu",
        "machine": machine_fingerprint(device),
        "versions": versions(), "model": model, "dtype": spec_dtype, "attention_backend": attn,
        "cuda_graphs": bool(cuda_graphs), "torch_threads": nthreads, "backend": "torch",
        "measured": MEASURED_QUANTITY, "weighting": weighting,
        "samples": int(len(cal.durations)), "samples_used": int(cal.used.sum()),
        "residuals": res, "design": design_dict,
        "load_average": {"before": load_before, "after": load_average()},
        "calibration_wall_s": round(time.perf_counter() - t_begin, 1),
        "command": ("servetwin " + " ".join(shlex.quote(a) for a in sys.argv[1:])
                    if len(sys.argv) > 1 and sys.argv[1] == "calibrate" else None),
    }
    provenance.update(extra)
    doc = calibration_document(base, cal, provenance, efficiency=efficiency)
    if from_run is None and provenance["device_type"] == "cpu" and allreduce_tp >= 2:
        calibrate_allreduce(doc, hw, spec, allreduce_tp, log)
        calibrate_tp_step(doc, model, spec_dtype, allreduce_tp, bool(cuda_graphs), log)
    if probe_frames is not None:
        from servetwin.sim.hardware import hardware_from_dict  # noqa: PLC0415

        fitted = CostModel(spec, hardware_from_dict(doc, "calibration"), cuda_graphs=cuda_graphs)
        doc["provenance"]["drift_probe"] = score_probe(probe_frames, fitted)
    header = (f"Written by `servetwin calibrate` - measured, not hand-edited.\n"
              f"Cost-model coefficients for {model} on this machine class ({dev_name}),\n"
              f"torch backend, {spec_dtype}, {attn} attention, {nthreads} torch thread(s).\n"
              f"Use as `hardware: <this file>` in an experiment or `servetwin compare --calibration <this file>`.")
    write_calibration(out_path, doc, header)
    log(f"calibrate: fit on {provenance['samples_used']}/{provenance['samples']} steps: median |rel err| "
        f"{cal.summary['used_samples']['median_abs_rel_err'] * 100:.2f}%, p90 "
        f"{cal.summary['used_samples']['p90_abs_rel_err'] * 100:.2f}% (all samples: median "
        f"{cal.summary['all_samples']['median_abs_rel_err'] * 100:.2f}%, p90 "
        f"{cal.summary['all_samples']['p90_abs_rel_err'] * 100:.2f}%); wrote {out_path}")
    return doc
