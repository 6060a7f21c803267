"""`servetwin capacity`: drive `CapacitySearch`es (one per engine-grid point and backend) through a pool.

    DIR/config.yaml      the validated config
    DIR/capacity.json    every search's answer and probes
    DIR/capacity.md      the answer per configuration, the binding SLO, latency-vs-load tables
    DIR/probes.csv       one row per probe run (grid point, backend, load, seed): the sweep metrics,
                         the SLO checks and the run's worst value/limit ratio
    DIR/capacity.png     latency vs load per SLO target, with the limits and the capacities

Probes write no run folders (only their summaries come back), so a search costs its simulations.
DIR follows the run-folder protocol (`servetwin.experiments.run.run_folder`): locked while the search runs, a
non-empty folder refused unless --overwrite, nothing touched before the first probe results are written,
every file renamed into place complete and capacity.json last (its presence and its `interrupted` flag
are the truth about the folder).
"""
from __future__ import annotations

import copy
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from servetwin.experiments.capacity.capacity import MAX_EXTEND, STEADY_CHECK, CapacitySearch, run_ratio
from servetwin.experiments.sweep.pool import PointResult, PointTask, host_summary, map_with_retries
from servetwin.experiments.sweep.pool_factory import make_pool
from servetwin.experiments.run.run_folder import RunFolder
from servetwin.experiments.config.schema import (ConfigError, ExperimentConfig, extend_requests,
                                                 check_run_count, expand_sweep, parse_override,
                                                 set_dotted, sweep_run_count, validate_config, with_seed)
from servetwin.experiments.config.slo import SloSpec, parse_slo
from servetwin.experiments.common.stats import mean_ci

LOAD_KNOBS = ("workload.arrival.rate", "workload.arrival.clients")
DEFAULT_SEEDS = 4


@dataclass(slots=True)
class Search:
    point: str  # the grid point's name ("base" without a grid)
    assignments: dict[str, Any]
    backend: str
    raw: dict[str, Any]  # the point's config, without seeds / sweep
    search: CapacitySearch


