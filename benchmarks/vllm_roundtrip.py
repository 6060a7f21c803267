"""Bring-your-own-vLLM done-when checks (issue 24), figures printed side by side.

    .venv/bin/python benchmarks/vllm_roundtrip.py                 # both parts
    .venv/bin/python benchmarks/vllm_roundtrip.py --skip-cpu      # the round trip only (seconds)

1. Round trip (simulator, known coefficients). A hardware file with coefficients unlike the H100
   preset's is the truth; the simulator runs two training workloads and one unseen workload on it and
   writes what vLLM would: `vllm bench serve` JSON (`bench_writer`) and a profiler Chrome trace
   (`profiler_trace`). `calibrate --from-vllm` (traces + the runs' experiments, starting from the H100
   preset) must recover every fitted coefficient within 5% and predict the unseen workload's steps
   within 3% median per-step error; the bench files are predicted with the fitted file as a check.
2. CPU, real measurement (torch backend, this machine). `servetwin calibrate` (its designed steps) on
   the model and threads; the torch backend profiled with torch.profiler (vLLM's range names) on a
   training workload -> `calibrate --from-vllm` from that trace, twice: from the `cpu` preset, and from
   a hardware file with a measured GEMM curve (servetwin calibrate's file: on a CPU the GEMM time is not a
   smooth function of the token count, and the trace cannot show it - the small-M GEMMs run in a native
   kernel the profiler does not list; the step coefficients are refitted on the trace); then an unseen
   workload profiled once:
   each calibration predicts the quantity it was fitted on (the profiler range; the engine step), step
   for step, and the per-step p50 |error| of the two is compared (target: trace <= 1.2 x native).
   Measured back to back; the machine is shared with other jobs, so run it twice (`--repeats 2`).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

TRUTH = {"c_step": 0.0021, "c_req": 1.5e-05, "c_token": 2.0e-07, "c_layer": 0.0, "c_layer_piecewise": 1.4e-05,
         "c_linear": 1.12, "c_elementwise": 0.0, "c_attn_prefill": 1.25, "c_attn_decode": 0.85, "c_lm_head": 1.1,
         "c_sampler": 0.0, "c_tp_step": 0.0}
SIM_EXP = {"seed": 0, "model": "llama-3.1-8b", "hardware": "truth.yaml", "backends": ["sim"],
           "frontend": {"type": "api_server", "endpoint": "completions"},
           "engine": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
           "output": {"step_requests": True, "plots": False}}
SIM_WORKLOADS = {"train_short": (80, 20, 900, 180), "train_long": (80, 200, 3000, 120), "unseen": (120, 50, 1500, 300)}
CPU_EXP = {"seed": 0, "hardware": "cpu", "backends": ["torch"],
           "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 128, "num_gpu_blocks": 1024,
                      "max_model_len": 1024, "dtype": "float32"},
           "output": {"step_requests": True, "plots": False}}
# the training run's outputs spread wide (4..96) so its batches drain to a single request: without such steps
# the per-step and per-request CPU terms cannot be told apart (the first runs, outputs 4..32, fitted c_step = 0)
CPU_WORKLOADS = {"train": (16, 16, 200, 4, 96, 1), "unseen": (10, 100, 300, 8, 40, 7)}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _workload(n: int, lo: int, hi: int, out_lo: int, out_hi: int, seed: int) -> dict:
    return {"requests": n, "prompt_tokens": {"type": "uniform", "low": lo, "high": hi},
            "output_tokens": {"type": "uniform", "low": out_lo, "high": out_hi}, "arrival": {"type": "offline"},
            "seed": seed}


def _write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _step_errors(measured, exp_path: Path, hardware: str) -> dict:
    from servetwin.experiments.vllm_import.measured_steps import by_phase, load_sim_experiment, match_steps

    m = match_steps(measured, load_sim_experiment(str(exp_path), hardware=hardware))
    return {"matched": f"{len(m.measured_index)}/{m.measured_total}", **by_phase(m)}


def round_trip(d: Path) -> dict:
    from servetwin.experiments.config.schema import load_config
    from servetwin.experiments.vllm_import.bench_case import ImportOptions
    from servetwin.experiments.vllm_import.bench_writer import bench_document
    from servetwin.experiments.vllm_import.from_vllm import calibrate_from_vllm
    from servetwin.experiments.vllm_import.measured_steps import simulate
    from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces, write_profiler_trace

    _write(d / "truth.yaml", {"base": "h100-sxm", "name": "truth", "coefficients": TRUTH})
    files = {}
    for name, (n, lo, hi, out) in SIM_WORKLOADS.items():
        exp = _write(d / f"{name}.yaml", {"name": name, **SIM_EXP,
                                          "workload": {**_workload(n, lo, hi, 4, out, len(files) + 1)}})
        frames, _ = simulate(load_config(exp))
        trace = write_profiler_trace(frames["steps"], d / f"{name}.pt.trace.json.gz")
        summary = {"duration_s": float(frames["steps"].t_end_s.max())}
        bench = d / f"{name}.bench.json"
        bench.write_text(json.dumps(bench_document(load_config(exp), "sim", frames["requests"], summary)))
        files[name] = (exp, trace, bench)
    train = [files["train_short"], files["train_long"]]
    t0 = time.perf_counter()
    doc = calibrate_from_vllm([str(t) for _, t, _ in train] + [str(b) for _, _, b in train], str(d / "fitted.yaml"),
                              hardware="h100-sxm", experiments=[str(e) for e, _, _ in train],
                              opts=ImportOptions(model="llama-3.1-8b", tensor_parallel_size=1, engine=dict(SIM_EXP["engine"])),
                              trim=None, log=log)
    fit_s = time.perf_counter() - t0
    terms = doc["provenance"]["step_errors"]["terms_fitted"]
    coef = {f"c_{t}": (TRUTH[f"c_{t}"], doc["coefficients"][f"c_{t}"]) for t in terms if f"c_{t}" in TRUTH}
    exp, trace, _ = files["unseen"]
    unseen = _step_errors(read_profiler_traces([trace]), exp, str(d / "fitted.yaml"))
    preset = _step_errors(read_profiler_traces([trace]), exp, "h100-sxm")
    return {"coefficients": coef, "fit_s": fit_s, "unseen": unseen, "unseen_with_preset": preset,
            "bench_check": doc["provenance"].get("bench_check"), "loo": doc["provenance"]["step_errors"]}


def cpu_measurement(d: Path, model: str, threads: int, design: str) -> dict:
    from servetwin.experiments.calibrate.calibrate import calibrate
    from servetwin.experiments.config.schema import load_config
    from servetwin.experiments.vllm_import.bench_case import ImportOptions
    from servetwin.experiments.vllm_import.from_vllm import calibrate_from_vllm
    from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces
    from servetwin.experiments.vllm_import.torch_profile import profile_torch_run

    exps = {name: _write(d / f"cpu_{name}.yaml", {"name": f"cpu_{name}", "model": model, **CPU_EXP,
                                                  "workload": _workload(*w)})
            for name, w in CPU_WORKLOADS.items()}
    t0 = time.perf_counter()
    calibrate(model, str(d / "cal_native.yaml"), threads=threads, design=design, log=log)
    native_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, train_trace, _ = profile_torch_run(load_config(exps["train"]), d / "prof_train", warmup=True, threads=threads)
    for start, out in (("cpu", "cal_trace.yaml"), (str(d / "cal_native.yaml"), "cal_trace_curve.yaml")):
        calibrate_from_vllm([str(train_trace)], str(d / out), hardware=start, experiments=[str(exps["train"])],
                            opts=ImportOptions(), log=log)
    trace_s = time.perf_counter() - t0
    frames, unseen_trace, _ = profile_torch_run(load_config(exps["unseen"]), d / "prof_unseen", warmup=True,
                                                threads=threads)
    measured = read_profiler_traces([unseen_trace])
    return {"trace_calibration": _step_errors(measured, exps["unseen"], str(d / "cal_trace.yaml")),
            "trace_calibration_curve": _step_errors(measured, exps["unseen"], str(d / "cal_trace_curve.yaml")),
            "native_calibration": _step_errors(frames["steps"], exps["unseen"], str(d / "cal_native.yaml")),
            "trace_s": trace_s, "native_s": native_s}


def print_round_trip(r: dict) -> None:
    print("== 1. round trip: simulator with known coefficients -> vLLM-format trace + bench JSON -> calibrate --from-vllm")
    print(f"{'coefficient':<22}{'truth':>12}{'recovered':>12}{'error':>9}")
    worst = 0.0
    for name, (truth, got) in r["coefficients"].items():
        err = abs(got - truth) / truth if truth else abs(got)
        worst = max(worst, err)
        print(f"{name:<22}{truth:>12.4g}{got:>12.4g}{100 * err:>8.2f}%")
    print(f"worst coefficient error {100 * worst:.2f}% (target <= 5%); fit {r['fit_s']:.1f} s")
    for label, res in (("fitted file", r["unseen"]), ("H100 preset (not fitted)", r["unseen_with_preset"])):
        a = res["all"]
        print(f"unseen workload, {label}: {res['matched']} steps matched, per-step median |error| "
              f"{a['abs_pct_p50']:.3f}% (p90 {a['abs_pct_p90']:.3f}%)" + (" (target <= 3%)" if label == "fitted file" else ""))
    for label, e in r["loo"].get("leave_one_file_out", {}).items():
        print(f"leave-one-file-out {Path(label).name}: per-step median |error| {100 * e['median_abs_rel_err']:.3f}%")
    for case, e in (r["bench_check"] or {}).get("in_sample", {}).items():
        print(f"bench JSON {case} predicted with the fitted file: mean |log error| {100 * e['mean_abs_log_err']:.2f}%")


def print_cpu(r: dict, k: int) -> None:
    t, c, n = r["trace_calibration"], r["trace_calibration_curve"], r["native_calibration"]
    print(f"== 2. CPU real measurement, repeat {k}: unseen workload, per-step |error| p50 by phase "
          f"(servetwin calibrate {r['native_s']:.0f} s; profiling + both trace calibrations {r['trace_s']:.0f} s)")
    print(f"{'phase':<9}{'trace, cpu preset':>19}{'trace, GEMM curve':>19}{'servetwin calibrate':>21}{'steps':>7}")
    for phase in ("prefill", "decode", "mixed", "all"):
        if phase in t and phase in n:
            print(f"{phase:<9}{t[phase]['abs_pct_p50']:>18.2f}%{c[phase]['abs_pct_p50']:>18.2f}%"
                  f"{n[phase]['abs_pct_p50']:>20.2f}%{t[phase]['steps']:>7}")
    for label, x in (("cpu preset", t), ("GEMM curve", c)):
        ratio = x["all"]["abs_pct_p50"] / n["all"]["abs_pct_p50"] if n["all"]["abs_pct_p50"] else float("inf")
        print(f"ratio trace ({label}) / servetwin calibrate: {ratio:.2f} (target <= 1.2)")
    print(f"matched steps: trace {t['matched']}, engine steps {n['matched']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-cpu", action="store_true", help="only the simulator round trip")
    p.add_argument("--model", default="smollm2-135m", help="torch model for part 2 (default smollm2-135m)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for part 2 (default 1)")
    p.add_argument("--design", default="quick", help="servetwin calibrate's design for part 2 (default quick: "
                                                     "minutes on smollm2-135m even on a loaded machine)")
    p.add_argument("--repeats", type=int, default=1, help="part 2 repeats (the machine is shared: use 2)")
    p.add_argument("--keep", help="write the files here instead of a temporary folder")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vllm-roundtrip-") as tmp:
        d = Path(args.keep or tmp)
        d.mkdir(parents=True, exist_ok=True)
        print_round_trip(round_trip(d))
        if not args.skip_cpu:
            for k in range(1, args.repeats + 1):
                sub = d / f"cpu{k}"
                sub.mkdir(exist_ok=True)
                print_cpu(cpu_measurement(sub, args.model, args.threads, args.design), k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
