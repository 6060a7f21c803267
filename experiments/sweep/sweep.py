"""`servetwin sweep`: the grid in `sweep:`, one run per point (and per seed), one table.

    DIR/<point>/...              each point's run (the `servetwin run` layout), named by its values
    DIR/<point>/seed=<S>/...     with seeds (`seeds:` / `--seeds N`): one run folder per seed
    DIR/sweep.csv                one row per (point, backend): swept values, status, metrics (with seeds:
                                 the mean over seeds, plus <metric>_std, <metric>_ci_lo, <metric>_ci_hi,
                                 the 95% t interval of the mean)
    DIR/sweep_seeds.csv          with seeds: one row per (point, seed, backend)
    DIR/sweep.md                 the tables, ratios to the first point, where each point ran, links
    DIR/sweep_comparison.png

The points run through a `servetwin.experiments.sweep.pool` pool: local worker processes (`-j N`) or Ray
(`--ray [ADDRESS]`); the folder and the tables are the same either way.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Callable, Optional

from servetwin.core.testbed.atomic import atomic_write_text
from servetwin.experiments.sweep.pool import PointResult, PointTask, host_summary, map_with_retries
from servetwin.experiments.sweep.pool_factory import make_pool
from servetwin.experiments.run.run_folder import RunFolder
from servetwin.experiments.config.schema import ExperimentConfig, SweepPoint, expand_sweep, seeds_for, with_seed

_LAT = [(f"{m}_{s}_s", (f"{m}_s", s)) for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")]
METRICS = [
    ("requests", ("requests",)), ("completed", ("completed",)), ("num_steps", ("num_steps",)),
    ("duration_s", ("duration_s",)), ("wall_s", ("wall_s",)), ("throughput_tok_s", ("throughput_tok_s",)),
    ("output_tok_s", ("output_tok_s",)), ("request_throughput_s", ("request_throughput_s",)),
    *_LAT,
    ("preemptions", ("preemptions",)), ("prefix_hit_rate", ("prefix_hit_rate",)),
    ("prompt_tokens", ("prompt_tokens",)), ("prefill_tokens_computed", ("prefill_tokens_computed",)),
    ("prefill_saving_x", ("prefill_saving_x",)), ("num_gpu_blocks", ("num_gpu_blocks",)),
    ("max_model_len", ("max_model_len",)), ("kv_peak_usage", ("kv_peak_usage",)),
    ("slo_met", ("slo", "met")), ("slo_attainment", ("slo", "attainment")),
    ("goodput_req_s", ("slo", "goodput_req_s")), ("slo_binding", ("slo", "binding")),
    ("bound_by", ("binding", "resource")),
]
NON_NUMERIC = {"slo_binding", "bound_by"}
MD_COLUMNS = ["status", "completed", "duration_s", "throughput_tok_s", "output_tok_s", "request_throughput_s",
              "preemptions", "prefix_hit_rate", "prefill_tokens_computed", "bound_by"]
SLO_MD_COLUMNS = ["slo_met", "slo_attainment", "goodput_req_s", "slo_binding"]
LATENCY_MD_COLUMNS = [f"{m}_{s}_s" for m in ("ttft", "tpot", "itl", "e2e") for s in ("p50", "p90", "p99")]
RUN_COLUMNS = ["host", "attempts", "point_wall_s"]  # where and how long each point ran


def _value(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v)


def _point_backends(point: SweepPoint, exp: ExperimentConfig) -> list[str]:
    """The backends one point runs: the config's, unless `backends` itself is swept."""
    backends = point.raw.get("backends", exp.backends)
    return [backends] if isinstance(backends, str) else list(backends)


