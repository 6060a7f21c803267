"""PNG plots of a predicted-vs-measured comparison (`servetwin compare`)."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from servetwin.experiments.plots import _cdf, _plt

PHASE_COLORS = {"prefill": "tab:red", "decode": "tab:green", "mixed": "tab:purple"}
REPEAT_ALPHA = 0.55


def scatter(paired, path: str) -> Optional[str]:
    """Predicted vs measured duration per step (log-log, y = x and +-5% / +-15% bands)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 6))
    if len(paired):
        lo = float(min(paired.predicted_s.min(), paired.measured_s.min())) * 1e3 * 0.8
        hi = float(max(paired.predicted_s.max(), paired.measured_s.max())) * 1e3 * 1.25
        for ph, color in PHASE_COLORS.items():
            m = paired.phase == ph
            if m.any():
                ax.scatter(paired.measured_s[m] * 1e3, paired.predicted_s[m] * 1e3, s=8, alpha=0.6, color=color,
                           label=f"{ph} ({int(m.sum())})", rasterized=True)
        x = np.geomspace(lo, hi, 50)
        ax.plot(x, x, color="black", lw=1, label="y = x")
        for f, style in ((0.05, ":"), (0.15, "--")):
            ax.plot(x, x * (1 + f), color="gray", lw=0.8, ls=style)
            ax.plot(x, x * (1 - f), color="gray", lw=0.8, ls=style, label=f"+-{int(f * 100)}%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.legend(fontsize=8)
    ax.set_xlabel("measured step duration (ms)")
    ax.set_ylabel("predicted step duration (ms)")
    ax.set_title("per-step predicted vs measured")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def residuals(paired, path: str) -> Optional[str]:
    """Signed percentage error per step: by phase (box) and against scheduled tokens."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
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
    ax.set_title("residuals by phase class")
    ax.grid(alpha=0.3)
    ax = axes[1]
    for ph, color in PHASE_COLORS.items():
        m = paired.phase == ph
        if m.any():
            ax.scatter(paired.total_tokens[m], paired.signed_pct_error[m], s=7, alpha=0.6, color=color, label=ph,
                       rasterized=True)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("symlog", linthresh=16)
    ax.set_xlabel("scheduled tokens")
    ax.set_ylabel("signed error (%)")
    ax.set_title("residuals vs step size")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timelines(sim_frames: dict, torch_frames: list[dict], path: str) -> Optional[str]:
    """Step durations over time and requests in the scheduler over time, sim and torch overlaid."""
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    runs = [("sim (predicted)", sim_frames, "tab:blue", 1.0)] + [
        (f"torch (measured, repeat {i + 1})", fr, "tab:orange", REPEAT_ALPHA if i else 1.0)
        for i, fr in enumerate(torch_frames)]
    for label, fr, color, alpha in runs:
        st = fr["steps"]
        if not len(st):
            continue
        axes[0].plot(st.t_start_s, st.duration_s * 1e3, lw=0.9, color=color, alpha=alpha, label=label)
        axes[1].step(st.t_start_s, st.num_running, where="post", color=color, alpha=alpha, label=f"{label} running")
        axes[1].step(st.t_start_s, st.num_waiting, where="post", color=color, alpha=alpha, ls="--",
                     label=f"{label} waiting")
    axes[0].set_ylabel("step duration (ms)")
    axes[0].set_title("timelines overlaid")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("requests")
    axes[1].set_xlabel("time since start (s)")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latency_cdfs(sim_frames: dict, torch_frames: list[dict], path: str) -> Optional[str]:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (col, title) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))):
        x, y = _cdf(sim_frames["requests"][col].tolist())
        if x.size:
            ax.step(x * 1e3, y, where="post", color="tab:blue", label="sim (predicted)")
        for i, fr in enumerate(torch_frames):
            x, y = _cdf(fr["requests"][col].tolist())
            if x.size:
                ax.step(x * 1e3, y, where="post", color="tab:orange", alpha=REPEAT_ALPHA if i else 1.0,
                        label=f"torch (measured, repeat {i + 1})")
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def comparison_plots(sim_frames: dict, torch_frames: list[dict], paired, out_dir: str) -> dict[str, Optional[str]]:
    return {
        "scatter": scatter(paired, os.path.join(out_dir, "step_scatter.png")),
        "residuals": residuals(paired, os.path.join(out_dir, "step_residuals.png")),
        "timeline": timelines(sim_frames, torch_frames, os.path.join(out_dir, "timeline_overlay.png")),
        "latency_cdf": latency_cdfs(sim_frames, torch_frames, os.path.join(out_dir, "latency_cdf.png")),
    }
