"""PNG plots of a predicted-vs-measured comparison (`servetwin compare`)."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from servetwin.experiments.run.plots import PlotContext, _cdf, _plt, _save, log_time_axis
from servetwin.experiments.common.units import axis_unit, format_seconds

PHASE_COLORS = {"prefill": "tab:red", "decode": "tab:green", "mixed": "tab:purple"}
REPEAT_ALPHA = 0.55


def scatter(paired, path: str, ctx: Optional[PlotContext] = None) -> Optional[str]:
    """Predicted vs measured duration per step (log-log, y = x and +-5% / +-15% bands)."""
    ctx = ctx or PlotContext()
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 6.8))
    if len(paired):
        lo = float(min(paired.predicted_s.min(), paired.measured_s.min())) * 0.8
        hi = float(max(paired.predicted_s.max(), paired.measured_s.max())) * 1.25
        for ph, color in PHASE_COLORS.items():
            m = paired.phase == ph
            if m.any():
                ax.scatter(paired.measured_s[m], paired.predicted_s[m], s=8, alpha=0.6, color=color,
                           label=f"{ph} ({int(m.sum())})", rasterized=True)
        x = np.geomspace(lo, hi, 50)
        ax.plot(x, x, color="black", lw=1, label="y = x")
        for f, style in ((0.05, ":"), (0.15, "--")):
            ax.plot(x, x * (1 + f), color="gray", lw=0.8, ls=style)
            ax.plot(x, x * (1 - f), color="gray", lw=0.8, ls=style, label=f"+-{int(f * 100)}%")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        log_time_axis(ax, "x", span=(lo, hi))
        log_time_axis(ax, "y", span=(lo, hi))
        ax.legend(fontsize=8)
    ax.set_xlabel("measured step duration (log scale)")
    ax.set_ylabel("predicted step duration (log scale)")
    ax.set_title("per-step predicted vs measured", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ctx.suptitle(fig)
    return _save(fig, path)


def residuals(paired, path: str, ctx: Optional[PlotContext] = None) -> Optional[str]:
    """Signed percentage error per step: by phase (box) and against scheduled tokens (log axis: a step
    schedules at least one token)."""
    ctx = ctx or PlotContext()
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    ax = axes[0]
    data, labels = [], []
    for ph in PHASE_COLORS:
        v = paired.signed_pct_error[paired.phase == ph].to_numpy()
        if v.size:
            data.append(v)
            labels.append(f"{ph}\n(n={v.size})")
    if data:
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(labels) + 1), labels)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel("(predicted - measured) / measured (%)")
    ax.set_title("residuals by phase class", fontsize=10)
    ax.grid(alpha=0.3)
    ax = axes[1]
    for ph, color in PHASE_COLORS.items():
        m = paired.phase == ph
        if m.any():
            ax.scatter(paired.total_tokens[m], paired.signed_pct_error[m], s=7, alpha=0.6, color=color, label=ph,
                       rasterized=True)
    ax.axhline(0, color="black", lw=0.8)
    if len(paired) and float(paired.total_tokens.min()) > 0:
        from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("scheduled tokens in the step (log scale)")
    ax.set_ylabel("signed error (%)")
    ax.set_title("residuals vs step size", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ctx.suptitle(fig)
    return _save(fig, path)


def timelines(sim_frames: dict, torch_frames: list[dict], path: str,
              ctx: Optional[PlotContext] = None) -> Optional[str]:
    """Step durations over time and requests in the scheduler over time, sim and torch overlaid."""
    ctx = ctx or PlotContext()
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    runs = [("sim (predicted)", sim_frames, "tab:blue", 1.0)] + [
        (f"torch (measured, repeat {i + 1})", fr, "tab:orange", REPEAT_ALPHA if i else 1.0)
        for i, fr in enumerate(torch_frames)]
    t_max = max((float(fr["steps"].t_end_s.max()) for _, fr, _, _ in runs if len(fr["steps"])), default=0.0)
    div, unit = axis_unit(t_max)
    for label, fr, color, alpha in runs:
        st = fr["steps"]
        if not len(st):
            continue
        t = st.t_start_s / div
        axes[0].plot(t, st.duration_s, lw=0.9, color=color, alpha=alpha, label=label)
        axes[1].step(t, st.num_running, where="post", color=color, alpha=alpha, label=f"{label} running")
        axes[1].step(t, st.num_waiting, where="post", color=color, alpha=alpha, ls="--",
                     label=f"{label} waiting")
    if axes[0].get_legend_handles_labels()[0]:
        log_time_axis(axes[0], "y")
        axes[0].legend(fontsize=8)
    axes[0].set_ylabel("step duration (log scale)")
    axes[0].set_title("step durations and requests in the scheduler, sim and torch overlaid", fontsize=10)
    axes[0].grid(alpha=0.3, which="both")
    axes[1].set_ylabel("requests")
    axes[1].set_xlabel(f"time since start ({unit})")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    ctx.suptitle(fig, "timelines", hspace=0.2)
    return _save(fig, path)


def latency_cdfs(sim_frames: dict, torch_frames: list[dict], path: str,
                 ctx: Optional[PlotContext] = None) -> Optional[str]:
    """TTFT / TPOT / E2E CDFs on one log time axis per metric: sim and every torch repeat overlaid."""
    ctx = ctx or PlotContext()
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    runs = [("sim (predicted)", sim_frames, "tab:blue", 1.0)] + [
        (f"torch (repeat {i + 1})", fr, "tab:orange", REPEAT_ALPHA if i else 1.0) for i, fr in enumerate(torch_frames)]
    for ax, (col, title) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))):
        for label, fr, color, alpha in runs:
            vals = fr["requests"][col].to_numpy(dtype=float)
            vals = vals[np.isfinite(vals) & (vals > 0)]
            x, y = _cdf(vals)
            if x.size:
                p50, p99 = np.percentile(vals, [50, 99])
                ax.step(x, y, where="post", color=color, alpha=alpha,
                        label=f"{label}: p50 {format_seconds(p50)}, p99 {format_seconds(p99)}")
                ax.plot([p50, p99], [0.5, 0.99], ls="none", marker="o", color=color, alpha=alpha, mec="black",
                        mew=0.5)
        if ax.get_legend_handles_labels()[0]:
            log_time_axis(ax, "x")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("latency (log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
    ctx.suptitle(fig, "latency CDFs (dots: p50 and p99)")
    return _save(fig, path)


def comparison_plots(sim_frames: dict, torch_frames: list[dict], paired, out_dir: str,
                     ctx: Optional[PlotContext] = None) -> dict[str, Optional[str]]:
    return {
        "scatter": scatter(paired, os.path.join(out_dir, "step_scatter.png"), ctx),
        "residuals": residuals(paired, os.path.join(out_dir, "step_residuals.png"), ctx),
        "timeline": timelines(sim_frames, torch_frames, os.path.join(out_dir, "timeline_overlay.png"), ctx),
        "latency_cdf": latency_cdfs(sim_frames, torch_frames, os.path.join(out_dir, "latency_cdf.png"), ctx),
    }
