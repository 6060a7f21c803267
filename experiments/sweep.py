"""`servetwin sweep`: the grid in `sweep:`, one run per point (in parallel spawn workers), one table.

    DIR/<point>/...        each point's run (the `servetwin run` layout), named by its values
    DIR/sweep.csv          one row per (point, backend): swept values, status, key metrics
    DIR/sweep.md           the table, ratios to the first point, links to the points' reports
    DIR/sweep_comparison.png
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Callable, Optional

from servetwin.experiments.schema import ExperimentConfig, SweepPoint, expand_sweep, validate_config

METRICS = [
    ("requests", ("requests",)), ("completed", ("completed",)), ("num_steps", ("num_steps",)),
    ("duration_s", ("duration_s",)), ("wall_s", ("wall_s",)), ("throughput_tok_s", ("throughput_tok_s",)),
    ("output_tok_s", ("output_tok_s",)), ("request_throughput_s", ("request_throughput_s",)),
    ("ttft_mean_s", ("ttft_s", "mean")), ("ttft_p50_s", ("ttft_s", "p50")), ("ttft_p90_s", ("ttft_s", "p90")),
    ("ttft_p99_s", ("ttft_s", "p99")), ("tpot_p50_s", ("tpot_s", "p50")), ("tpot_p90_s", ("tpot_s", "p90")),
    ("itl_p50_s", ("itl_s", "p50")), ("e2e_p50_s", ("e2e_s", "p50")), ("e2e_p90_s", ("e2e_s", "p90")),
    ("preemptions", ("preemptions",)), ("prefix_hit_rate", ("prefix_hit_rate",)),
    ("prompt_tokens", ("prompt_tokens",)), ("prefill_tokens_computed", ("prefill_tokens_computed",)),
    ("prefill_saving_x", ("prefill_saving_x",)), ("num_gpu_blocks", ("num_gpu_blocks",)),
    ("max_model_len", ("max_model_len",)), ("kv_peak_usage", ("kv_peak_usage",)),
]
MD_COLUMNS = ["status", "completed", "duration_s", "throughput_tok_s", "output_tok_s", "ttft_p50_s", "ttft_p90_s",
              "tpot_p50_s", "e2e_p90_s", "preemptions", "prefix_hit_rate", "prefill_tokens_computed"]

_interrupted_once = False
_stop_event = None  # set by the parent after Ctrl-C: queued points are skipped, not started


def _worker_init(stop_event=None) -> None:
    global _stop_event
    _stop_event = stop_event
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # idle workers ignore Ctrl-C; a running point handles it


def _sigint_once(signum, frame) -> None:
    global _interrupted_once
    if _interrupted_once:
        return  # the terminal and the parent may both forward Ctrl-C: stop once, then finish writing
    _interrupted_once = True
    raise KeyboardInterrupt


def run_point(raw: dict[str, Any], base_dir: str, out_dir: str, in_worker: bool = False,
              config: Optional[ExperimentConfig] = None) -> dict[str, Any]:
    """Run one sweep point; never raises (except KeyboardInterrupt in-process): returns status + summary."""
    global _interrupted_once
    from servetwin.experiments.runner import run_experiment  # noqa: PLC0415

    if in_worker:
        if _stop_event is not None and _stop_event.is_set():
            return {"status": "not run", "wall_s": 0.0}
        _interrupted_once = False
        signal.signal(signal.SIGINT, _sigint_once)
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(out_dir, "run.log")
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as logf:
            def log(msg: str) -> None:
                logf.write(msg + "\n")
                logf.flush()
            exp = config if config is not None else validate_config(raw, base_dir, raw.get("name", "point"))
            combined = run_experiment(exp, out_dir, progress=False, log=log)
        return {"status": "ok", "summary": combined, "wall_s": time.perf_counter() - t0}
    except KeyboardInterrupt:
        summary = None
        path = os.path.join(out_dir, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                summary = json.load(f)
        if not in_worker:
            raise
        return {"status": "interrupted", "summary": summary, "wall_s": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001  (a failing point must not lose the others)
        return {"status": "error", "error": f"{type(e).__name__}: {e}", "wall_s": time.perf_counter() - t0}
    finally:
        if in_worker:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _value(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v)


def _point_backends(point: SweepPoint, exp: ExperimentConfig) -> list[str]:
    """The backends one point runs: the config's, unless `backends` itself is swept."""
    backends = point.raw.get("backends", exp.backends)
    return [backends] if isinstance(backends, str) else list(backends)


