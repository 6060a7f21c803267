"""`capacity.png`: each SLO target against the load, mean over seeds with 95% intervals, the limit as a
line, each configuration's capacity as a marker on the load axis, and the share of seeds meeting it."""
from __future__ import annotations

import math
from typing import Any, Optional

from servetwin.core.testbed.atomic import atomic_write_with
from servetwin.experiments.run.binding import LABELS


def _plt():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _time_unit(values: list[float]) -> tuple[float, str]:
    top = max((v for v in values if v is not None and math.isfinite(v)), default=1.0)
    return (1e3, "ms") if top < 1.0 else (1.0, "s")


def capacity_plot(answer: dict[str, Any], path: str) -> Optional[str]:
    plt = _plt()
    searches = [r for r in answer["searches"] if r["curve"]]
    if not searches:
        return None
    names = list(dict.fromkeys(n for r in searches for p in r["curve"] for n in p["checks"]))
    limits = answer["slo"]
    unit_label = answer["unit_label"]
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(5.2 * (len(names) + 1), 4.4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes[0], names):
        is_time = name != "attainment"
        all_vals = [p["checks"][name]["mean"] for r in searches for p in r["curve"] if name in p["checks"]]
        scale, unit = _time_unit(all_vals + [limits.get(name)]) if is_time else (100.0, "%")
        for i, r in enumerate(searches):
            c = colors[i % len(colors)]
            pts = [p for p in r["curve"] if name in p["checks"] and p["checks"][name]["mean"] is not None]
            x = [p["load"] for p in pts]
            y = [p["checks"][name]["mean"] * scale for p in pts]
            # a t interval can reach below zero: on the log axis its lower end is the lowest seed's value
            lo = [(p["checks"][name]["mean"] - max(p["checks"][name]["ci_lo"] or p["checks"][name]["mean"],
                                                   p["checks"][name]["min"])) * scale for p in pts]
            hi = [((p["checks"][name]["ci_hi"] or p["checks"][name]["mean"]) - p["checks"][name]["mean"]) * scale
                  for p in pts]
            label = f"{r['point']} [{r['backend']}]" if len(searches) > 1 else r["backend"]
            ax.errorbar(x, y, yerr=[lo, hi], color=c, marker="o", ms=4, capsize=3, lw=1.2, label=label)
            for p, yy in zip(pts, y):
                if not p["passed"]:
                    ax.plot([p["load"]], [yy], "x", color="black", ms=6, zorder=5)
            if r["capacity"] is not None:
                ax.axvline(r["capacity"], color=c, ls=":", lw=1)
        limit = limits.get(name) if is_time else limits.get("min_attainment")
        if limit is not None:
            ax.axhline(limit * scale, color="tab:red", ls="--", lw=1, label=f"SLO {limit * scale:g} {unit}")
        if is_time:
            from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(unit_label)
        ax.set_ylabel(f"{name} ({unit}), mean over seeds ± 95% CI")
        ax.set_title(name.replace("_s", "").replace("_", " "))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ax = axes[0][-1]
    for i, r in enumerate(searches):
        c = colors[i % len(colors)]
        x, y = [], []
        for p in r["curve"]:
            x.append(p["load"])
            y.append(100 * p["seed_pass_share"])
        ax.plot(x, y, marker="o", ms=4, color=c, label=f"{r['point']} [{r['backend']}]" if len(searches) > 1
                else r["backend"])
        if r["capacity"] is not None:
            ax.axvline(r["capacity"], color=c, ls=":", lw=1)
    ax.set_ylim(-5, 105)
    ax.set_xlabel(unit_label)
    ax.set_ylabel("seeds meeting the whole SLO (%)")
    ax.set_title("SLO met, per seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    spec = ", ".join(f"{k} {v:g}" for k, v in limits.items())
    caps = "; ".join(f"{r['point'] if len(searches) > 1 else r['backend']}: "
                     f"{'-' if r['capacity'] is None else format(r['capacity'], 'g')}" for r in searches)
    bound = "; ".join(f"{r['point'] if len(searches) > 1 else r['backend']} limited by "
                      f"{LABELS[r['limited_by']['resource']]}" for r in searches if r.get("limited_by"))
    fig.suptitle(f"{answer.get('title') or answer['name']}\ncapacity under {spec} at {answer['confidence']:.0%} "
                 f"confidence, {len(answer['seeds'])} seeds ({caps}); x = failing probe"
                 + (f"\n{bound} (capacity.md: why)" if bound else ""), fontsize=10)
    fig.tight_layout()
    try:  # under a temporary name, renamed when complete (the run-folder protocol)
        atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return path