def default_knob(exp: ExperimentConfig) -> str:
    arrival = exp.workload.given.get("arrival")
    kind = arrival.get("type") if isinstance(arrival, dict) else None
    if kind in ("poisson", "gamma"):
        return "workload.arrival.rate"
    if kind == "closed_loop":
        return "workload.arrival.clients"
    raise ConfigError("--over", f"workload.arrival is {kind or 'offline'!r}, which has no load to raise; use a "
                      "poisson / gamma arrival (workload.arrival.rate) or closed_loop (workload.arrival.clients)")


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """`--grid engine.max_num_batched_tokens=[2048,8192]` (repeatable) -> {key: values}."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, values = parse_override(item)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"--grid {key}", f"must be a non-empty YAML list, e.g. --grid {key}=[2048,8192]")
        if key in LOAD_KNOBS:
            raise ConfigError(f"--grid {key}", "is the searched load (--over), not a grid axis")
        grid[key] = values
    return grid


def _start_load(exp: ExperimentConfig, knob: str) -> float:
    arrival = exp.workload.given.get("arrival") or {}
    field = knob.rsplit(".", 1)[1]
    if not isinstance(arrival, dict) or field not in arrival:
        raise ConfigError(f"--over {knob}", f"the config has no {knob} to start from "
                          f"(workload.arrival is {arrival!r})")
    return float(arrival[field])


def probe_length(raw: dict[str, Any]) -> Optional[int]:
    """A probe's requests as the config gives them (conversations: their count; a shared-prefix workload:
    groups x per group), what extensions double; None for a file or scenario of fixed length."""
    w = raw.get("workload") or {}
    conv, sp = w.get("conversations"), w.get("shared_prefix")
    if isinstance(conv, dict):
        return conv.get("count") if isinstance(conv.get("count"), int) else None
    if isinstance(sp, dict):
        n = sp.get("groups", 1) * sp.get("per_group", 0) if isinstance(sp.get("per_group"), int) else None
        return n or None
    if w.get("file") or w.get("scenario"):
        return None
    return w.get("requests") if isinstance(w.get("requests"), int) else None


def build_searches(exp: ExperimentConfig, knob: str, grid: dict[str, list[Any]], spec: SloSpec,
                   confidence: float, rel_tol: float, lo: Optional[float], hi: Optional[float],
                   max_probes: int, max_runs: Optional[int] = None,
                   log: Optional[Callable[[str], None]] = None, max_extend: int = MAX_EXTEND) -> list[Search]:
    base = exp.to_dict()
    for key in ("sweep", "seeds"):
        base.pop(key, None)
    base["slo"] = spec.to_dict()
    base.setdefault("output", {})
    base["output"] = dict(base["output"] or {}, plots=False, step_requests=False)
    if grid:
        check_run_count(sweep_run_count(grid), "the --grid points", "--grid", max_runs)  # before any is built
        gridded = copy.deepcopy(base)
        gridded["sweep"] = grid
        try:
            points = expand_sweep(validate_config(gridded, exp.base_dir, exp.name), max_runs=max_runs, log=log)
        except ConfigError as e:
            # a grid error names the sweep key; on this command that key is a --grid flag
            raise ConfigError("--grid " + e.path.removeprefix("sweep."), e.message) if e.path.startswith("sweep.") \
                else e from None
    else:
        points = None
    start = _start_load(exp, knob)
    searches = []
    for point in points or [None]:
        raw = point.raw if point is not None else base
        for backend in exp.backends:
            one = copy.deepcopy(raw)
            one["backends"] = [backend]
            searches.append(Search(point.name if point is not None else "base",
                                   dict(point.assignments) if point is not None else {}, backend, one,
                                   CapacitySearch(start, confidence, rel_tol, integer=knob.endswith("clients"),
                                                  lo=lo, hi=hi, max_probes=max_probes,
                                                  requests=probe_length(one), max_extend=max_extend)))
    return searches


def _probe_raw(s: Search, knob: str, load: float, seed: int) -> dict[str, Any]:
    raw = with_seed(s.raw, seed)
    set_dotted(raw, knob, int(load) if knob.endswith("clients") else float(load))
    n = s.search.length(load)
    if n is not None and n != s.search.requests:  # an extended probe: twice the requests per extension
        extend_requests(raw, n)  # (a shared-prefix workload: its pattern repeated, not redrawn wider)
    return raw


def _fmt_load(load: float) -> str:
    return f"{load:g}"


def run_capacity(exp: ExperimentConfig, out_dir: str, knob: Optional[str] = None, slo: Any = None,
                 seeds: Optional[list[int]] = None, confidence: float = 0.9, rel_tol: float = 0.02,
                 grid: Optional[dict[str, list[Any]]] = None, jobs: int = 1, ray: Any = None, retries: int = 2,
                 lo: Optional[float] = None, hi: Optional[float] = None, max_probes: int = 40,
                 progress: bool = True, plots: bool = True, max_extend: int = MAX_EXTEND,
                 log: Optional[Callable[[str], None]] = None, overwrite: bool = False,
                 folder: Optional[RunFolder] = None, max_runs: Optional[int] = None) -> dict[str, Any]:
    """Search the capacity of every grid point x backend; writes DIR/capacity.{json,md,png}, probes.csv.
    `slo`: a mapping like the YAML's `slo:` (None: the config's). Returns the capacity.json content.
    `folder`: a RunFolder of `out_dir` the caller already acquired (else one is acquired here, refusing a
    non-empty folder unless `overwrite`). Ctrl-C stops the search, writes what it found (capacity.json
    marked interrupted) and re-raises."""
    if folder is None:
        with RunFolder(out_dir, overwrite=overwrite) as owned:
            return run_capacity(exp, out_dir, knob, slo, seeds, confidence, rel_tol, grid, jobs, ray, retries,
                                lo, hi, max_probes, progress, plots, max_extend, log, folder=owned, max_runs=max_runs)
    log = log or (lambda msg: print(msg, file=sys.stderr))
    knob = knob or default_knob(exp)
    if knob not in LOAD_KNOBS:
        raise ConfigError("--over", f"must be one of {', '.join(LOAD_KNOBS)}, got {knob!r}")
    spec = parse_slo(slo, "--slo") if slo else exp.slo  # SloError is a ConfigError
    if spec is None or spec.empty:
        raise ConfigError("--slo", "no SLO to search under: give --slo ttft_p99_s=0.5 (repeatable) or an `slo:` "
                          "mapping in the config")
    if not 0.5 <= confidence < 1:
        raise ConfigError("--confidence", f"must be in [0.5, 1), got {confidence}")
    if not 0 < rel_tol < 1:
        raise ConfigError("--tol", f"must be in (0, 1), got {rel_tol}")
    if not isinstance(max_extend, int) or max_extend < 0:
        raise ConfigError("--max-extend", f"must be an integer >= 0, got {max_extend!r}")
    seeds = seeds or list(range(exp.seed, exp.seed + DEFAULT_SEEDS))
    searches = build_searches(exp, knob, grid or {}, spec, confidence, rel_tol, lo, hi, max_probes, max_runs,
                              log if progress else None, max_extend)
    pool = make_pool(jobs if ray is None else 1, ray)
    first = ", ".join(_fmt_load(x) for x in (lo, hi) if x is not None) or _fmt_load(searches[0].search.start)
    log(f"capacity {exp.name}: {len(searches)} search(es) over {knob} from {first}, "
        f"SLO {spec.to_dict()}, {len(seeds)} seeds per probe, confidence {confidence:g}, on {pool.description}")
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415
        bar = tqdm(total=0, desc=f"capacity {exp.name}", unit="run", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    ran: list[PointResult] = []
    interrupted = False
    try:
        while True:
            active = [s for s in searches if not s.search.done]
            if not active:
                break
            k = max(1, pool.workers // (len(active) * len(seeds)))
            tasks = []
            for si, s in enumerate(searches):
                if s.search.done:
                    continue
                for load in s.search.next_loads(k):
                    for seed in seeds:
                        tasks.append(PointTask(f"{s.point}/{s.backend}/load={_fmt_load(load)}/seed={seed}",
                                               _probe_raw(s, knob, load, seed), exp.base_dir, "summary",
                                               meta={"search": si, "load": load, "seed": seed}))
            if bar is not None:
                bar.total += len(tasks)
                bar.refresh()
            got: dict[tuple[int, float], dict[int, PointResult]] = {}

            def done(task: PointTask, result: PointResult) -> None:
                got.setdefault((task.meta["search"], task.meta["load"]), {})[task.meta["seed"]] = result
                ran.append(result)
                if bar is not None:
                    bar.update(1)

            map_with_retries(pool, tasks, done, retries=retries, log=log)
            for (si, load), by_seed in sorted(got.items()):
                s = searches[si]
                evals, errors = [], []
                for seed in seeds:
                    r = by_seed.get(seed, PointResult("not run"))
                    summ = ((r.summary or {}).get("backends") or {}).get(s.backend) if r.status == "ok" else None
                    evals.append(dict(summ["slo"], resource=summ.get("binding"),
                                      steady_state=summ.get("steady_state")) if summ and summ.get("slo") else None)
                    if r.status != "ok":
                        errors.append(f"seed {seed}: {r.status}" + (f" ({r.error})" if r.error else ""))
                    rows.append(_probe_row(s, load, seed, r, summ, s.search.length(load)))
                probe = s.search.record(load, evals, errors)
                log(_probe_line(s, knob, probe, confidence, errors))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        pool.close()
        if bar is not None:
            bar.close()
    answer = _answer(exp, knob, spec, seeds, searches, confidence, rel_tol, interrupted, pool.description,
                     host_summary(ran))
    _write_outputs(folder, exp, answer, rows, plots)
    if interrupted:
        raise KeyboardInterrupt
    return answer


def _probe_line(s: Search, knob: str, probe: Any, confidence: float, errors: list[str]) -> str:
    """`  base [sim] rate=30 (1000 requests): pass (worst ...)`, or that the probe runs again, longer."""
    length = f" ({probe.requests} requests)" if probe.requests is not None else ""
    head = f"  {s.point} [{s.backend}] {knob.rsplit('.', 1)[1]}={_fmt_load(probe.load)}{length}: "
    growth = ("" if probe.growth is None else
              f"; growth over its second half: waits {100 * probe.growth['wait_growth']:+.0f}%, in system "
              f"{100 * probe.growth['in_system_growth']:+.0f}% (mean over seeds; steady: waits within "
              f"{100 * probe.growth['limit']:.0f}%)")
    if probe.load in s.search.pending:
        verdict = f"SLO met but not settled: again with {s.search.length(probe.load)} requests"
    else:
        verdict = (f"{'pass' if probe.passed else 'FAIL'} (worst {probe.worst}: "
                   f"{_fmt_ratio(probe.ratios.get(probe.worst))} of its limit at {confidence:g} confidence)")
    return head + verdict + growth + (f"; {'; '.join(errors)}" if errors else "")


def _fmt_ratio(r: Optional[float]) -> str:
    return "-" if r is None else ("inf" if not math.isfinite(r) else f"{100 * r:.0f}%")


def _probe_row(s: Search, load: float, seed: int, r: PointResult, summ: Optional[dict],
               requests: Optional[int]) -> dict[str, Any]:
    from servetwin.experiments.sweep.sweep import metric_row  # noqa: PLC0415

    row: dict[str, Any] = {"point": s.point, **s.assignments, "backend": s.backend, "load": load, "seed": seed,
                           "requests": requests,
                           "status": r.status if summ is not None or r.status != "ok" else "not run"}
    row.update(metric_row(summ))
    state = (summ or {}).get("steady_state") or {}
    row.update(in_system_growth=state.get("in_system_growth"), wait_growth=state.get("wait_growth"),
               steady=state.get("steady"))
    ev = (summ or {}).get("slo")
    row["worst_ratio"] = run_ratio(ev) if ev else None
    for c in (ev or {}).get("checks", []):
        row[f"check_{c['name']}"] = c["value"] if c["kind"] != "deadline" else c["attainment"]
    row.update(error=r.error, host=r.host or None, attempts=r.attempts, point_wall_s=r.wall_s)
    return row


def _curve(s: Search) -> list[dict[str, Any]]:
    """The latency-vs-load table of one search: per probe, each check's per-seed mean / 95% CI / bound."""
    out = []
    for load in sorted(s.search.probes):
        p = s.search.probes[load]
        checks: dict[str, Any] = {}
        for name in p.ratios:
            if name == STEADY_CHECK:  # not an SLO check of the runs: `growth` below
                continue
            vals = []
            for ev in p.evaluations:
                c = next((x for x in (ev or {}).get("checks", []) if x["name"] == name), None)
                vals.append(None if c is None else c["value"])
            checks[name] = dict(mean_ci(vals), bound=p.bounds.get(name), ratio=p.ratios[name])
        att = {}
        for ev in p.evaluations:
            for c in (ev or {}).get("checks", []):
                if c["kind"] == "target":
                    att.setdefault(c["name"], []).append(c["attainment"])
        goodput = mean_ci([(ev or {}).get("goodput_req_s") for ev in p.evaluations])
        share = sum(1 for ev in p.evaluations if ev and ev.get("met")) / max(1, len(p.evaluations))
        out.append({"load": load, "passed": p.passed, "worst": p.worst, "checks": checks, "seed_pass_share": share,
                    "attainment": {k: mean_ci(v, within=(0.0, 1.0)) for k, v in att.items()}, "goodput_req_s": goodput,
                    "errors": p.errors, "requests": p.requests, "extended": p.extended, "growth": p.growth,
                    "steady": p.steady})
    return out


