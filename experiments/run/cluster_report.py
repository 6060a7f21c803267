"""report.md and figures of a cluster run (`servetwin run` of a config with a `cluster:` section).

report.md: the whole cluster's figures, then one row per engine (requests routed, throughput, TTFT /
TPOT / E2E, prefix-cache hit rate, KV peak, preemptions). Figures (`output.plots`), in sim/:
`cluster_engines.png`: every engine's KV usage and running requests over time, and the requests each
engine served with their mean TTFT.
"""
from __future__ import annotations

import os
from typing import Any, Optional


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{1000 * x:,.1f}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:,.0f}"


def cluster_report(exp: Any, whole: dict[str, Any], engines: dict[str, dict[str, Any]], figures: list[str]) -> str:
    lines = [f"# {exp.name}: {whole['num_engines']} engines ({whole['num_gpus']} GPUs) behind {whole['router']}", "",
             f"{whole['completed']:,} of {whole['requests']:,} requests completed ({whole['rejected']} rejected) "
             f"in {whole['simulated_s']:.1f} s simulated.", "",
             "## Whole cluster", "",
             "| output tok/s | total tok/s | req/s | TTFT mean / p99 (ms) | TPOT mean / p99 (ms) | ITL mean (ms) "
             "| E2E mean / p99 (ms) | prefix hit rate | KV peak | preemptions |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {_num(whole['output_tok_s'])} | {_num(whole['throughput_tok_s'])} | "
             f"{whole['request_throughput_s'] or 0:.2f} | {_ms(whole['ttft_s']['mean'])} / {_ms(whole['ttft_s']['p99'])} | "
             f"{_ms(whole['tpot_s']['mean'])} / {_ms(whole['tpot_s']['p99'])} | {_ms(whole['itl_s']['mean'])} | "
             f"{_ms(whole['e2e_s']['mean'])} / {_ms(whole['e2e_s']['p99'])} | {_pct(whole['prefix_hit_rate'])} | "
             f"{_pct(whole['kv_peak_usage'])} | {whole['preemptions']} |", ""]
    if whole.get("binding"):
        lines += ["## What limits this result", "", whole["binding"]["line"] + ".", "",
                  "From each engine's own measurements (experiments/run/binding.py states the rules and thresholds; "
                  "each engine's reason is in its `sim/instances/<engine>/summary.json`, `binding`).", ""]
    lines += ["## Engines", "",
             "| engine | requests | output tok/s | TTFT mean / p99 (ms) | TPOT mean (ms) | E2E mean (ms) "
             "| prefix hit rate | KV peak | preemptions |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in engines.items():
        lines.append(f"| {label} | {s['requests']:,} | {_num(s.get('output_tok_s'))} | {_ms(s['ttft_s']['mean'])} / "
                     f"{_ms(s['ttft_s']['p99'])} | {_ms(s['tpot_s']['mean'])} | {_ms(s['e2e_s']['mean'])} | "
                     f"{_pct(s.get('prefix_hit_rate'))} | {_pct(s.get('kv_peak_usage'))} | {s.get('preemptions', 0)} |")
    lines += ["", "Files: `sim/summary.json` (the cluster), `sim/instances/<engine>/` (each engine's tables), "
              "`sim/router_decisions.parquet`, `sim/trace.json` (open in https://ui.perfetto.dev: one process per "
              "engine, then the router's decisions)."]
    for path in figures:
        lines += ["", f"![{os.path.basename(path)}]({path})"]
    return "\n".join(lines) + "\n"


def cluster_figures(out_dir: str, frames: dict[str, dict]) -> list[str]:
    """sim/cluster_engines.png (module docstring); returns the paths written."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (kv, run, served) = plt.subplots(3, 1, figsize=(10, 10), constrained_layout=True)
    labels, counts, ttfts = [], [], []
    for label, f in frames.items():
        steps, reqs = f["steps"], f["requests"]
        if len(steps):
            kv.plot(steps.t_start_s, 100 * steps.kv_usage, lw=0.8, label=label)
            run.plot(steps.t_start_s, steps.num_running, lw=0.8, label=label)
        labels.append(label)
        counts.append(len(reqs))
        ttfts.append(1000 * float(reqs.ttft_s.mean()) if len(reqs) else 0.0)
    kv.set(title="KV cache usage per engine", xlabel="simulated time (s)", ylabel="KV usage %")
    run.set(title="running requests per engine", xlabel="simulated time (s)", ylabel="running")
    if len(labels) <= 16:
        kv.legend(fontsize=7, ncol=4)
    bars = served.bar(range(len(labels)), counts, color="tab:blue")
    served.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
    served.set(title="requests served per engine (label: mean TTFT)", ylabel="requests")
    for b, t in zip(bars, ttfts):
        served.annotate(f"{t:.0f} ms", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=6)
    path = os.path.join(out_dir, "sim", "cluster_engines.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
