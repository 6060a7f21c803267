"""PNG plots of a run and of a sweep, drawn for a researcher who looks before reading tables.

Run figures (every one titled with the run, model, hardware and key engine settings):
- `latency_cdf.png`: TTFT / TPOT / ITL / E2E CDFs on a log time axis, backends overlaid on one axis,
  p50 and p99 marked, SLO targets (`slo:`) drawn as vertical lines;
- `timeline.png`: running / waiting, KV usage, token throughput and arrivals / completions over time,
  preemptions marked on every panel;
- `step_time.png`: step duration against scheduled tokens by phase;
- `request_gantt.png`: queue / prefill / decode of a sample of requests, on the run's clock and aligned at
  arrival.
Sweep figure `sweep_comparison.png`: metric against the swept value (lines for numeric values, bars for
categorical ones), error bars where the table carries a per-point spread (seeds), SLO lines.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from servetwin.experiments.common.units import axis_unit, format_seconds

from servetwin.core.testbed.atomic import atomic_write_with

COLORS = {"sim": "tab:blue", "torch": "tab:orange"}
SERIES_HATCHES = ("", "..", "xx", "\\\\", "oo", "--")  # bars' counterpart of the markers
SERIES_MARKERS = "osD^v<>Pp*hX"  # one per series of a sweep figure, beside its colour (readable in grey too)
PHASE_COLORS = {"prefill only": "tab:red", "decode only": "tab:green", "mixed": "tab:purple"}
GANTT_COLORS = {"front end": "goldenrod", "queue": "0.65", "prefill": "tab:red", "decode": "tab:green"}
MAX_POINTS = 4000  # a CDF or a step series is thinned to about this many points (the shape is kept)
GANTT_SAMPLE = 40
DPI = 90
PNG_COMPRESS_LEVEL = 1  # zlib level: ~10% larger files than the default 6, a third less encoding time
SLO_RE = re.compile(r"^(ttft|tpot|itl|e2e)_(mean|p50|p90|p99)_s$")


@dataclass(slots=True)
class PlotContext:
    """What every figure of a run says about the run: a title line, a settings line, the SLO targets."""
    title: str = ""
    settings: str = ""
    slo: dict[str, float] = field(default_factory=dict)  # e.g. {"ttft_p99_s": 0.5}

    def suptitle(self, fig, extra: str = "", **margins: float) -> None:
        """The figure's title (wrapped to its width) and its margins (`_layout`'s keywords)."""
        import textwrap  # noqa: PLC0415

        head = " - ".join(p for p in (self.title, extra) if p)
        width = int(fig.get_figwidth() * 11)  # characters of a 10 pt line across the figure
        lines = textwrap.wrap(head, width) + textwrap.wrap(self.settings, width)
        if lines:
            fig.suptitle("\n".join(lines), fontsize=10)
        _layout(fig, len(lines), **margins)

    def slo_targets(self, metric: str) -> list[tuple[str, float]]:
        """[(stat, seconds)] of the SLOs on one metric (`ttft`, `tpot`, `itl`, `e2e`)."""
        out = []
        for key, value in self.slo.items():
            m = SLO_RE.match(str(key))
            if m and m.group(1) == metric and isinstance(value, (int, float)):
                out.append((m.group(2), float(value)))
        return out


def engine_settings(engine: Mapping[str, Any], num_gpu_blocks: Optional[int] = None) -> str:
    """The engine settings that change results, in vLLM's names, on one line."""
    parts = []
    for key, label in (("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                       ("block_size", "block_size"), ("max_model_len", "max_model_len"),
                       ("tensor_parallel_size", "TP"), ("policy", "policy")):
        if engine.get(key) is not None:
            parts.append(f"{label} {engine[key]}")
    flags = [("enable_chunked_prefill", "chunked prefill"), ("enable_prefix_caching", "prefix caching"),
             ("async_scheduling", "async scheduling")]
    for key, label in flags:
        if key in engine:
            parts.append(label if engine[key] else f"no {label}")
    if num_gpu_blocks:
        parts.append(f"{num_gpu_blocks:,} KV blocks")
    return ", ".join(parts)


def context_for(exp, summaries: Optional[Mapping[str, Mapping]] = None, varied: tuple[str, ...] = ()) -> PlotContext:
    """The title of a run's figures: `name: model on hardware (backends)` and its engine settings.
    `varied`: dotted keys the figure varies besides the sweep's (a capacity search's load), left out."""
    summaries = summaries or {}
    hw = exp.hardware if isinstance(exp.hardware, str) else "inline hardware"
    hw = os.path.splitext(os.path.basename(hw))[0] if hw.endswith((".yaml", ".yml")) else hw
    swept_hw = (getattr(exp, "sweep", None) or {}).get("hardware")
    if swept_hw:  # a sweep over hardware: the figure is about every one of them, not the config's own
        hw = ", ".join(_hardware_name(h) for h in swept_hw)
    where = []
    for b in exp.backends:
        where.append(f"sim on {hw}" if b == "sim" else f"torch on {exp.engine.given.get('device') or 'auto device'}")
    blocks = {s.get("num_gpu_blocks") for s in summaries.values() if s.get("num_gpu_blocks")}
    slo = getattr(exp, "slo", None) or {}
    swept = {k.split(".", 1)[1] for k in [*(getattr(exp, "sweep", None) or {}), *varied] if k.startswith("engine.")}
    given = {k: v for k, v in exp.engine.given.items() if k not in swept}  # a sweep's figure names no one point's value
    return PlotContext(title=f"{exp.name}: {exp.model} ({', '.join(where)}){workload_label(exp, varied)}",
                       settings=engine_settings(given, blocks.pop() if len(blocks) == 1 else None),
                       slo=dict(slo) if isinstance(slo, Mapping) else {})


def _hardware_name(hw: Any) -> str:
    if not isinstance(hw, str):
        return "inline hardware"
    return os.path.splitext(os.path.basename(hw))[0] if hw.endswith((".yaml", ".yml")) else hw


def folder_title(folder: str) -> str:
    """The CLI figures' title (`name: model (sim on hardware), workload` and the engine settings) for a
    run or compare folder, from its config.yaml: what the notebooks put above their figures."""
    from servetwin.experiments.config.schema import load_config  # noqa: PLC0415

    path = os.path.join(folder, "config.yaml")
    try:
        ctx = context_for(load_config(path))
    except Exception as e:  # noqa: BLE001  (a title must not stop a notebook: say why it is plain)
        return f"{os.path.basename(os.path.normpath(folder))} (no title: {path}: {e})"
    return f"{ctx.title}\n{ctx.settings}" if ctx.settings else ctx.title


def workload_label(exp, varied: tuple[str, ...] = ()) -> str:
    """`, 1,000 requests at 20 req/s (poisson)` from the validated config (so a `--set` shows in the
    title); the swept (and `varied`) workload fields are left out, as the engine's are."""
    swept = set(getattr(exp, "sweep", None) or {}) | set(varied)
    given = exp.workload.given or {}
    n = given.get("requests")
    parts = [] if n is None or "workload.requests" in swept else [f"{n:,} requests"]
    arrival = exp.workload.arrival
    kind = type(arrival).__name__.lower()
    if getattr(arrival, "rate", None) and "workload.arrival.rate" not in swept:
        parts.append(f"at {arrival.rate:g} req/s ({kind})")
    elif getattr(arrival, "clients", None) and "workload.arrival.clients" not in swept:
        parts.append(f"{arrival.clients} closed-loop clients")
    elif kind == "offline":
        parts.append("(offline batch)")
    return (", " + " ".join(parts)) if parts else ""


# -- matplotlib helpers -------------------------------------------------------------------------------
def _plt():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _short_seconds(v: float, _pos=None) -> str:
    return format_seconds(v, digits=3) if v > 0 else ""


def log_time_axis(ax, axis: str = "x", span: Optional[tuple[float, float]] = None) -> None:
    """A log axis in seconds whose tick labels carry their own unit (100 us, 10 ms, 1 s, 2 min); a span of
    fewer than 2.5 decades also labels 2x and 5x."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    if span is None:  # the data drawn so far
        lim = ax.dataLim.intervalx if axis == "x" else ax.dataLim.intervaly
        span = (float(lim[0]), float(lim[1]))
    narrow = span[0] > 0 and math.isfinite(span[1]) and math.log10(span[1] / span[0]) < 2.5
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if narrow else (1.0,), numticks=12))
    target.set_major_formatter(FuncFormatter(_short_seconds))
    target.set_minor_formatter(NullFormatter())
    minor_log_grid(ax, axis, span)


def minor_log_grid(ax, axis: str, span: tuple[float, float]) -> None:
    """The 2..9 x 10^k grid lines of a log axis as one line collection instead of minor ticks: each minor
    tick is five matplotlib artists (a figure's four log panels spent ~0.3 s creating ~200 of them); the
    lines look the same as `grid(which="both")`'s, only the small tick marks between the labels go."""
    from matplotlib.collections import LineCollection  # noqa: PLC0415
    from matplotlib.ticker import NullLocator  # noqa: PLC0415

    lo, hi = span
    (ax.xaxis if axis == "x" else ax.yaxis).set_minor_locator(NullLocator())
    if not (lo > 0 and math.isfinite(hi) and hi >= lo):
        return
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2)
    at = [k * 10.0 ** e for e in decades for k in range(2, 10)]
    if axis == "x":  # data coordinate along the axis, 0..1 across it; clipped to the view
        segs, transform = [[(v, 0.0), (v, 1.0)] for v in at], ax.get_xaxis_transform()
    else:
        segs, transform = [[(0.0, v), (1.0, v)] for v in at], ax.get_yaxis_transform()
    import matplotlib as mpl  # noqa: PLC0415

    ax.add_collection(LineCollection(segs, transform=transform, colors=mpl.rcParams["grid.color"],
                                     linewidths=mpl.rcParams["grid.linewidth"] * 0.8, alpha=0.3, zorder=1.5),
                      autolim=False)


def _seconds_axis(ax, axis: str = "y") -> None:
    """A linear axis in seconds whose tick labels carry their own unit."""
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    (ax.yaxis if axis == "y" else ax.xaxis).set_major_formatter(FuncFormatter(_short_seconds))


def zero_based_axis(ax, seconds: bool = False) -> None:
    """A y axis from 0 with plain tick labels (no offset, no scientific notation): a 0.004% difference
    between sweep points looks like one, not like a cliff under a `+1.219e4` offset. In seconds, the ticks
    are round numbers of the largest value's unit (0, 2, 4, 6 min), each label different."""
    from matplotlib.ticker import MaxNLocator, ScalarFormatter  # noqa: PLC0415

    top = ax.dataLim.intervaly[1]
    if not math.isfinite(top) or top <= 0:
        return
    ax.set_ylim(0, top * 1.12)
    if not seconds:
        fmt = ScalarFormatter(useOffset=False)
        fmt.set_scientific(False)
        ax.yaxis.set_major_formatter(fmt)
        return
    div, unit = axis_unit(top)
    ticks = [t for t in MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(0, top * 1.12 / div)
             if 0 <= t <= top * 1.12 / div]
    ax.set_yticks([t * div for t in ticks], [f"{t:g} {unit}" if t else "0" for t in ticks])


def _layout(fig, title_lines: int, left: float = 0.85, right: float = 0.25, bottom: float = 0.6,
            hspace: float = 0.45, wspace: float = 0.25, title_pad: float = 0.15) -> None:
    """Fixed margins in inches (matplotlib's tight_layout costs as much as drawing the figure twice)."""
    w, h = fig.get_figwidth(), fig.get_figheight()
    top = 0.3 + 0.19 * title_lines + title_pad
    fig.subplots_adjust(left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h,
                        hspace=hspace, wspace=wspace)


def _save(fig, path: str) -> str:
    # under a temporary name, renamed when complete: no half-written PNG, even on Ctrl-C or a full disk
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png", pil_kwargs={"compress_level": PNG_COMPRESS_LEVEL}))
    _plt().close(fig)
    return path


def _thin_index(size: int, n: int = MAX_POINTS) -> Optional[np.ndarray]:
    """At most n evenly spread indexes into `size` points (None: keep them all)."""
    return None if size <= n else np.unique(np.linspace(0, size - 1, n).astype(int))


def _thin(x: np.ndarray, y: np.ndarray, n: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    idx = _thin_index(x.size, n)
    return (x, y) if idx is None else (x[idx], y[idx])


def _sorted_cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_thin(values, np.arange(1, n + 1) / n)` of sorted `values`, the fractions computed at the kept
    points only (an ITL array holds ~20M gaps at 100,000 requests: no second array of that size)."""
    idx = _thin_index(values.size)
    if idx is None:
        return values, np.arange(1, values.size + 1) / values.size
    return values[idx], (idx + 1) / values.size


def _binned_max(t: np.ndarray, v: np.ndarray, n: int = MAX_POINTS // 2) -> tuple[np.ndarray, np.ndarray]:
    """At most n points of a step series: the maximum in each of n equal time bins (peaks are kept)."""
    if t.size <= 2 * n:
        return t, v
    edges = np.linspace(t[0], t[-1], n + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, n - 1)
    out = np.full(n, -np.inf)
    np.maximum.at(out, idx, v)
    keep = np.isfinite(out)
    return edges[:-1][keep], out[keep]


def _cdf(values) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(np.asarray([v for v in values if v is not None], dtype=float))
    x = x[np.isfinite(x)]
    if x.size == 0:
        return x, x
    y = np.arange(1, x.size + 1) / x.size
    return _thin(x, y)


# -- latency CDFs --------------------------------------------------------------------------------------
CDF_PANELS = (("ttft", "ttft_s", "TTFT (time to first token)"), ("tpot", "tpot_s", "TPOT (time per output token)"),
              ("itl", "itl_s", "ITL (gap between tokens)"), ("e2e", "e2e_s", "E2E latency"))


def _positive(values) -> tuple[np.ndarray, int]:
    """(the finite values > 0, a new array; how many finite values are <= 0), with as few copies of a
    large array as that takes."""
    arr = np.asarray(values, dtype=float)  # None -> nan
    finite = np.isfinite(arr)
    if not finite.all():
        arr = arr[finite]
    del finite
    positive = arr > 0
    return arr[positive], int(arr.size - np.count_nonzero(positive))


def latency_cdfs(frames: dict[str, dict], itls: dict[str, list], path: str,
                 ctx: Optional[PlotContext] = None) -> Optional[str]:
    """CDFs on a log time axis, every backend on the same axis, p50 / p99 marked, SLOs as red lines."""
    ctx = ctx or PlotContext()
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (metric, key, title) in zip(axes.flat, CDF_PANELS):
        zeros_note = []
        lo, hi = math.inf, 0.0
        for backend, fr in frames.items():
            raw = itls.get(backend, []) if key == "itl_s" else fr["requests"][key].to_numpy()
            values, zeros = _positive(raw)
            if zeros:
                zeros_note.append(f"{backend}: {zeros:,} zero gaps not shown")
            if not values.size:
                continue
            color = COLORS.get(backend)
            values.sort()  # (in place: `_positive` made a new array)
            x, y = _sorted_cdf(values)
            lo, hi = min(lo, float(values[0])), max(hi, float(values[-1]))
            n = values.size
            # (values is not read again unless it is x, unthinned: else the percentiles may reorder it)
            p50, p99 = (float(v) for v in np.percentile(values, [50, 99], overwrite_input=x is not values))
            ax.step(x, y, where="post", color=color, lw=1.4,
                    label=f"{backend}: p50 {format_seconds(p50)}, p99 {format_seconds(p99)} (n={n:,})")
            ax.plot([p50, p99], [0.5, 0.99], ls="none", marker="o", color=color, ms=6, mec="black", mew=0.6,
                    zorder=5)
        for stat, target in ctx.slo_targets(metric):
            ax.axvline(target, color="red", ls="--", lw=1.2, label=f"SLO {stat} <= {format_seconds(target)}")
        ax.axhline(0.5, color="0.6", lw=0.6, ls=":")
        ax.axhline(0.99, color="0.6", lw=0.6, ls=":")
        if ax.get_legend_handles_labels()[0]:
            log_time_axis(ax, span=(lo, hi))
            ax.legend(fontsize=7.5, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no values recorded", ha="center", va="center", transform=ax.transAxes, color="0.4")
        ax.set_ylim(0, 1.02)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("latency (log scale)" + (f"; {'; '.join(zeros_note)}" if zeros_note else ""), fontsize=8)
        ax.set_ylabel("fraction of gaps" if key == "itl_s" else "fraction of requests")
        ax.grid(alpha=0.3, which="both")
    ctx.suptitle(fig, "latency CDFs (dots: p50 and p99)")
    return _save(fig, path)


# -- timeline ------------------------------------------------------------------------------------------
def _rate(times: np.ndarray, weights: Optional[np.ndarray], t_max: float, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Events (or weighted amounts) per second in `bins` equal time bins over [0, t_max]."""
    edges = np.linspace(0.0, t_max, bins + 1)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    width = edges[1] - edges[0]
    return edges, counts / width if width > 0 else counts


def timeline(frames: dict[str, dict], path: str, ctx: Optional[PlotContext] = None) -> Optional[str]:
    """Requests in the scheduler, KV usage, token throughput and arrivals / completions over time, every
    backend on the same clock; steps that preempted are marked on every panel."""
    ctx = ctx or PlotContext()
    plt = _plt()
    t_max = max((float(fr["steps"].t_end_s.max()) for fr in frames.values() if len(fr["steps"])), default=0.0)
    div, unit = axis_unit(t_max)
    bins = int(min(200, max(10, t_max and sum(len(fr["steps"]) for fr in frames.values()) // 20)))
    fig, axes = plt.subplots(4, 1, figsize=(12, 10), sharex=True,
                             gridspec_kw={"height_ratios": [1.3, 1, 1, 1]})
    multi = len(frames) > 1
    for backend, fr in frames.items():
        st = fr["steps"]
        if not len(st):
            continue
        color = COLORS.get(backend)
        tag = f"{backend} " if multi else ""
        t = st.t_start_s.to_numpy(dtype=float)
        for col, ls, name in (("num_running", "-", "running"), ("num_waiting", "--", "waiting")):
            x, y = _binned_max(t, st[col].to_numpy(dtype=float))
            axes[0].step(x / div, y, where="post", color=color, ls=ls, lw=1.1, label=f"{tag}{name}")
        queued = frontend_queue(fr["requests"])
        if queued is not None:  # sent by the client, not yet at the engine: what sets client TTFT online
            x, y = _binned_max(*queued)
            axes[0].step(x / div, y, where="post", color=color, ls=":", lw=1.3, label=f"{tag}in the front end")
        x, y = _binned_max(t, st.kv_usage.to_numpy(dtype=float) * 100)
        axes[1].step(x / div, y, where="post", color=color, lw=1.1, label=f"{tag}KV usage")
        t_end = st.t_end_s.to_numpy(dtype=float)
        for col, ls, name in (("num_context_tokens", "--", "prefill"), ("num_generation_tokens", "-", "decode")):
            x, y = _rate(t_end, st[col].to_numpy(dtype=float), t_max, bins)
            axes[2].stairs(y, x / div, color=color, ls=ls, lw=1.1, label=f"{tag}{name} tok/s")
        req = fr["requests"]
        arr = req.arrival_s.to_numpy(dtype=float)
        fin = req.finish_s.dropna().to_numpy(dtype=float)
        x, y = _rate(arr, None, t_max, bins)
        axes[3].stairs(y, x / div, color=color, ls="--", lw=1.0, label=f"{tag}arrivals/s")
        x, y = _rate(fin, None, t_max, bins)
        axes[3].stairs(y, x / div, color=color, lw=1.2, label=f"{tag}completions/s")
        pre = st[st.num_preempted > 0]
        if len(pre):
            tp = pre.t_start_s.to_numpy(dtype=float) / div
            n = int(pre.num_preempted.sum())
            for ax in axes[1:]:
                ax.vlines(tp, 0, 1, transform=ax.get_xaxis_transform(), color="red", lw=0.6, alpha=0.35)
            axes[0].scatter(tp, pre.num_running.to_numpy(dtype=float), marker="v", s=28, color="red",
                            edgecolors=color, linewidths=0.8, zorder=5,
                            label=f"{tag}preemption ({n:,} in {len(pre):,} steps)")
    axes[0].set_ylabel("requests")
    axes[0].set_title("requests in the scheduler (after scheduling each step) and in the API server's queue "
                      "(dotted, when modelled); peaks kept", fontsize=9)
    axes[1].set_ylabel("KV blocks used (%)")
    axes[1].set_ylim(0, 105)
    axes[1].set_title("KV cache usage (red lines: steps that preempted)", fontsize=9)
    axes[2].set_ylabel("tokens/s")
    axes[2].set_title(f"scheduled tokens per second ({bins} bins)", fontsize=9)
    axes[3].set_ylabel("requests/s")
    axes[3].set_title("arrivals and completions per second", fontsize=9)
    axes[3].set_xlabel(f"time since start ({unit})")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7.5, loc="upper right", ncol=2 if multi else 1)
    ctx.suptitle(fig, "timeline")
    return _save(fig, path)


def frontend_queue(req) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(times, requests in the front end just after each): sent by their client, not yet at the engine
    (None when no front end is modelled)."""
    engine = _engine_arrival(req)
    if engine is None:
        return None
    arr = req.arrival_s.to_numpy(dtype=float)
    t = np.concatenate([arr, engine])
    step = np.concatenate([np.ones(arr.size), -np.ones(engine.size)])
    order = np.lexsort((-step, t))  # at equal times: the arrival first, so a zero-length stay still shows
    return t[order], np.cumsum(step[order])


def step_phase(steps) -> np.ndarray:
    ctx = steps.num_context_reqs.to_numpy() > 0
    gen = steps.num_generation_reqs.to_numpy() > 0
    return np.where(ctx & gen, "mixed", np.where(ctx, "prefill only", "decode only"))


def step_time(frames: dict[str, dict], path: str, ctx: Optional[PlotContext] = None) -> Optional[str]:
    ctx = ctx or PlotContext()
    plt = _plt()
    n = len(frames)
    fig, axes = plt.subplots(1, n, figsize=(max(7.5, 6 * n), 4.8), squeeze=False, sharex=True, sharey=True)
    for col, (backend, fr) in enumerate(frames.items()):
        st = fr["steps"]
        ax = axes[0][col]
        if len(st):
            phase = step_phase(st)
            tokens = st.total_tokens.to_numpy(dtype=float)
            dur = st.duration_s.to_numpy(dtype=float)
            for name, color in PHASE_COLORS.items():
                m = phase == name
                if m.any():
                    idx = np.flatnonzero(m)
                    if idx.size > MAX_POINTS:  # an even subsample: the cloud's shape, not every point
                        idx = idx[np.linspace(0, idx.size - 1, MAX_POINTS).astype(int)]
                    ax.scatter(tokens[idx], dur[idx], s=6, alpha=0.5, color=color, label=f"{name} ({int(m.sum()):,})",
                               rasterized=True)
            ax.legend(fontsize=8)
            ax.set_xscale("log")
            minor_log_grid(ax, "x", (max(float(tokens.min()), 1.0), float(tokens.max())))
            log_time_axis(ax, "y")
        ax.set_title(f"{backend}: step duration vs scheduled tokens", fontsize=10)
        ax.set_xlabel("scheduled tokens in the step (log scale)")
        ax.set_ylabel("step duration")
        ax.grid(alpha=0.3, which="both")
    ctx.suptitle(fig)
    return _save(fig, path)


# -- per-request view ----------------------------------------------------------------------------------
def _sample_requests(req, n: int, consecutive: bool):
    """n requests that were scheduled: consecutive arrivals from the middle of the run (a waterfall on
    the run's clock), or evenly spaced over the whole run (the spread of lifetimes)."""
    done = req[req.first_scheduled_s.notna()].sort_values("arrival_s")
    if len(done) <= n:
        return done
    if consecutive:
        start = (len(done) - n) // 2
        return done.iloc[start:start + n]
    return done.iloc[np.linspace(0, len(done) - 1, n).astype(int)]


def _phases(sample) -> dict[str, np.ndarray]:
    """Per request: its arrival and the durations of its phases, in order (`front end`: client send ->
    engine arrival, only when a front end is modelled; `queue`: the engine's queue)."""
    arr = sample.arrival_s.to_numpy(dtype=float)
    sched = sample.first_scheduled_s.to_numpy(dtype=float)
    end = sample.finish_s.to_numpy(dtype=float)
    first = sample.first_token_s.to_numpy(dtype=float)
    first = np.where(np.isnan(first), end, first)
    end = np.where(np.isnan(end), first, end)
    engine = _engine_arrival(sample)
    out = {"arrival": arr}
    if engine is not None:
        out["front end"] = engine - arr
    out.update({"queue": sched - (arr if engine is None else engine), "prefill": np.nan_to_num(first - sched),
                "decode": np.nan_to_num(end - first)})
    return out


def _engine_arrival(req) -> Optional[np.ndarray]:
    """When each request reached the engine, if a modelled front end delayed any (else None)."""
    if "engine_arrival_s" not in req:
        return None
    engine = req.engine_arrival_s.to_numpy(dtype=float)
    arr = req.arrival_s.to_numpy(dtype=float)
    engine = np.where(np.isnan(engine), arr, engine)
    return engine if (engine > arr).any() else None


def _hbars(ax, y: np.ndarray, left: np.ndarray, right: np.ndarray, color, label: str, height: float = 0.8):
    """Horizontal bars as one PolyCollection: `barh` makes a Rectangle per bar and updates the axes' limits
    for each (240 bars cost ~0.3 s); the limits are set by the caller."""
    from matplotlib.collections import PolyCollection  # noqa: PLC0415

    h = height / 2
    verts = np.stack([np.column_stack([left, y - h]), np.column_stack([right, y - h]),
                      np.column_stack([right, y + h]), np.column_stack([left, y + h])], axis=1)
    coll = PolyCollection(verts, facecolors=color, edgecolors="none", label=label, zorder=1)
    ax.add_collection(coll, autolim=False)
    return coll


def _gantt_panel(ax, smp, aligned: bool) -> str:
    ph = _phases(smp)
    names = [k for k in GANTT_COLORS if k in ph]
    n = len(smp)
    total = sum(ph[k] for k in names)
    y = np.empty(n)
    y[np.argsort(total) if aligned else np.arange(n)] = np.arange(n)
    if aligned:  # log scale from a floor below the shortest phase: a 5 ms queue next to a 5 s decode shows
        pos = np.concatenate([ph[k][ph[k] > 0] for k in names] or [np.ones(1)])
        floor = 10 ** math.floor(math.log10(max(float(pos.min()) if pos.size else 1e-3, 1e-6)))
        cum = np.cumsum([ph[k] for k in names], axis=0)  # phase ends since arrival
        edges = [np.full(n, floor)] + [np.maximum(c, floor) for c in cum]
        div = 1.0
    else:
        t0 = float(ph["arrival"].min()) if n else 0.0
        div, unit = axis_unit(float((ph["arrival"] + total).max() - t0) if n else 1.0)
        edges = [ph["arrival"] - t0]
        for name in names:
            edges.append(edges[-1] + ph[name])
    for i, name in enumerate(names):
        _hbars(ax, y, edges[i] / div, edges[i + 1] / div, GANTT_COLORS[name], name)
    lo = float(edges[0].min() / div) if n else 0.0
    hi = float(edges[-1].max() / div) if n else 1.0
    if aligned and hi > lo > 0:  # the bars' left edge, a 5% margin on the right (as barh's autoscale gave)
        ax.set_xlim(lo, 10 ** (math.log10(hi) + 0.05 * (math.log10(hi) - math.log10(lo))))
    elif hi > lo:
        ax.set_xlim(lo, hi + 0.05 * (hi - lo))
    pre = smp.num_preemptions.to_numpy() > 0
    if pre.any():
        ax.scatter(edges[-1][pre] / div, y[pre], marker="x", color="black", s=22, zorder=5,
                   label="preempted (its bars include the recomputation)")
    ax.set_ylim(n - 0.2, -0.8)
    ax.set_yticks([])
    ax.grid(alpha=0.3, axis="x", which="both")
    if aligned:
        log_time_axis(ax, "x")
        ax.set_xlabel("time since arrival (log scale)")
    else:
        ax.set_xlabel(f"time ({unit}) since the first of these arrivals (t = {format_seconds(t0)})")
    medians = ", ".join(f"{k} {format_seconds(float(np.median(ph[k])))}" for k in names)
    preempted = f"; {int(pre.sum())} preempted" if pre.any() else ""
    return f"median {medians}{preempted}" if n else ""


def request_gantt(frames: dict[str, dict], path: str, ctx: Optional[PlotContext] = None,
                  sample: int = GANTT_SAMPLE) -> Optional[str]:
    """(Front end /) queue / prefill / decode per request: `sample` consecutive arrivals from the middle of the run on the
    run's clock (left), and `sample` requests evenly spaced over the run aligned at arrival, sorted by E2E,
    on a log axis (right). Prefill = first scheduled -> first token (its chunks and the waits between
    them); decode = first token -> finish; a cross marks a request that was preempted."""
    ctx = ctx or PlotContext()
    plt = _plt()
    rows = [(b, fr["requests"]) for b, fr in frames.items() if len(fr["requests"])]
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 0.15 * sample * len(rows) + 2.6), squeeze=False)
    handles: dict[str, Any] = {}
    for r, (backend, req) in enumerate(rows):
        left = _sample_requests(req, sample, consecutive=True)
        med = _gantt_panel(axes[r][0], left, aligned=False)
        axes[r][0].set_title(f"{backend}: {len(left)} consecutive arrivals (of {len(req):,}), on the run's clock\n"
                             f"{med}", fontsize=9)
        axes[r][0].set_ylabel("requests (by arrival)")
        right = _sample_requests(req, sample, consecutive=False)
        med = _gantt_panel(axes[r][1], right, aligned=True)
        axes[r][1].set_title(f"{backend}: {len(right)} requests spread over the run, from arrival, sorted by E2E\n"
                             f"{med}", fontsize=9)
        axes[r][1].set_ylabel("requests (by E2E)")
        for ax in axes[r]:
            handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=9)
    phases = " / ".join(k for k in GANTT_COLORS if k in handles)
    ctx.suptitle(fig, f"per-request {phases}", bottom=1.0, hspace=0.55, wspace=0.12,
                 title_pad=0.35)
    return _save(fig, path)


RUN_FIGURES = ("latency_cdf", "timeline", "request_gantt", "step_time")


def warm_plotting() -> None:
    """Import matplotlib and render one small figure (fonts, the Agg canvas, the PNG encoder loaded): what
    `servetwin.experiments.run.background.Prewarmed` does while the backends run."""
    import io  # noqa: PLC0415

    plt = _plt()
    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([1e-3, 1.0], [0, 1])
    log_time_axis(ax)
    ax.set_title("warm", fontsize=9)
    fig.savefig(io.BytesIO(), dpi=20, format="png")
    plt.close(fig)


def draw_run_figures(frames: dict[str, dict], itls: dict[str, Any], out_dir: str,
                     ctx: Optional[PlotContext] = None) -> dict[str, Optional[str]]:
    """Every run figure, each in a forked child where the machine allows it; {figure: path or None}."""
    from servetwin.experiments.run.background import OutputJobs  # noqa: PLC0415

    jobs = OutputJobs()
    if jobs.parallel:
        _plt()  # import once, before forking: the children inherit it
    _submit_figures(jobs, frames, itls, out_dir, ctx)
    done = jobs.wait()
    return {k: done.get(k) for k in RUN_FIGURES}


def _submit_figures(jobs, frames, itls, out_dir: str, ctx) -> None:
    """Every run figure into `jobs`; `itls` may be a function computing them: the figures that need no
    inter-token latencies are started before it is called (they are drawn while it runs)."""
    path = {k: os.path.join(out_dir, f"{k}.png") for k in RUN_FIGURES}
    # in the background: these run while the ITLs are computed, and the latency CDFs (the last to
    # start, the longest to draw) must not wait for them
    late = callable(itls)
    jobs.submit("timeline", timeline, (frames, path["timeline"], ctx), path["timeline"], background=late)
    jobs.submit("request_gantt", request_gantt, (frames, path["request_gantt"], ctx), path["request_gantt"],
                background=late)
    jobs.submit("step_time", step_time, (frames, path["step_time"], ctx), path["step_time"], background=late)
    itls = itls() if late else itls
    jobs.submit("latency_cdf", latency_cdfs, (frames, itls, path["latency_cdf"], ctx), path["latency_cdf"])


def all_run_plots(frames: dict[str, dict], itls: dict[str, list], out_dir: str,
                  ctx: Optional[PlotContext] = None, jobs=None, worker=None, wait: bool = True):
    """Every run figure, each drawn by a forked child where the machine allows it
    (`servetwin.experiments.run.background`); `jobs` (an OutputJobs) may already hold other files being written,
    which this waits for too; `worker` (a `Prewarmed` child that imported matplotlib with
    `warm_plotting` while the backends ran) draws them when given. `itls` may be a function returning
    them (called once; without a worker, after the figures that need no ITLs were started). Returns
    {figure: path or None}, or with `wait=False` a function returning it once the figures are done (the
    caller works meanwhile)."""
    from servetwin.experiments.run.background import OutputJobs  # noqa: PLC0415

    if not frames:
        if callable(itls):
            itls()
        return {} if wait else dict
    if worker is not None and worker.running:
        itls = itls() if callable(itls) else itls
        # the figures read only these two tables: the per-request step rows (millions) stay here
        slim = {b: {"steps": fr["steps"], "requests": fr["requests"]} for b, fr in frames.items()}
        worker.submit(draw_run_figures, (slim, itls, out_dir, ctx))

        def done_by_worker() -> dict[str, Any]:
            if jobs is not None:
                jobs.wait()
            return worker.result()

        return done_by_worker() if wait else done_by_worker
    jobs = jobs if jobs is not None else OutputJobs()
    if jobs.parallel:
        _plt()  # import once, before forking: the children inherit it
    _submit_figures(jobs, frames, itls, out_dir, ctx)

    def done_here() -> dict[str, Any]:
        done = jobs.wait()
        return {k: done.get(k) for k in RUN_FIGURES}

    return done_here() if wait else done_here


# -- sweeps --------------------------------------------------------------------------------------------
SWEEP_PANELS = (
    ("throughput_tok_s", (), "throughput (prompt + output tok/s)", None),
    ("request_throughput_s", (), "completed requests/s", None),
    ("ttft", ("p50", "p99", "p90"), "TTFT", "ttft"),
    ("tpot", ("p50", "p99", "p90"), "TPOT", "tpot"),
    ("e2e", ("p50", "p99", "p90"), "E2E latency", "e2e"),
    ("duration_s", (), "makespan", "time"),
)


def is_numeric_axis(values) -> bool:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return bool(vals) and all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
                              for v in vals) and len(set(vals)) > 1


def spread(df, col: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Per-point error bars of `col` when the table has them (seeds): (below, above) distances from the value.

    Accepted columns: `<col>_ci_lo` / `<col>_ci_hi` (the 95% interval a seeded sweep writes, clipped at
    physical bounds), `<col>_ci_low` / `<col>_ci_high`, `<col>_lo` / `<col>_hi`, or `<col>_std` (symmetric)."""
    pairs = [(lo, hi) for lo, hi in (("_ci_lo", "_ci_hi"), ("_ci_low", "_ci_high"), ("_lo", "_hi"))
             if col + lo in df and col + hi in df]
    if col not in df or not (pairs or col + "_std" in df):
        return None
    v = df[col].to_numpy(dtype=float)
    for lo, hi in pairs:
        below = v - df[col + lo].to_numpy(dtype=float)
        above = df[col + hi].to_numpy(dtype=float) - v
        return np.nan_to_num(np.abs(below)), np.nan_to_num(np.abs(above))
    if col + "_std" in df:
        s = np.nan_to_num(df[col + "_std"].to_numpy(dtype=float))
        return s, s
    return None


def _series_keys(df, keys: list[str], x_key: Optional[str]) -> list[str]:
    return [k for k in keys if k != x_key and k in df] + ["backend"]


def sweep_comparison(df, path: str, ctx: Optional[PlotContext] = None,
                     keys: Optional[list[str]] = None) -> Optional[str]:
    """Each metric against the swept value: lines over a numeric swept key (one line per backend and per
    value of the other keys), grouped bars when every swept key is categorical. Latencies on a log axis,
    p50 solid and p99 (p90 when p99 is absent) dashed; SLO targets as red lines; error bars from seeds."""
    ctx = ctx or PlotContext()
    plt = _plt()
    ok = df[df.status.isin(["ok", "interrupted"])]
    if ok.empty:
        return None
    partial = set(ok.point[ok.status == "interrupted"])  # drawn hatched / hollow and labelled
    keys = [k for k in (keys or []) if k in ok]
    x_key = next((k for k in keys if is_numeric_axis(ok[k].tolist())), None)
    fig, axes = plt.subplots(3, 2, figsize=(12, 11))
    # lines: one per backend and per combination of the other swept keys; bars: one per backend
    series_cols = _series_keys(ok, keys, x_key) if x_key is not None else ["backend"]
    groups = list(ok.groupby(series_cols, sort=False, dropna=False)) if series_cols else [((), ok)]
    points = list(dict.fromkeys(ok.point))
    width = 0.8 / max(1, len(groups))
    # the backends' own colours only when each series is one backend; else a colour and a marker per series
    # (two hardware on the simulator are two series of one backend)
    by_backend = len(groups) <= len(COLORS) and len({g[-1] if isinstance(g, tuple) else g for g, _ in groups}) \
        == len(groups)
    for ax, (metric, stats, title, kind) in zip(axes.flat, SWEEP_PANELS):
        cols = ([f"{metric}_{s}_s" for s in stats if f"{metric}_{s}_s" in ok][:2] if stats else [metric])
        for j, (gkey, sub) in enumerate(groups):
            gkey = gkey if isinstance(gkey, tuple) else (gkey,)
            label = ", ".join(f"{k.split('.')[-1]}={v}" if k != "backend" else str(v)
                              for k, v in zip(series_cols, gkey))
            backend = gkey[-1] if gkey else None
            color = COLORS.get(backend) if by_backend else f"C{j % 10}"
            marker = SERIES_MARKERS[j % len(SERIES_MARKERS)]
            for i, col in enumerate(cols):
                if col not in sub or sub[col].isna().all():
                    continue
                stat = col[len(metric) + 1:-2] if stats else ""
                err = spread(sub, col)
                lab = f"{label} {stat}".strip()
                if x_key is not None:
                    s = sub.sort_values(x_key)
                    err = spread(s, col)
                    x, y = s[x_key].to_numpy(dtype=float), s[col].to_numpy(dtype=float)
                    ax.errorbar(x, y, yerr=None if err is None else np.vstack(err), color=color,
                                ls="-" if i == 0 else "--", marker=marker, ms=5 if i == 0 else 4,
                                mfc=color if i == 0 else "white", capsize=3, label=lab)
                    cut = s.point.isin(partial).to_numpy()
                    if cut.any():  # an interrupted point's figures cover part of its workload
                        ax.scatter(x[cut], y[cut], s=90, facecolors="white", edgecolors=color, hatch="////",
                                   zorder=4, label="interrupted (partial)" if i == 0 and j == 0 else None)
                        for xi, yi in zip(x[cut], y[cut]):
                            ax.annotate("partial", (xi, yi), textcoords="offset points", xytext=(6, 6), fontsize=7)
                else:
                    pos = np.array([points.index(p) for p in sub.point]) - 0.4 + width * (j + 0.5)
                    bars = ax.bar(pos, sub[col].to_numpy(dtype=float), width, color=color,
                                  alpha=1.0 if i == 0 else 0.4, yerr=None if err is None else np.vstack(err),
                                  capsize=3, label=lab, zorder=2 if i == 0 else 1,
                                  hatch=None if by_backend else SERIES_HATCHES[j % len(SERIES_HATCHES)])
                    for bar, p in zip(bars, sub.point):
                        if p in partial:
                            bar.set_hatch("////")
                            bar.set_edgecolor("black")
                            if i == 0:
                                ax.annotate("partial", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                            textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
        if kind in ("ttft", "tpot", "e2e"):
            for stat, target in ctx.slo_targets(kind):
                ax.axhline(target, color="red", ls="--", lw=1.2, label=f"SLO {stat} <= {format_seconds(target)}")
        if kind in ("ttft", "tpot", "e2e") and x_key is not None and ax.get_legend_handles_labels()[0]:
            drawn = ok[[c for c in cols if c in ok]].to_numpy(dtype=float)
            drawn = drawn[np.isfinite(drawn) & (drawn > 0)]  # the values, not error bars clipped at 0
            log_time_axis(ax, "y", (float(drawn.min()), float(drawn.max())) if drawn.size else None)
        elif kind in ("ttft", "tpot", "e2e"):
            _seconds_axis(ax, "y")
        else:  # throughputs and the makespan: from 0, so equal points look equal
            zero_based_axis(ax, seconds=kind == "time")
        if stats:
            title += " (p50 solid, tail dashed; log scale)" if x_key is not None else " (p50 dark, tail light)"
        ax.set_title(title, fontsize=9)
        if x_key is not None:
            xs = sorted(set(float(v) for v in ok[x_key].dropna()))
            if xs[0] > 0 and xs[-1] / xs[0] >= 10:  # e.g. 8, 16, ..., 256: even spacing on a log axis
                ax.set_xscale("log")
            if len(xs) <= 12:  # ticks at the swept values
                from matplotlib.ticker import NullFormatter  # noqa: PLC0415

                ax.set_xticks(xs, [f"{v:g}" for v in xs])
                ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(x_key)
        else:
            first = ok.drop_duplicates("point").set_index("point")
            labels = [", ".join(f"{k.split('.')[-1]}={first.at[p, k]}" for k in keys) or p for p in points]
            ax.set_xticks(range(len(points)))
            ax.set_xticklabels(labels, rotation=15 if len(points) > 3 else 0, ha="right" if len(points) > 3 else "center",
                               fontsize=8)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7.5)
    has_err = any(spread(ok, c) is not None for c in ok.columns)
    ctx.suptitle(fig, "sweep" + (" (error bars: 95% interval of the mean over seeds)" if has_err else "")
                 + (f"; {len(partial)} interrupted point(s) hatched" if partial else ""))
    return _save(fig, path)