def _rows(point: SweepPoint, result: dict[str, Any], backends: list[str], out_dir: str) -> list[dict]:
    rows = []
    summaries = (result.get("summary") or {}).get("backends", {})
    for backend in backends:
        row: dict[str, Any] = {"point": point.name}
        row.update({k: _value(v) for k, v in point.assignments.items()})
        row["backend"] = backend
        s = summaries.get(backend)
        status = result["status"]
        if s is None and status == "ok":
            status = "not run"
        elif s is not None and s.get("interrupted"):
            status = "interrupted"
        elif s is None and status == "interrupted":
            status = "not run"
        row["status"] = status
        for col, path in METRICS:
            v: Any = s
            for p in path:
                v = v.get(p) if isinstance(v, dict) else None
            row[col] = v
        row["error"] = result.get("error")
        row["dir"] = os.path.relpath(os.path.join(out_dir, point.name), out_dir)
        rows.append(row)
    return rows


def run_sweep(exp: ExperimentConfig, out_dir: str, jobs: int = 1, progress: bool = True,
              log: Optional[Callable[[str], None]] = None):
    """Run every point; write sweep.csv / sweep.md / sweep_comparison.png; returns the table (DataFrame).
    On KeyboardInterrupt the table of what finished is written and the interrupt re-raised."""
    import pandas as pd  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    log = log or (lambda msg: print(msg, file=sys.stderr))
    if not exp.sweep:
        raise ValueError("sweep: the config has no `sweep:` grid (use `servetwin run` for a single run)")
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs: must be an integer >= 1, got {jobs!r}")
    points = expand_sweep(exp)  # validates the whole grid before anything runs
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(exp.to_dict(), f, sort_keys=False)
    all_backends = list(dict.fromkeys(b for p in points for b in _point_backends(p, exp)))
    log(f"sweep {exp.name}: {len(points)} points x {all_backends}, {min(jobs, len(points))} worker(s)")
    results: dict[str, dict] = {}
    interrupted = False
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415
        bar = tqdm(total=len(points), desc=f"sweep {exp.name}", unit="point", file=sys.stderr)

    def done(point: SweepPoint, result: dict) -> None:
        results[point.name] = result
        if bar is not None:
            bar.update(1)
        msg = f"  {point.name}: {result['status']} ({result.get('wall_s', 0):.1f}s)"
        if result.get("error"):
            msg += f" - {result['error']}"
        log(msg)

    try:
        if jobs == 1 or len(points) == 1:
            for point in points:
                try:
                    done(point, run_point(point.raw, exp.base_dir, os.path.join(out_dir, point.name),
                                         config=point.config))
                except KeyboardInterrupt:
                    path = os.path.join(out_dir, point.name, "summary.json")
                    summary = json.load(open(path)) if os.path.exists(path) else None
                    done(point, {"status": "interrupted", "summary": summary})
                    raise
        else:
            ctx = multiprocessing.get_context("spawn")
            stop = ctx.Event()
            ex = ProcessPoolExecutor(max_workers=min(jobs, len(points)), mp_context=ctx, initializer=_worker_init,
                                     initargs=(stop,))
            futures = {ex.submit(run_point, p.raw, exp.base_dir, os.path.join(out_dir, p.name), True, p.config): p
                       for p in points}
            try:
                pending = set(futures)
                while pending:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        point = futures[fut]
                        try:
                            done(point, fut.result())
                        except Exception as e:  # noqa: BLE001  (a crashed worker)
                            done(point, {"status": "error", "error": f"{type(e).__name__}: {e}"})
            except KeyboardInterrupt:
                stop.set()
                for fut in futures:
                    fut.cancel()
                for proc in list(getattr(ex, "_processes", {}).values()):
                    try:  # running points stop and write what they have (idle workers ignore it)
                        os.kill(proc.pid, signal.SIGINT)
                    except (ProcessLookupError, OSError):
                        pass
                for fut, point in futures.items():
                    if fut.cancelled() or point.name in results:
                        continue
                    try:
                        done(point, fut.result(timeout=120))
                    except Exception as e:  # noqa: BLE001
                        done(point, {"status": "interrupted", "error": f"{type(e).__name__}: {e}"})
                raise
            finally:
                ex.shutdown(wait=True, cancel_futures=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if bar is not None:
            bar.close()
    rows = []
    for point in points:
        result = results.get(point.name, {"status": "not run"})
        rows.extend(_rows(point, result, _point_backends(point, exp), out_dir))
    df = pd.DataFrame(rows)
    df.to_csv(os.path.join(out_dir, "sweep.csv"), index=False)
    plot = None
    if exp.output.plots:
        from servetwin.experiments.plots import sweep_comparison  # noqa: PLC0415
        plot = sweep_comparison(df, os.path.join(out_dir, "sweep_comparison.png"))
    write_sweep_md(exp, df, out_dir, plot, interrupted)
    if interrupted:
        raise KeyboardInterrupt
    return df


def write_sweep_md(exp: ExperimentConfig, df, out_dir: str, plot: Optional[str], interrupted: bool) -> str:
    from servetwin.experiments.report import md_table  # noqa: PLC0415

    keys = list(exp.sweep)
    lines = [f"# Sweep {exp.name}", ""]
    if exp.description:
        lines += [exp.description.strip(), ""]
    if interrupted:
        lines += ["**Interrupted (Ctrl-C): points marked 'interrupted' or 'not run' are incomplete.**", ""]
    lines += ["Swept: " + ", ".join(f"`{k}` in `{json.dumps(exp.sweep[k])}`" for k in keys) + "; backends: "
              + ", ".join(dict.fromkeys(df.backend)) + ".", ""]
    cols = ["point"] + keys + ["backend"] + MD_COLUMNS
    lines += ["## Results", "", md_table(cols, df[cols].values.tolist()), ""]
    ok = df[df.status == "ok"]
    if len(ok) > 1:
        lines += ["## Relative to the first point", ""]
        for backend in dict.fromkeys(ok.backend):
            sub = ok[ok.backend == backend]
            ref = sub.iloc[0]
            rows = []
            for _, r in sub.iterrows():
                def ratio(col: str) -> Optional[float]:
                    a, b = r[col], ref[col]
                    return float(a) / float(b) if a is not None and b not in (None, 0) and a == a and b == b else None
                rows.append([r.point, ratio("duration_s"), ratio("throughput_tok_s"), ratio("ttft_p50_s"),
                             ratio("e2e_p90_s"), ratio("prefill_tokens_computed")])
            lines += [f"**{backend}** (reference: `{ref.point}`)", "",
                      md_table(["point", "makespan", "throughput", "TTFT p50", "E2E p90", "prefill tokens"], rows), ""]
    errors = df[df.status == "error"]
    if len(errors):
        lines += ["## Errors", ""] + [f"- `{r.point}` ({r.backend}): {r.error}" for _, r in errors.iterrows()] + [""]
    if plot:
        lines += ["## Comparison", "", f"![sweep]({os.path.basename(plot)})", ""]
    lines += ["## Points", ""] + [f"- [{p}]({p}/report.md)" for p in dict.fromkeys(df.point)]
    path = os.path.join(out_dir, "sweep.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
