"""`comparison.md` of a predicted-vs-measured comparison (`servetwin compare`)."""
from __future__ import annotations

import os
from typing import Any, Optional

from servetwin.core.testbed.atomic import atomic_write_text
from servetwin.experiments.run.report import fmt, md_table

PLOT_TITLES = {"scatter": "Per-step predicted vs measured", "residuals": "Residuals by phase and step size",
               "timeline": "Timelines overlaid", "latency_cdf": "Request-latency CDFs"}


def _p(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}%"


def _signed(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:+.2f}%"


def _ok(flag: Optional[bool]) -> str:
    return "-" if flag is None else ("yes" if flag else "**no**")


def write_comparison_md(res: dict[str, Any], exp, out_dir: str) -> str:
    mode = res["mode"]
    L = [f"# Predicted vs measured: {res['name']} ({mode})", ""]
    if exp.description:
        L += [exp.description.strip(), ""]
    prov = res.get("calibration_provenance") or {}
    L += [f"- model `{res['model']}`, dtype {res.get('dtype')}, attention `{res.get('attention_backend')}`, "
          f"{res['torch_threads']} torch thread(s), {res['num_gpu_blocks']:,} KV blocks, "
          f"{res['workload']['requests']} requests ({res['workload']['arrival']} arrivals)",
          f"- simulator hardware / calibration: `{res['calibration']}`"
          + (f" (fitted {prov.get('date')} on {prov.get('device')}, model {prov.get('model')}, "
             f"{prov.get('samples')} samples)" if prov.get("calibrated") else " (not calibrated)"),
          f"- torch repeats: {res['repeats']} (after one unscored warm-up run); load average before "
          f"{res['load_average']['before']}, after {res['load_average']['after']}",
          "- errors in percent: |predicted - measured| / measured; signed: positive = the simulator predicts more"]
    c = res.get("contention") or {}
    if c:
        L += [f"- contention: median per-step CPU share {_fmt2(c.get('median_cpu_share'))}, "
              f"{_fmt2((c.get('contended_step_share') or 0) * 100)}% of the measured steps lost their core to other "
              f"processes (CPU share < 0.9); per-step |error| on the other steps: p50 "
              f"{_p((c.get('step_abs_pct_error_uncontended') or {}).get('p50'))}, p90 "
              f"{_p((c.get('step_abs_pct_error_uncontended') or {}).get('p90'))}"]
    probe = res.get("calibration_probe")
    if probe and probe.get("signed_pct_error_median") is not None:
        drift = probe.get("drift_pct")
        L += [f"- drift probe just before the runs ({probe['steps']} fixed steps): signed median error "
              f"{probe['signed_pct_error_median']:+.2f}%; " + (
                  f"the machine runs {drift:+.1f}% against its speed when calibrated (same probe; negative: "
                  f"slower now)" if drift is not None else "the calibration has no probe of its own (drift unknown)")]
    refresh = res.get("calibration_refresh")
    if refresh:
        verdict = ("adopted: it predicts a fresh probe better" if refresh.get("adopted") else
                   "not adopted: it predicts a fresh probe no better than the cached one, which is kept")
        L += [f"- calibration re-measured before the runs ({refresh['calibration_wall_s']} s): the probe found the "
              f"machine {refresh['drift_before']:+.1f}% off its speed at the calibration of "
              f"{refresh.get('calibrated_before')} (`hardware: auto` re-measures beyond +-{refresh['limit_pct']:.0f}% "
              f"on two probes); {verdict} (probe signed median error {_signed(refresh.get('probe_error_old_pct'))} "
              f"cached vs {_signed(refresh.get('probe_error_new_pct'))} re-measured); the line above is that probe "
              "against the calibration in force"]
    if res.get("discarded_repeats"):
        L += [f"- {len(res['discarded_repeats'])} contended repeat(s) discarded and run again: "
              + "; ".join(f"attempt {d['attempt']}: {d['contended_step_share'] * 100:.0f}% contended steps"
                          for d in res["discarded_repeats"])]
    L += [""]
    for n in res.get("notes") or []:
        L += [f"**Note:** {n}", ""]
    L += ["## Step composition", ""]
    if mode == "offline":
        L += [f"Identical in every repeat: **{res['identical_composition']}** ({res['steps']} steps).", ""]
    else:
        L += [f"Share of steps with identical composition at the same position: "
              f"**{res['identical_step_share'] * 100:.1f}%** (per repeat: "
              f"{', '.join(f'{s * 100:.1f}%' for s in res.get('identical_step_share_per_repeat', []))}); "
              f"first divergent step #{res.get('first_divergent_step')}. Step errors below use "
              f"{res['step_error_basis']}.", ""]
    s = res["step_abs_pct_error"]
    noise = res.get("noise") or {}
    ns = noise.get("step_abs_pct_error") or {}
    L += ["## Headline figures", ""]
    rows = [
        ["per-step abs. error p50", _p(s["p50"]), f"<= {res['targets']['step_p50']}%", _ok(res["meets_targets"]["step_p50"]),
         _p(ns.get("p50"))],
        ["per-step abs. error p90", _p(s["p90"]), f"<= {res['targets']['step_p90']}%", _ok(res["meets_targets"]["step_p90"]),
         _p(ns.get("p90"))],
        ["per-step abs. error mean", _p(s["mean"]), "", "", _p(ns.get("mean"))],
        ["makespan error", _signed(res["makespan_signed_pct_error"]), f"<= {res['targets']['makespan']}%",
         _ok(res["meets_targets"]["makespan"]), _p((noise.get("makespan_pct_error") or {}).get("mean"))],
        ["throughput error (output and total: same makespan)", _signed(res["throughput_signed_pct_error"]), "", "",
         _p((noise.get("throughput_pct_error") or {}).get("mean"))],
    ]
    for name in ("ttft", "tpot", "e2e"):
        for q in ("p50", "p90", "p99"):
            tgt = f"<= {res['targets']['e2e_p50']}%" if (name, q) == ("e2e", "p50") else ""
            ok = _ok(res["meets_targets"]["e2e_p50"]) if (name, q) == ("e2e", "p50") else ""
            nz = ((noise.get(f"{name}_pct_error") or {}).get(q) or {}).get("mean")
            rows.append([f"{name.upper()} {q} error", _signed(res[f"{name}_signed_pct_error"][q]), tgt, ok, _p(nz)])
    L += [md_table(["metric", "predicted vs measured", "target", "met", "noise (measured vs measured)"], rows), ""]
    L += ["Noise: the same metric between two torch repeats of the same workload (mean over ordered pairs; "
          "'-' with one repeat).", ""]
    if res.get("step_abs_pct_error_vs_median_of_repeats"):
        m = res["step_abs_pct_error_vs_median_of_repeats"]
        L += [f"Against the median of the repeats per step: p50 {_p(m['p50'])}, p90 {_p(m['p90'])}.", ""]
    if res.get("request_e2e_abs_pct_error"):
        m = res["request_e2e_abs_pct_error"]
        L += [f"Per-request E2E (same request in both backends): p50 {_p(m['p50'])}, p90 {_p(m['p90'])}.", ""]
    L += ["## By phase class", ""]
    rows = []
    for ph, st in res["by_phase"].items():
        nz = ((noise.get("by_phase") or {}).get(ph) or {})
        rows.append([ph, st["count"], _p(st["p50"]), _p(st["p90"]), _p(st["mean"]), _signed(st["signed_mean"]),
                     f"{st['share_of_measured_time'] * 100:.1f}%", _p(nz.get("p50")), _p(nz.get("p90"))])
    L += [md_table(["phase", "samples", "p50", "p90", "mean", "signed mean", "share of measured time",
                    "noise p50", "noise p90"], rows), ""]
    L += ["## Values", ""]
    rows = [["makespan (s)", res["makespan_s"]["predicted"], res["makespan_s"]["measured"]],
            ["output throughput (tok/s)", (res.get("output_throughput_tok_s") or {}).get("predicted"),
             (res.get("output_throughput_tok_s") or {}).get("measured")],
            ["total token throughput, prompt + output (tok/s)", res["throughput_tok_s"]["predicted"],
             res["throughput_tok_s"]["measured"]]]
    for name in ("ttft", "tpot", "e2e"):
        for q in ("p50", "p90", "p99"):
            lat = res["latency_s"][name]
            rows.append([f"{name.upper()} {q} (ms)", _ms(lat["predicted"][q]), _ms(lat["measured"][q])])
    L += [md_table(["", "predicted (sim)", "measured (torch, median of repeats)"], rows), ""]
    share = res.get("torch_time_between_steps_share")
    if share is not None:
        L += [f"Measured time between engine steps (trace bookkeeping, arrivals, idle waits; not modelled as "
              f"step time): {share * 100:.2f}% of the measured makespan.", ""]
    if res.get("plots"):
        L += ["## Plots", ""]
        for key, name in res["plots"].items():
            L += [f"### {PLOT_TITLES.get(key, key)}", "", f"![{key}]({name})", ""]
    L += ["## Files", "", "- `comparison.json`: every figure above (checks read it)",
          "- `steps_paired.parquet`: one row per measured step (and repeat) with its predicted duration",
          "- `sim/`, `torch/` (`torch_rN/` for further repeats): the trace tables of each run", ""]
    path = os.path.join(out_dir, "comparison.md")
    atomic_write_text(path, "\n".join(L))
    return path


def _fmt2(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(v: Optional[float]) -> Optional[float]:
    return None if v is None else v * 1e3


__all__ = ["write_comparison_md", "fmt"]