def metric_row(summary: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The sweep columns of one backend's summary (None for a backend that did not run)."""
    row: dict[str, Any] = {}
    for col, path in METRICS:
        v: Any = summary
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        row[col] = v
    return row


def result_rows(point: str, assignments: dict[str, Any], seed: Optional[int], result: PointResult,
                backends: list[str], folder: str) -> list[dict[str, Any]]:
    """One table row per backend of one finished (or failed) point."""
    rows = []
    summaries = (result.summary or {}).get("backends", {})
    for backend in backends:
        row: dict[str, Any] = {"point": point}
        row.update({k: _value(v) for k, v in assignments.items()})
        if seed is not None:
            row["seed"] = seed
        row["backend"] = backend
        s = summaries.get(backend)
        status = result.status
        if s is None and status == "ok":
            status = "not run"
        elif s is not None and s.get("interrupted"):
            status = "interrupted"
        elif s is None and status == "interrupted":
            status = "not run"
        row["status"] = status
        row.update(metric_row(s))
        row["error"] = result.error
        row["dir"] = folder
        row.update(host=result.host or None, attempts=result.attempts, point_wall_s=result.wall_s)
        rows.append(row)
    return rows


def aggregate_seeds(df, keys: list[str]):
    """One row per (point, backend) from per-seed rows: numeric metrics as the mean over the seeds that
    ran ok, with <metric>_std / _ci_lo / _ci_hi (95% t interval); status ok only if every seed is."""
    import pandas as pd  # noqa: PLC0415

    from servetwin.experiments.common.stats import mean_ci  # noqa: PLC0415

    out = []
    for (point, backend), sub in df.groupby(["point", "backend"], sort=False):
        ok = sub[sub.status == "ok"]
        first = sub.iloc[0]
        row: dict[str, Any] = {"point": point}
        row.update({k: first[k] for k in keys})
        row["backend"] = backend
        bad = sub[sub.status != "ok"]
        row["status"] = "ok" if bad.empty else str(bad.status.iloc[0])
        row["seeds"] = len(sub)
        row["seeds_ok"] = len(ok)
        for col, _ in METRICS:
            if col in NON_NUMERIC:
                vals = [v for v in ok[col] if isinstance(v, str)]
                row[col] = max(set(vals), key=vals.count) if vals else None
                continue
            stats = mean_ci(ok[col].tolist())
            if col == "slo_met":  # the share of seeds meeting the SLO
                stats = mean_ci([float(v) for v in ok[col] if isinstance(v, (bool, int, float)) and v == v])
            row[col] = stats["mean"]
            row[f"{col}_std"] = stats["std"]
            row[f"{col}_ci_lo"] = stats["ci_lo"]
            row[f"{col}_ci_hi"] = stats["ci_hi"]
        errors = [e for e in sub.error if isinstance(e, str) and e]
        row["error"] = errors[0] if errors else None
        row["dir"] = os.path.dirname(str(first["dir"])) or str(first["dir"])
        row["host"] = ",".join(sorted({str(h) for h in sub.host if isinstance(h, str)})) or None
        row["attempts"] = int(sub.attempts.max())
        row["point_wall_s"] = float(sub.point_wall_s.sum())
        out.append(row)
    return pd.DataFrame(out)


def _map_points(pool, tasks: list[PointTask], retries: int, log, progress: Optional[tuple[str, str]]
                ) -> tuple[dict[str, PointResult], bool]:
    """Run every task on `pool` (bounded retries), logging each result and counting it on a progress bar
    (`progress`: its description and unit; None: no bar). Returns the results by task key and whether
    Ctrl-C stopped the run. The pool and the bar are closed either way."""
    results: dict[str, PointResult] = {}
    bar = None
    if progress is not None:
        from tqdm import tqdm  # noqa: PLC0415
        bar = tqdm(total=len(tasks), desc=progress[0], unit=progress[1], file=sys.stderr)

    def done(task: PointTask, result: PointResult) -> None:
        results[task.key] = result
        if bar is not None:
            bar.update(1)
        msg = f"  {task.key}: {result.status} ({result.wall_s:.1f}s" + (f" on {result.host}" if result.host else "")
        msg += (f", attempt {result.attempts}" if result.attempts > 1 else "") + ")"
        if result.error:
            msg += f" - {result.error}"
        log(msg)

    try:
        map_with_retries(pool, tasks, done, retries=retries, log=log)
        return results, False
    except KeyboardInterrupt:
        return results, True
    finally:
        pool.close()
        if bar is not None:
            bar.close()


def run_sweep(exp: ExperimentConfig, out_dir: str, jobs: int = 1, progress: bool = True,
              log: Optional[Callable[[str], None]] = None, seeds: Optional[list[int]] = None,
              ray: Any = None, retries: int = 0, overwrite: bool = False, folder: Optional[RunFolder] = None,
              max_runs: Optional[int] = None):
    """Run every point (x seed); write sweep_comparison.png / sweep.md / sweep.csv (last); returns the
    table (DataFrame). `ray`: None for the local pool of `jobs` workers, True / an address for Ray.
    The output folder follows `servetwin.experiments.run.run_folder` (locked, a non-empty one refused
    unless `overwrite`). On KeyboardInterrupt the table of what finished is written and the interrupt
    re-raised."""
    if folder is None:
        with RunFolder(out_dir, overwrite=overwrite) as owned:
            return run_sweep(exp, out_dir, jobs, progress, log, seeds, ray, retries, folder=owned, max_runs=max_runs)
    import pandas as pd  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    log = log or (lambda msg: print(msg, file=sys.stderr))
    if not exp.sweep:
        raise ValueError("sweep: the config has no `sweep:` grid (use `servetwin run` for a single run)")
    seeds = seeds_for(exp) if seeds is None else seeds
    # counts points x seeds before expanding (refused past max_runs), then validates the whole grid
    points = expand_sweep(exp, max_runs=max_runs, seeds=len(seeds), log=log)
    from servetwin.experiments.run.report import portable_config  # noqa: PLC0415

    folder.write_text("config.yaml", yaml.safe_dump(portable_config(exp.to_dict(), out_dir), sort_keys=False))
    tasks = []
    for p in points:
        for seed in seeds or [None]:
            key = p.name if seed is None else f"{p.name}/seed={seed}"
            raw = with_seed(p.raw, seed) if seed is not None else p.raw
            tasks.append(PointTask(key, raw, exp.base_dir, "all", os.path.join(out_dir, key),
                                   meta={"point": p, "seed": seed}))
    folder.own(*(os.path.join(t.key, "run.log") for t in tasks))  # the workers write them, a point may fail first
    pool = make_pool(jobs if ray is None else 1, ray)
    all_backends = list(dict.fromkeys(b for p in points for b in _point_backends(p, exp)))
    log(f"sweep {exp.name}: {len(points)} points" + (f" x {len(seeds)} seeds" if seeds else "")
        + f" x {all_backends} on {pool.description}")
    results, interrupted = _map_points(pool, tasks, retries, log,
                                       (f"sweep {exp.name}", "point") if progress else None)
    rows = []
    for t in tasks:
        result = results.get(t.key, PointResult("not run"))
        rows.extend(result_rows(t.meta["point"].name, t.meta["point"].assignments, t.meta["seed"], result,
                                _point_backends(t.meta["point"], exp), t.key))
    per_seed = pd.DataFrame(rows)
    if seeds:
        folder.write_with("sweep_seeds.csv", lambda tmp: per_seed.to_csv(tmp, index=False))
        df = aggregate_seeds(per_seed, list(exp.sweep))
    else:
        df = per_seed
    plot = None
    if exp.output.plots:
        from servetwin.experiments.run.plots import context_for, sweep_comparison  # noqa: PLC0415
        plot = sweep_comparison(df, os.path.join(out_dir, "sweep_comparison.png"), context_for(exp),
                                keys=list(exp.sweep))
        if plot:
            folder.record(os.path.basename(plot))
    ran = list(results.values())
    for line in host_summary(ran):
        log(f"ran on {line}")
    folder.record(os.path.basename(write_sweep_md(exp, df, out_dir, plot, interrupted, seeds=seeds,
                                                  hosts=host_summary(ran), pool=pool.description)))
    folder.write_with("sweep.csv", lambda tmp: df.to_csv(tmp, index=False))  # last: the sweep's table of record
    if interrupted:
        raise KeyboardInterrupt
    return df


def _cell(r, col: str, seeded: bool) -> Any:
    v = r[col] if col in r else None
    if not seeded or f"{col}_ci_hi" not in r:
        return v
    lo, hi = r[f"{col}_ci_lo"], r[f"{col}_ci_hi"]
    if v is None or lo is None or hi is None or any(isinstance(x, float) and math.isnan(x) for x in (v, lo, hi)):
        return v
    from servetwin.experiments.common.md_tables import fmt_pm  # noqa: PLC0415

    return fmt_pm(float(v), float(lo), float(hi))


def bound_by_line(df) -> str:
    """The sweep's binding resources (`bound_by`, experiments/run/binding.py); when every point is bound by
    the arrival rate, say that their throughputs cannot differ."""
    from servetwin.experiments.run.binding import LABELS  # noqa: PLC0415

    kinds = [k for k in (df["bound_by"] if "bound_by" in df else []) if isinstance(k, str)]
    if not kinds:
        return "No point finished: nothing to say."
    if set(kinds) == {"arrival_rate"}:
        return ("Every point is bound by the arrival rate: each keeps up with the offered load, so their "
                "throughputs are that rate and cannot differ (a difference in the table is the workload's "
                "tail, not the configuration); compare latencies, or raise the rate (`servetwin capacity`).")
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    return "Bound by: " + ", ".join(f"{LABELS[k]} at {n} of {len(kinds)} points" for k, n in counts.items()) + \
        " (column `bound_by`; each point's report.md says why)."


def write_sweep_md(exp: ExperimentConfig, df, out_dir: str, plot: Optional[str], interrupted: bool,
                   seeds: Optional[list[int]] = None, hosts: Optional[list[str]] = None,
                   pool: Optional[str] = None) -> str:
    from servetwin.experiments.run.report import md_table  # noqa: PLC0415

    keys = list(exp.sweep)
    seeded = bool(seeds)
    lines = [f"# Sweep {exp.name}", ""]
    if exp.description:
        lines += [exp.description.strip(), ""]
    if interrupted:
        lines += ["**Interrupted (Ctrl-C): points marked 'interrupted' or 'not run' are incomplete.**", ""]
    lines += ["Swept: " + ", ".join(f"`{k}` in `{json.dumps(exp.sweep[k])}`" for k in keys) + "; backends: "
              + ", ".join(dict.fromkeys(df.backend)) + ".", ""]
    if seeded:
        lines += [f"Seeds: {', '.join(map(str, seeds))} (each a new workload draw). Cells show the mean over "
                  "the seeds ± the half-width of its 95% t interval; `sweep_seeds.csv` has every seed's row.", ""]
    rows = lambda cols: [[_cell(r, c, seeded) for c in cols] for _, r in df.iterrows()]  # noqa: E731
    cols = ["point"] + keys + ["backend"] + MD_COLUMNS + (["seeds_ok"] if seeded else [])
    lines += ["## Results", "", md_table(cols, rows(cols)), ""]
    lines += ["## What limits the results", "", bound_by_line(df), ""]
    lines += ["## Latency (s)", "", md_table(["point", "backend"] + LATENCY_MD_COLUMNS,
                                            rows(["point", "backend"] + LATENCY_MD_COLUMNS)), ""]
    if exp.slo is not None and not exp.slo.empty:
        spec = ", ".join(f"`{k}` {v:g}" for k, v in exp.slo.to_dict().items())
        lines += ["## SLO", "", f"SLO: {spec}. `slo_met`: " + ("the share of seeds meeting it" if seeded
                  else "whether the run meets it") + "; attainment: the share of requests meeting every "
                  "per-request deadline; goodput: those requests per second.", "",
                  md_table(["point", "backend"] + SLO_MD_COLUMNS, rows(["point", "backend"] + SLO_MD_COLUMNS)), ""]
    ok = df[df.status == "ok"]
    if len(ok) > 1:
        lines += ["## Relative to the first point", ""]
        for backend in dict.fromkeys(ok.backend):
            sub = ok[ok.backend == backend]
            ref = sub.iloc[0]
            table = []
            for _, r in sub.iterrows():
                def ratio(col: str) -> Optional[float]:
                    a, b = r[col], ref[col]
                    return float(a) / float(b) if a is not None and b not in (None, 0) and a == a and b == b else None
                table.append([r.point, ratio("duration_s"), ratio("throughput_tok_s"), ratio("ttft_p50_s"),
                              ratio("e2e_p90_s"), ratio("prefill_tokens_computed")])
            lines += [f"**{backend}** (reference: `{ref.point}`)", "",
                      md_table(["point", "makespan", "throughput", "TTFT p50", "E2E p90", "prefill tokens"], table),
                      ""]
    errors = df[df.status == "error"]
    if len(errors):
        lines += ["## Errors", ""] + [f"- `{r.point}` ({r.backend}): {r.error}" for _, r in errors.iterrows()] + [""]
    if hosts:
        lines += ["## Where the points ran", "", f"Pool: {pool}." if pool else ""] + [f"- {h}" for h in hosts] + [""]
    if plot:
        lines += ["## Comparison", "", f"![sweep]({os.path.basename(plot)})", ""]
    lines += ["## Points", ""] + [f"- [{p}]({p}/report.md)" if not seeded else
                                  f"- {p}: " + ", ".join(f"[seed {s}]({p}/seed={s}/report.md)" for s in seeds)
                                  for p in dict.fromkeys(df.point)]
    path = os.path.join(out_dir, "sweep.md")
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


# -- one config, several seeds (`servetwin run --seeds N`) ------------------------------------------
def run_seeded(exp: ExperimentConfig, out_dir: str, seeds: list[int], jobs: int = 1, progress: bool = True,
               log: Optional[Callable[[str], None]] = None, ray: Any = None, retries: int = 0,
               overwrite: bool = False, folder: Optional[RunFolder] = None):
    """One run folder per seed (DIR/seed=S/), then DIR/seeds.csv (one row per seed and backend),
    DIR/seeds.md and DIR/summary.json, last (per backend, every summary metric's mean, std and 95% t
    interval over the seeds). The folder follows `servetwin.experiments.run.run_folder`. Returns the
    per-seed table."""
    if folder is None:
        with RunFolder(out_dir, overwrite=overwrite) as owned:
            return run_seeded(exp, out_dir, seeds, jobs, progress, log, ray, retries, folder=owned)
    import pandas as pd  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    from servetwin.experiments.run.report import portable_config  # noqa: PLC0415
    from servetwin.experiments.common.stats import mean_ci  # noqa: PLC0415

    log = log or (lambda msg: print(msg, file=sys.stderr))
    folder.write_text("config.yaml", yaml.safe_dump(portable_config(exp.to_dict(), out_dir), sort_keys=False))
    base = exp.to_dict()
    base.pop("sweep", None)
    tasks = [PointTask(f"seed={s}", with_seed(base, s), exp.base_dir, "all", os.path.join(out_dir, f"seed={s}"),
                       meta={"seed": s}) for s in seeds]
    folder.own(*(os.path.join(t.key, "run.log") for t in tasks))
    pool = make_pool(jobs if ray is None else 1, ray)
    log(f"run {exp.name}: {len(seeds)} seeds x {exp.backends} on {pool.description}")
    results, interrupted = _map_points(pool, tasks, retries, log,
                                       (f"{exp.name} seeds", "run") if progress else None)
    rows = []
    for t in tasks:
        rows.extend(result_rows("run", {}, t.meta["seed"], results.get(t.key, PointResult("not run")),
                                exp.backends, t.key))
    df = pd.DataFrame(rows)
    folder.write_with("seeds.csv", lambda tmp: df.to_csv(tmp, index=False))
    stats: dict[str, dict[str, Any]] = {}
    for backend in exp.backends:
        ok = df[(df.backend == backend) & (df.status == "ok")]
        stats[backend] = {col: mean_ci([float(v) for v in ok[col] if isinstance(v, (bool, int, float))])
                          for col, _ in METRICS if col not in NON_NUMERIC}
        stats[backend]["seeds_ok"] = int(len(ok))
    folder.record(os.path.basename(_write_seeds_md(exp, seeds, stats, df, out_dir, interrupted)))
    folder.write_json("summary.json",  # last: its presence and "interrupted" are the truth
                      {"name": exp.name, "interrupted": interrupted, "seeds": seeds, "level": 0.95,
                       "backends": stats,
                       "runs": {t.key: (results[t.key].summary if t.key in results else None) for t in tasks}})
    if interrupted:
        raise KeyboardInterrupt
    return df, stats


def _write_seeds_md(exp: ExperimentConfig, seeds: list[int], stats: dict, df, out_dir: str,
                    interrupted: bool) -> str:
    from servetwin.experiments.common.md_tables import fmt, fmt_pm, md_table  # noqa: PLC0415

    backends = list(stats)
    lines = [f"# {exp.name}: {len(seeds)} seeds", ""]
    if interrupted:
        lines += ["**Interrupted (Ctrl-C): the statistics cover the seeds that finished.**", ""]
    lines += [f"Seeds {', '.join(map(str, seeds))}, each a new workload draw (and engine seed); every cell is the "
              "mean over the seeds that ran ok, ± the half-width of its 95% t interval, [min, max].", ""]
    table = []
    for col, _ in METRICS:
        if col in NON_NUMERIC:
            continue
        cells = []
        for b in backends:
            s = stats[b][col]
            if s["mean"] is None:
                cells.append("-")
            elif s["ci_lo"] is None:
                cells.append(fmt(s["mean"]))
            else:
                cells.append(f"{fmt_pm(s['mean'], s['ci_lo'], s['ci_hi'])} [{fmt(s['min'])}, {fmt(s['max'])}]")
        if any(c != "-" for c in cells):
            table.append([col] + cells)
    lines += ["## Summary over seeds", "", md_table(["metric"] + backends, table), "",
              "## Runs", ""] + [f"- [seed {s}](seed={s}/report.md): " + ", ".join(
                  f"{r.backend} {r.status}" for _, r in df[df.seed == s].iterrows()) for s in seeds]
    path = os.path.join(out_dir, "seeds.md")
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