def load_unit(exp: ExperimentConfig, knob: str) -> tuple[str, str]:
    """The searched load's unit and axis label: a rate of requests, or of conversation starts
    (`workload.conversations`: each start brings several turns), or closed-loop clients / users."""
    conversations = exp.workload.spec is not None and exp.workload.spec.conversations is not None
    if knob.endswith("rate"):
        return (("conversations/s", "conversation start rate (conversations/s)") if conversations
                else ("req/s", "request rate (req/s)"))
    return ("users", "closed-loop users (one conversation at a time)") if conversations \
        else ("clients", "closed-loop clients")


def limited_by(search: Any) -> Optional[dict[str, Any]]:
    """What limits the answer: the binding resource (experiments/run/binding.py) of the runs at the capacity
    (the highest passing load; else the lowest probe), the one most of its seeds name."""
    load = search.lo_pass if search.lo_pass is not None else min(search.probes, default=None)
    if load is None:
        return None
    named = [ev["resource"] for ev in search.probes[load].evaluations if ev and ev.get("resource")]
    if not named:
        return None
    kinds = [b["resource"] for b in named]
    top = max(dict.fromkeys(kinds), key=kinds.count)
    return dict(next(b for b in named if b["resource"] == top), load=load, seeds=kinds.count(top), of=len(kinds))


