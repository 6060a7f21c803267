"""`capacity.md`: the answer per configuration, how it was found, and the latency-vs-load tables."""
from __future__ import annotations

import math
from typing import Any, Optional

from servetwin.core.testbed.atomic import atomic_write_text

from servetwin.experiments.common.md_tables import fmt_pm, fmt_to
from servetwin.experiments.run.steady_state import STEADY_GROWTH, steady_limit
from servetwin.experiments.run.report import fmt, md_table


def _load(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:g}"


def _pm(stats: dict[str, Any]) -> str:
    if not stats or stats.get("mean") is None:
        return "-"
    if stats.get("ci_lo") is None:
        return fmt(stats["mean"])
    return fmt_pm(stats["mean"], stats["ci_lo"], stats["ci_hi"])


def _ratio(r: Optional[float]) -> str:
    return "-" if r is None else ("inf" if not math.isfinite(r) else f"{100 * r:.0f}%")


def answer_line(r: dict[str, Any], unit: str) -> str:
    lo, hi = r["interval"]
    if r["status"] == "below_range":
        return f"below {_load(hi)} {unit} (every probe down to it misses the SLO)"
    if r["status"] == "above_range":
        return f"above {_load(lo)} {unit} (every probe up to it meets the SLO)"
    w = hi - lo
    return f"{fmt_to(lo, w)} {unit} (interval [{fmt_to(lo, w)}, {fmt_to(hi, w)}))"


def length_line(r: dict[str, Any]) -> str:
    """`probes of 1000 requests (4000 at the failing end)`: how long the probes at the bracket ran."""
    at_lo, at_hi = r.get("probe_requests") or (None, None)
    if at_lo is None and at_hi is None:
        return "-"
    if at_lo == at_hi or at_hi is None or at_lo is None:
        return f"{at_lo or at_hi}"
    return f"{at_lo} (failing end: {at_hi})"


def _growth(p: dict[str, Any]) -> str:
    g = p.get("growth")
    if not g:
        return "-"
    return (f"{100 * g['wait_growth']:+.0f}% / {100 * g['in_system_growth']:+.0f}%"
            + ("" if p.get("steady") else " (growing)"))


def per_seed_line(ci: dict[str, Any]) -> str:
    """`mean [lo, hi]` of the per-seed crossings, digits following the interval's width."""
    if ci.get("ci_lo") is None:
        return fmt(ci.get("mean"))
    w = ci["ci_hi"] - ci["ci_lo"]
    return f"{fmt_to(ci['mean'], w)} [{fmt_to(ci['ci_lo'], w)}, {fmt_to(ci['ci_hi'], w)}]"


def limited_line(r: dict[str, Any], unit: str) -> str:
    """What binds the answer: the resource the runs at the capacity name (experiments/run/binding.py)."""
    b = r.get("limited_by")
    if not b:
        return "-"
    share = f"{b['seeds']} of {b['of']} seeds" if b["of"] > 1 else "the run"
    line = b["line"]
    if b["resource"] == "arrival_rate" and b.get("latency"):  # keeps up: the SLO is bound by a latency part
        line = f"{b['latency']['line']}; the server keeps up with the load ({b['facts']})"
    lo, hi = r["interval"]
    load = fmt_to(b["load"], hi - lo) if lo is not None and hi is not None else _load(b["load"])
    return f"at {load} {unit} ({share}): {line}"


def winner_lines(answer: dict[str, Any]) -> list[str]:
    """Name the configuration serving the most only when its interval separates from the others'."""
    if len(answer["searches"]) < 2:
        return []
    b = answer.get("best")
    if b:
        return [f"**Serves the most:** `{b['point']}` on {b['backend']} ({_load(b['capacity'])} {answer['unit']}): "
                "its interval is clear of every other configuration's.", ""]
    return ["**No configuration is clearly ahead:** their capacity intervals overlap (more seeds or a tighter "
            "`--tol` may separate them).", ""]


