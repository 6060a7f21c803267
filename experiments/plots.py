"""PNG plots of a run (latency CDFs, timeline, step time) and of a sweep (metrics per point)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

COLORS = {"sim": "tab:blue", "torch": "tab:orange"}
PHASE_COLORS = {"prefill only": "tab:red", "decode only": "tab:green", "mixed": "tab:purple"}
MAX_POINTS = 4000


def _plt():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _cdf(values) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(np.asarray([v for v in values if v is not None], dtype=float))
    x = x[np.isfinite(x)]
    if x.size == 0:
        return x, x
    y = np.arange(1, x.size + 1) / x.size
    if x.size > MAX_POINTS:
        idx = np.unique(np.linspace(0, x.size - 1, MAX_POINTS).astype(int))
        x, y = x[idx], y[idx]
    return x, y


def latency_cdfs(frames: dict[str, dict], itls: dict[str, list], path: str) -> Optional[str]:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E latency")]
    for ax, (key, title) in zip(axes.flat, panels):
        for backend, fr in frames.items():
            values = itls.get(backend, []) if key == "itl_s" else fr["requests"][key].tolist()
            x, y = _cdf(values)
            if x.size:
                ax.step(x * 1e3, y, where="post", label=backend, color=COLORS.get(backend))
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl_s" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timeline(frames: dict[str, dict], path: str) -> Optional[str]:
    plt = _plt()
    n = len(frames)
    fig, axes = plt.subplots(2, n, figsize=(6 * n, 6), squeeze=False)
    for col, (backend, fr) in enumerate(frames.items()):
        st = fr["steps"]
        ax = axes[0][col]
        if len(st):
            ax.step(st.t_start_s, st.num_running, where="post", label="running")
            ax.step(st.t_start_s, st.num_waiting, where="post", label="waiting")
            ax.legend()
        ax.set_title(f"{backend}: requests in the scheduler")
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
        ax = axes[1][col]
        if len(st):
            ax.plot(st.t_start_s, st.kv_usage * 100, color="tab:red")
        ax.set_title(f"{backend}: KV cache usage")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("% of blocks")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def step_phase(steps) -> np.ndarray:
    ctx = steps.num_context_reqs.to_numpy() > 0
    gen = steps.num_generation_reqs.to_numpy() > 0
    return np.where(ctx & gen, "mixed", np.where(ctx, "prefill only", "decode only"))


def step_time(frames: dict[str, dict], path: str) -> Optional[str]:
    plt = _plt()
    n = len(frames)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    for col, (backend, fr) in enumerate(frames.items()):
        st = fr["steps"]
        ax = axes[0][col]
        if len(st):
            phase = step_phase(st)
            for name, color in PHASE_COLORS.items():
                m = phase == name
                if m.any():
                    ax.scatter(st.total_tokens[m], st.duration_s[m] * 1e3, s=6, alpha=0.6, color=color,
                               label=f"{name} ({int(m.sum())})", rasterized=True)
            ax.legend()
        ax.set_title(f"{backend}: step duration vs scheduled tokens")
        ax.set_xlabel("scheduled tokens")
        ax.set_ylabel("step duration (ms)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_comparison(df, path: str) -> Optional[str]:
    """Bars per sweep point (grouped by backend): throughput, output tok/s, TTFT p50/p90, prefill tokens."""
    plt = _plt()
    ok = df[df.status.isin(["ok", "interrupted"])]
    if ok.empty:
        return None
    points = list(dict.fromkeys(ok.point))
    backends = list(dict.fromkeys(ok.backend))
    panels = [("throughput_tok_s", "throughput (tok/s)"), ("output_tok_s", "output tok/s"),
              (("ttft_p50_s", "ttft_p90_s"), "TTFT p50 / p90 (s)"), ("prefill_tokens_computed", "prefill tokens computed"),
              (("e2e_p50_s", "e2e_p90_s"), "E2E p50 / p90 (s)"), ("duration_s", "makespan (s)")]
    fig, axes = plt.subplots(3, 2, figsize=(max(8, 1.6 * len(points) + 4), 11))
    x = np.arange(len(points))
    width = 0.8 / max(1, len(backends))
    for ax, (key, title) in zip(axes.flat, panels):
        for j, backend in enumerate(backends):
            sub = ok[ok.backend == backend].set_index("point")
            pos = x - 0.4 + width * (j + 0.5)
            if isinstance(key, tuple):
                lo = [sub[key[0]].get(p, np.nan) for p in points]
                hi = [sub[key[1]].get(p, np.nan) for p in points]
                ax.bar(pos, hi, width, color=COLORS.get(backend), alpha=0.35, label=f"{backend} p90")
                ax.bar(pos, lo, width, color=COLORS.get(backend), label=f"{backend} p50")
            else:
                vals = [sub[key].get(p, np.nan) for p in points]
                ax.bar(pos, vals, width, color=COLORS.get(backend), label=backend)
        ax.set_title(title)
        ax.set_xticks(x)
        ax.set_xticklabels(points, rotation=20, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def all_run_plots(frames: dict[str, dict], itls: dict[str, list], out_dir: str) -> dict[str, Any]:
    import os  # noqa: PLC0415

    out = {}
    if not frames:
        return out
    out["latency_cdf"] = latency_cdfs(frames, itls, os.path.join(out_dir, "latency_cdf.png"))
    out["timeline"] = timeline(frames, os.path.join(out_dir, "timeline.png"))
    out["step_time"] = step_time(frames, os.path.join(out_dir, "step_time.png"))
    return out