def separated_best(results: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The configuration serving the most, named only when its interval is clear of every other's: its
    bracket's low end above their brackets' high ends, and (with per-seed intervals) its per-seed 95%
    interval above theirs. None when the intervals overlap: the data cannot tell them apart."""
    ok = [r for r in results if r["capacity"] is not None]
    if not ok:
        return None
    best = max(ok, key=lambda r: r["capacity"])
    for r in results:
        if r is best:
            continue
        hi = r["interval"][1]
        if hi is None or best["capacity"] < hi:
            return None
        mine, theirs = best["per_seed_capacity_ci95"], r["per_seed_capacity_ci95"]
        if mine.get("ci_lo") is not None and theirs.get("ci_hi") is not None and mine["ci_lo"] <= theirs["ci_hi"]:
            return None
    return {"point": best["point"], "backend": best["backend"], "capacity": best["capacity"]}


def _answer(exp, knob, spec, seeds, searches, confidence, rel_tol, interrupted, pool, hosts) -> dict[str, Any]:
    results = []
    for s in searches:
        res = s.search.result()
        res.update(point=s.point, assignments=s.assignments, backend=s.backend, curve=_curve(s),
                   limited_by=limited_by(s.search))
        results.append(res)
    best = separated_best(results)
    unit, unit_label = load_unit(exp, knob)
    from servetwin.experiments.run.plots import context_for  # noqa: PLC0415  (no matplotlib: the title only)

    return {"name": exp.name, "title": context_for(exp, varied=(knob,)).title, "over": knob, "unit": unit, "unit_label": unit_label, "slo": spec.to_dict(),
            "seeds": seeds, "confidence": confidence,
            "rel_tol": rel_tol, "interrupted": interrupted, "pool": pool, "hosts": hosts,
            "best": {"point": best["point"], "backend": best["backend"], "capacity": best["capacity"]} if best
            else None, "searches": results}


def _write_outputs(folder: RunFolder, exp: ExperimentConfig, answer: dict, rows: list[dict], plots: bool) -> None:
    """config.yaml, probes.csv, capacity.png, capacity.md, then capacity.json: each renamed into place
    complete, the answer last (the first write clears what an earlier run left, with --overwrite)."""
    import pandas as pd  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    from servetwin.experiments.capacity.capacity_report import capacity_markdown  # noqa: PLC0415
    from servetwin.experiments.run.report import portable_config  # noqa: PLC0415

    folder.write_text("config.yaml", yaml.safe_dump(portable_config(exp.to_dict(), folder.path), sort_keys=False))
    frame = pd.DataFrame(rows)
    folder.write_with("probes.csv", lambda tmp: frame.to_csv(tmp, index=False))
    plot = None
    if plots and any(r["curve"] for r in answer["searches"]):
        from servetwin.experiments.capacity.capacity_plots import capacity_plot  # noqa: PLC0415

        plot = capacity_plot(answer, folder.file("capacity.png"))
        if plot:
            folder.record("capacity.png")
    answer["plot"] = os.path.basename(plot) if plot else None
    folder.write_text("capacity.md", capacity_markdown(answer))
    folder.write_json("capacity.json", answer)  # last: its presence and "interrupted" are the truth