def capacity_markdown(answer: dict[str, Any]) -> str:
    """capacity.md's text."""
    knob = answer["over"]
    unit = answer["unit"]
    spec = ", ".join(f"`{k}` {v:g}" for k, v in answer["slo"].items())
    seeds = answer["seeds"]
    lines = [f"# Capacity of {answer['name']}", ""]
    if answer.get("interrupted"):
        lines += ["**Interrupted (Ctrl-C): the searches stopped early; their brackets are wider than asked.**", ""]
    lines += [f"The highest `{knob}` meeting the SLO ({spec}) at {answer['confidence']:.0%} confidence over "
              f"{len(seeds)} seeds ({', '.join(map(str, seeds))}), bracketed to {answer['rel_tol']:.0%}.", ""]
    rows = []
    for r in answer["searches"]:
        rows.append([r["point"], r["backend"], answer_line(r, unit), r["binding"] or "-",
                     per_seed_line(r["per_seed_capacity_ci95"]), r["probes"], length_line(r), r.get("note") or ""])
    lines += ["## Answer", "", md_table(["configuration", "backend", f"capacity ({unit})", "binding SLO",
                                         "per-seed capacity: mean [95% CI]", "probes", "requests per probe run",
                                         "note"], rows), ""]
    lines += ["## What limits the answer", ""]
    lines += [f"- `{r['point']}` [{r['backend']}]: {limited_line(r, unit)}." for r in answer["searches"]] + [""]
    lines += winner_lines(answer)
    lines += ["## Method", "",
              "Each probe runs the experiment at one load once per seed (seed s is the same workload draw at "
              "every load). A probe passes when, for every SLO target, the one-sided Student-t upper bound at "
              f"{answer['confidence']:.0%} confidence on the mean over seeds of the run's statistic is within "
              "the limit (for per-request deadlines: the lower bound of the mean attainment is at least the "
              "required share). The search doubles or halves from the config's load until one probe passes and "
              "a higher one fails, then narrows the bracket by k-section (k loads per round, as many as the "
              "workers allow; k = 1 is bisection). A probe must also be steady: over the second half of its "
              "arrivals (the first half is its warm-up) the mean over seeds of the growth of the waits "
              "before the engine schedules a request, from the third to the last quarter, must be within "
              f"{100 * STEADY_GROWTH:.0f}% / sqrt(seeds) ({100 * steady_limit(len(seeds)):.0f}% here): one "
              "whose waits still grow fails, whatever its percentiles say - a server that cannot keep up "
              "only looks fine in a short run. A probe meeting the SLO but not settled (its waits, or the "
              "requests in the system, growing by more than half that) runs "
              "again at twice the requests (up to 8x); the longest run decides. The answer is confirmed at the "
              "full extension before the search ends (failing there, the search goes on below it): it holds "
              "at the run lengths its probes reached. "
              "The capacity is the highest passing load below the lowest "
              "failing one; the interval is that bracket. The per-seed capacity interpolates where each seed's "
              "own worst value/limit ratio crosses 1, with the 95% t interval of its mean: how much a one-seed "
              "answer would vary (a seed whose waits still grow crosses there too). The binding SLO is the worst "
              "check at the lowest failing probe (`steady_state`: the probe met its SLO but kept growing).", ""]
    for r in answer["searches"]:
        names = list(dict.fromkeys(n for p in r["curve"] for n in p["checks"]))
        head = ["load", "pass", "requests"] + [f"{n} mean ± 95% CI" for n in names] \
            + [f"{n} bound / limit" for n in names] + ["growth: waits / in system", "goodput (req/s)"]
        table = []
        for p in r["curve"]:
            table.append([p["load"], "yes" if p["passed"] else "NO", p.get("requests") or "-"]
                         + [_pm(p["checks"].get(n)) for n in names]  # (a probe whose runs all failed: none)
                         + [_ratio((p["checks"].get(n) or {}).get("ratio")) for n in names]
                         + [_growth(p), _pm(p["goodput_req_s"])])
        title = r["point"] if r["point"] != "base" else answer["name"]
        lines += [f"## Latency vs load: {title} [{r['backend']}]", "", md_table(head, table), ""]
        errs = [e for p in r["curve"] for e in p["errors"]]
        if errs:
            lines += ["Probe runs that failed (they fail their probe):", ""] + [f"- {e}" for e in errs[:20]] + [""]
    if answer.get("plot"):
        lines += ["## Plot", "", f"![capacity]({answer['plot']})", ""]
    if answer.get("hosts"):
        lines += ["## Where the probes ran", "", f"Pool: {answer['pool']}.", ""] + [f"- {h}" for h in answer["hosts"]]
    lines += ["", "Files: `capacity.json` (everything above; written last: a folder without it is incomplete), "
              "`probes.csv` (one row per probe run), `config.yaml` (the validated config)."]
    return "\n".join(lines) + "\n"


def write_capacity_md(answer: dict[str, Any], path: str) -> str:
    atomic_write_text(path, capacity_markdown(answer))
    return path
