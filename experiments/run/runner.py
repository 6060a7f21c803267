"""`servetwin run`: one experiment config through its backends, then tables, summary, report and plots.

Layout under the output folder DIR:

    DIR/config.yaml                 the validated config (paths resolved)
    DIR/summary.json                {"name", "interrupted", "workload", "backends": {backend: summary}}
    DIR/report.md                   config, summary table, observations, plots
    DIR/latency_cdf.png, timeline.png, step_time.png
    DIR/<backend>/steps.parquet, step_requests.parquet, requests.parquet, trace.json, summary.json

Backend "sim" runs `servetwin.sim.engine.Simulation` (simulated time; the KV pool is sized by
`servetwin.core.engine.engine_factory` -> `servetwin.sim.kv_pool`); backend "torch" runs `servetwin.core.testbed.realtime.run_realtime` over the
`TorchExecutor` (wall-clock time), after a warm-up that is not recorded, with the thread count and the
per-step contention check of `servetwin.experiments.calibrate.torch_measure` (in its summary as `measurement`).
Both get the same request list. Ctrl-C stops the current backend,
writes what it recorded (summary marked `"interrupted": true`) and skips the remaining backends.
Every file is renamed into place complete and DIR/summary.json is written last (`run_folder`): a folder
without it is incomplete, whatever stopped the run.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from servetwin import compiled_modules
from servetwin.core.config_error import ConfigError, ModelNotFoundError
from servetwin.core.testbed.atomic import atomic_open, atomic_write_text
from servetwin.experiments.run.run_folder import RunFolder
from servetwin.experiments.config.schema import ExperimentConfig, engine_field_path
from servetwin.experiments.calibrate.torch_measure import MeasureOptions, contention_warning
from servetwin.experiments.config.workloads import build_requests, conversation_summary, workload_summary

LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
# the engine-boundary figures next to the client-boundary `ttft_s` ... (equal without a front end)
ENGINE_LATENCY_KEYS = ("engine_ttft_s", "engine_tpot_s", "engine_itl_s", "engine_e2e_s", "frontend_in_s")


@dataclass
class BackendRun:
    backend: str
    recorder: Any
    info: Any
    wall_s: float
    simulated_s: Optional[float]
    num_requests: int
    completed: int
    rejected: dict[str, str] = field(default_factory=dict)
    interrupted: bool = False
    error: Optional[str] = None
    frontend: dict[str, Any] = field(default_factory=lambda: {"type": "offline"})
    itls: Optional[np.ndarray] = None  # the recorder's itl_array(), computed once
    measurement: Optional[dict[str, Any]] = None  # torch: threads, warm-up, contention check
    kv_pool: Optional[dict[str, Any]] = None  # the executor's KV pool sizing (`kv_pool_dict`)
    answers: Optional[list[dict[str, Any]]] = None  # torch with text prompts: each request's decoded answer

    def portable(self) -> "BackendRun":
        """This run without its executor (the engine, torch weights): what the output process needs,
        picklable."""
        return dataclasses.replace(self, info=dataclasses.replace(self.info, executor=None),
                                   recorder=self.recorder.packed())


def _progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)


def create_engine(exp: ExperimentConfig, backend: str):
    """(EngineCore, ExecutorInfo) of one backend; a bad field raises `ConfigError` naming its YAML path."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415

    try:
        try:
            return create_engine_core(exp.engine_args(backend))
        except ModelNotFoundError as missing:
            raise missing.as_config_error() from None
    except ConfigError as e:
        e = engine_field_path(e)
        raise ConfigError(e.path, f"{e.message} [{backend} backend]") from None


class _Progress:
    """Counts finished (completed or rejected) workload requests on a progress bar."""

    def __init__(self, bar) -> None:
        self.bar = bar
        self.completed = 0

    def on_complete(self, request_id: str, t: float) -> None:
        self.completed += 1
        if self.bar is not None:
            self.bar.update(1)

    def on_reject(self, request_id: str, reason: str) -> None:
        if self.bar is not None:
            self.bar.update(1)


def _run_sim(exp: ExperimentConfig, engine, info, requests, arrival, rng, bar) -> BackendRun:
    from servetwin.sim.engine import Simulation  # noqa: PLC0415

    progress = _Progress(bar)
    frontend = exp.frontend.resolved(exp.hardware_spec.device_type)
    sim = Simulation(engine, requests, arrival, rng=rng, run=exp.name, record_step_requests=exp.output.step_requests,
                     frontend=frontend, on_complete=progress.on_complete, on_reject=progress.on_reject)
    t0 = time.perf_counter()
    interrupted = False
    try:
        sim.run()
    except KeyboardInterrupt:
        interrupted = True
    wall = time.perf_counter() - t0
    end = float(sim.env.now) if interrupted else sim.result.end_time_s
    fe = (sim.frontend.summary(end) if sim.frontend is not None else frontend.describe())
    return BackendRun("sim", sim.recorder, info, wall, end, len(requests),
                      len(sim.result.completion_s), dict(sim.result.rejected), interrupted, frontend=fe)


def _run_torch(exp: ExperimentConfig, info, requests, arrival, bar, opts: MeasureOptions, nthreads: int,
               log: Callable[[str], None]) -> BackendRun:
    """A warm-up (not recorded), then the measured run on a fresh engine over the same executor, run
    again when contended if `opts.retry_contended` (`servetwin.experiments.calibrate.torch_measure`)."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.core.testbed.realtime import run_realtime  # noqa: PLC0415
    from servetwin.core.testbed.trace import TraceRecorder  # noqa: PLC0415
    from servetwin.experiments.calibrate.calibrate import calibration_mismatches  # noqa: PLC0415
    from servetwin.experiments.calibrate.torch_measure import contention_summary, measure, warm_up  # noqa: PLC0415
    from servetwin.sim.arrivals import Offline  # noqa: PLC0415

    args = exp.engine_args("torch")
    mismatches = calibration_mismatches(exp, info.executor, nthreads) if "sim" in exp.backends else []
    for note in mismatches:  # the sim's step costs are then not this machine's
        log(f"warning: [torch] {note}")
    warm_s = warm_up(args, info, requests) if opts.warmup else None
    if warm_s is not None:
        log(f"[torch] warm-up: {min(4, len(requests))} requests in {warm_s:.2f}s (not recorded)")

    def once(cpu_s: dict[int, float]):
        info.executor.reset()
        engine, _ = create_engine_core(args, info=info)
        recorder = TraceRecorder(exp.name, "torch", record_step_requests=exp.output.step_requests)
        rejected: dict[str, str] = {}
        done: list[str] = []
        outputs: dict[str, list[int]] = {}
        if bar is not None:
            bar.reset()
        t0 = time.perf_counter()
        interrupted = False
        try:
            run_realtime(engine, [dataclasses.replace(r) for r in requests], recorder,
                         offline=isinstance(arrival, Offline), progress=bar, seed=exp.seed, rejected=rejected,
                         on_complete=lambda rid, t: done.append(rid), outputs=outputs)
        except KeyboardInterrupt:
            interrupted = True
        wall = time.perf_counter() - t0
        steps = recorder.steps.to_frame()  # the full frames are built once, later
        return (recorder, rejected, done, interrupted, outputs), steps, wall

    measured = measure(once, info.executor, nthreads, retry_contended=opts.retry_contended,
                       max_contended_share=opts.max_contended_share, log=log, label="[torch] measured run",
                       stop=lambda result: result[3])
    run = measured.kept[-1]
    recorder, rejected, done, interrupted, outputs = run.result
    answers = _answers(exp, info.executor, outputs) if exp.workload.prompts is not None else None
    close = getattr(info.executor, "close", None)
    if callable(close):
        close()
    # run_realtime drives the engine in-process: no front end is in the measured path
    fe = dict(exp.frontend.describe(), modelled=False, note="torch runs are measured at the engine "
              "(in-process, no HTTP front end): client = engine boundary")
    measurement = {"torch_threads": nthreads, "warmup_s": warm_s, "contention": contention_summary(run.cpu_share),
                   "retry_contended": {"retries": opts.retry_contended,
                                       "max_contended_share": opts.max_contended_share},
                   "discarded_runs": measured.discarded, "calibration_mismatches": mismatches}
    return BackendRun("torch", recorder, info, run.wall_s, None, len(requests), len(done), rejected, interrupted,
                      frontend=fe, measurement=measurement, answers=answers)


def _answers(exp: ExperimentConfig, executor: Any, outputs: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Each text prompt with the real model's answer (greedy, up to its first EOS: requests run to
    max_tokens with ignore_eos so both backends schedule the same steps)."""
    from servetwin.experiments.config.prompt_file import answer_text  # noqa: PLC0415

    tok = executor.tokenizer
    eos = list(getattr(executor, "eos_token_ids", None) or [tok.eos_token_id])
    rows = []
    for rec in exp.workload.prompts:
        ids = outputs.get(rec.id, [])
        text, ended = answer_text(tok, ids, eos)
        rows.append({"id": rec.id, "prompt": rec.text_for_report(), "answer": text, "ended_by_eos": ended,
                     "output_tokens": len(ids)})
    return rows


# -- summaries ----------------------------------------------------------------------------------
def _clean(values) -> np.ndarray:
    """The finite values (`values` itself when all are: an ITL array may hold 20M)."""
    arr = np.asarray(values, dtype=float)  # None (an object column's missing value) becomes nan
    finite = np.isfinite(arr)
    return arr if finite.all() else arr[finite]


def dist_stats(values, scratch: bool = False) -> dict[str, Optional[float]]:
    """Mean, p50/p90/p99 and count of the finite values. `scratch`: `values` (a float array) is not
    used afterwards, so the percentiles may reorder it instead of a copy (the same figures)."""
    arr = _clean(values)
    if arr.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "count": 0}
    mean = float(arr.mean())  # (before the percentiles: with `scratch` they reorder arr)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99], overwrite_input=scratch)
    return {"mean": mean, "p50": float(p50), "p90": float(p90), "p99": float(p99), "count": int(arr.size)}


def _nz(x: float) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else float(x)


# the steps table's columns `summarize` reads (a caller may hand it a table of these alone: `TraceRecorder.frames`)
SUMMARY_STEP_COLUMNS = ("t_end_s", "duration_s", "num_context_tokens", "total_tokens", "annotation", "num_running",
                        "num_waiting", "kv_free_blocks", "kv_usage", "prefix_queries", "prefix_hits")


def summarize(run: BackendRun, frames: dict, exp: ExperimentConfig,
              itls: Optional[np.ndarray] = None, engine_itls: Optional[np.ndarray] = None,
              itls_read_after: bool = True) -> dict[str, Any]:
    """The summary of one backend's run; `itls` / `engine_itls` are `run.recorder.itl_array()` /
    `engine_itl_array()` when the caller has them. `itls_read_after=False`: the caller reads `itls` no
    more, so their percentiles may reorder them instead of a copy (~20M gaps at 100,000 requests)."""
    if itls is None:
        itls = run.recorder.itl_array()
    slo = exp.slo is not None and not exp.slo.empty
    itl_stats = dist_stats(itls, scratch=not (itls_read_after or slo))
    if engine_itls is None and run.recorder.delivery is None:  # the client's gaps: computed once
        engine_itls = itls
    if engine_itls is itls:
        engine_itl_stats = itl_stats
    elif engine_itls is not None:
        engine_itl_stats = dist_stats(engine_itls)
    else:  # made here (after the client's stats: one array of ~20M gaps less at a time for 100k requests)
        engine_itls = run.recorder.engine_itl_array()
        engine_itl_stats = dist_stats(engine_itls, scratch=not slo)
        if not slo:  # (the SLO check reads them again)
            engine_itls = None
    steps, reqs = frames["steps"], frames["requests"]
    finished = reqs[reqs.finish_reason.notna() & (reqs.finish_reason != "abort")]
    engine_duration = float(steps.t_end_s.max()) if len(steps) else 0.0
    client_end = reqs.client_finish_s.max() if len(reqs) else None
    # the benchmark's duration ends when the client got the last chunk (the engine's last step, when
    # no front end is modelled)
    duration = max(engine_duration, float(client_end)) if client_end == client_end and client_end is not None \
        else engine_duration
    prompt_done = int(finished.prompt_tokens.sum())
    output_done = int(finished.output_tokens.sum())
    queries = int(steps.prefix_queries.sum()) if len(steps) else 0
    hits = int(steps.prefix_hits.sum()) if len(steps) else 0
    prefill = int(steps.num_context_tokens.sum()) if len(steps) else 0
    prompt_total = int(reqs.prompt_tokens.sum()) if len(reqs) else 0

    def per_s(x: float) -> Optional[float]:
        return x / duration if duration > 0 else None

    info = run.info
    kv_pool = run.kv_pool if run.kv_pool is not None else kv_pool_dict(info)
    out: dict[str, Any] = {
        "run": exp.name, "backend": run.backend, "interrupted": run.interrupted,
        "requests": run.num_requests, "sequences": int(len(reqs)), "completed": run.completed,
        "completed_sequences": int(len(finished)), "rejected": len(run.rejected),
        "aborted_sequences": int((reqs.finish_reason == "abort").sum()) if len(reqs) else 0,
        "wall_s": run.wall_s, "simulated_s": run.simulated_s, "duration_s": duration,
        "sim_speedup_x": (run.simulated_s / run.wall_s) if run.simulated_s and run.wall_s > 0 else None,
        "num_steps": int(len(steps)),
        "throughput_tok_s": per_s(prompt_done + output_done),
        "output_tok_s": per_s(output_done),
        "computed_tok_s": per_s(float(steps.total_tokens.sum())) if len(steps) else None,
        "request_throughput_s": per_s(run.completed),
        "ttft_s": dist_stats(reqs.ttft_s), "tpot_s": dist_stats(reqs.tpot_s),
        "itl_s": itl_stats, "e2e_s": dist_stats(reqs.e2e_s),
        "queue_s": dist_stats(reqs.queue_s),
        "engine_duration_s": engine_duration,
        "engine_ttft_s": dist_stats(reqs.engine_ttft_s), "engine_tpot_s": dist_stats(reqs.engine_tpot_s),
        "engine_itl_s": engine_itl_stats, "engine_e2e_s": dist_stats(reqs.engine_e2e_s),
        "frontend_in_s": dist_stats(reqs.frontend_in_s),
        "frontend": run.frontend,
        "step_duration_s": dist_stats(steps.duration_s) if len(steps) else dist_stats([]),
        "preemptions": int(reqs.num_preemptions.sum()) if len(reqs) else 0,
        "prefix_queries": queries, "prefix_hits": hits,
        "prefix_hit_rate": (hits / queries) if queries else None,
        "prompt_tokens": prompt_total,
        "cached_tokens": int(reqs.cached_tokens.sum()) if len(reqs) else 0,
        "prefill_tokens_computed": prefill,
        "prefill_saving_x": (prompt_total / prefill) if prefill else None,
        "output_tokens": int(reqs.output_tokens.sum()) if len(reqs) else 0,
        "num_gpu_blocks": int(info.num_gpu_blocks), "block_size": int(exp.engine_args(run.backend).block_size),
        "max_model_len": int(info.max_model_len),
        "kv_peak_usage": _nz(float(steps.kv_usage.max())) if len(steps) else None,
        "kv_min_free_blocks": int(steps.kv_free_blocks.min()) if len(steps) else None,
        "max_running": int(steps.num_running.max()) if len(steps) else 0,
        "max_waiting": int(steps.num_waiting.max()) if len(steps) else 0,
        "step0_annotation": str(steps.annotation.iloc[0]) if len(steps) else None,
        "kv_pool": kv_pool,
    }
    if slo:
        from servetwin.experiments.config.slo import evaluate_slo  # noqa: PLC0415

        out["slo"] = evaluate_slo(exp.slo, reqs, itls, duration, engine_itls)
        out["goodput_req_s"] = out["slo"]["goodput_req_s"]
    from servetwin.experiments.run.binding import binding_resource, offered_rate  # noqa: PLC0415
    from servetwin.experiments.run.steady_state import steady_state  # noqa: PLC0415

    out["steady_state"] = steady_state(reqs, out["step_duration_s"].get("p50"))
    # (an engine among several of a cluster: offered what the router sent it; a cluster's only engine is offered
    # the workload's rate, as the single-engine run of the same config)
    routed = exp.cluster is not None and sum(i.count * i.data_parallel_size for i in exp.cluster.instances) > 1
    out["binding"] = binding_resource(out, offered_rate(exp, reqs, routed=routed), out["steady_state"])
    conversations = conversation_summary(reqs)
    if conversations is not None:  # multi-turn workloads: the history's share found in the prefix cache
        out["conversations"] = conversations
    if run.measurement is not None:
        out["measurement"] = run.measurement
    if run.rejected:
        out["rejected_examples"] = dict(list(run.rejected.items())[:5])
    if run.error:
        out["error"] = run.error
    return out


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def write_json(path: str, data: Any) -> None:
    """JSON under a temporary name, renamed into place when complete (never a truncated file)."""
    with atomic_open(path) as f:
        json.dump(data, f, indent=2, default=_json_default)


def kv_pool_dict(info: Any) -> Optional[dict]:
    pool = getattr(info.executor, "kv_pool", None)
    return pool.to_dict() if pool is not None and hasattr(pool, "to_dict") else None


def backend_line(backend: str, s: dict, interrupted: bool) -> str:
    from servetwin.experiments.common.units import format_seconds  # noqa: PLC0415

    timing = (f"{format_seconds(s['simulated_s'])} simulated in {format_seconds(s['wall_s'])} wall"
              if backend == "sim" else f"{format_seconds(s['wall_s'])} wall")
    compiled = compiled_modules()
    if backend == "sim" and compiled:  # the optional mypyc build (scripts/build_compiled.py) ran it
        timing += f" ({len(compiled)} modules compiled)"
    return (f"[{backend}] {s['completed']}/{s['requests']} requests, {s['num_steps']} steps, {timing}"
            + (" (INTERRUPTED)" if interrupted else ""))


# -- the run ------------------------------------------------------------------------------------
LARGE_RUN_REQUESTS = 100_000  # runs this large log their workload and output phases (each can take a minute)


def run_backends(exp: ExperimentConfig, progress: bool = True, log: Optional[Callable[[str], None]] = None,
                 on_backend: Optional[Callable[[str, BackendRun, dict, dict], None]] = None,
                 measure: Optional[MeasureOptions] = None, timings: Optional[dict] = None,
                 defer: bool = False):
    """Run every backend of `exp` in memory: (combined summary, frames per backend, runs per backend).

    No file is written here; `on_backend(backend, run, frames, summary)` is called as each backend
    finishes (run_experiment writes its tables there). Ctrl-C stops the current backend, skips the
    rest and returns with `combined["interrupted"]` set. `measure`: how the torch backend is measured
    (threads, warm-up, contended-run retries; default `MeasureOptions()`). `timings["sim_end"]` is set
    to the `time.perf_counter()` at which each backend's run returned (the last one's stays: where the
    output phase starts). `defer`: build no tables or summaries here (`write_outputs` does, in the
    prewarmed output process): the frames and `combined["backends"]` come back empty."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if exp.cluster is not None:  # (never one engine of it silently)
        raise ConfigError("cluster", "a cluster runs through `servetwin run` (experiments/run/cluster_run.py); "
                                     "this command simulates one engine: remove `cluster:` or use `servetwin run`")
    opts = measure or MeasureOptions()
    engines = {}
    nthreads = 0
    for backend in exp.backends:  # build every engine first: bad engine settings fail before any run
        if backend == "torch":
            from servetwin.experiments.calibrate.torch_measure import apply_threads  # noqa: PLC0415

            nthreads, source = apply_threads(exp, opts.threads)
            log(f"[torch] {nthreads} torch thread(s) ({source})")
        t0 = time.perf_counter()
        engines[backend] = create_engine(exp, backend)
        info = engines[backend][1]
        log(f"[{backend}] engine ready in {time.perf_counter() - t0:.1f}s: {info.num_gpu_blocks} KV blocks, "
            f"max_model_len {info.max_model_len}")
    vocabs = [info.vocab_size for _, info in engines.values() if info.vocab_size]
    t0 = time.perf_counter()
    requests, arrival, rng = build_requests(exp, min(vocabs) if vocabs else None)
    if len(requests) >= LARGE_RUN_REQUESTS:  # a long step before the progress bar: say what it was
        log(f"[workload] {len(requests):,} requests drawn in {time.perf_counter() - t0:.1f}s")
    wsum = workload_summary(requests)
    wsum["arrival"] = type(arrival).__name__
    runs: dict[str, BackendRun] = {}
    frames: dict[str, dict] = {}
    summaries: dict[str, dict] = {}
    interrupted = False
    for backend in exp.backends:
        engine, info = engines[backend]
        reqs = [dataclasses.replace(r) for r in requests]  # closed loops rewrite arrival_s
        bar = _progress_bar(progress, len(reqs), f"{exp.name} [{backend}]")
        try:
            if backend == "sim":
                run = _run_sim(exp, engine, info, reqs, arrival, rng, bar)
            else:
                run = _run_torch(  # each measured run builds its own engine over this executor
                    exp, info, reqs, arrival, bar, opts, nthreads, log)
        finally:
            if bar is not None:
                bar.close()
        if timings is not None:
            timings["sim_end"] = time.perf_counter()
        runs[backend] = run
        run.kv_pool = kv_pool_dict(info)
        if not defer:
            frames[backend] = run.recorder.frames()
            run.itls = run.recorder.itl_array()
            summaries[backend] = summarize(run, frames[backend], exp, run.itls)
            if on_backend is not None:
                on_backend(backend, run, frames[backend], summaries[backend])
            log(backend_line(backend, summaries[backend], run.interrupted))
        else:
            log(f"[{backend}] run finished ({run.completed}/{run.num_requests} requests"
                + (", INTERRUPTED" if run.interrupted else "") + "); its tables and summary come with the outputs")
        warning = run.measurement and contention_warning(run.measurement["contention"], opts.max_contended_share)
        if warning:
            log(f"warning: [torch] {warning}")
        engines[backend] = None  # free the engine (torch weights, KV cache) before the next backend
        if run.interrupted:
            interrupted = True
            break
    combined = {"name": exp.name, "interrupted": interrupted, "backends_requested": exp.backends,
                "workload": wsum, "backends": summaries}
    return combined, frames, runs


def run_experiment(exp: ExperimentConfig, out_dir: str, progress: bool = True,
                   log: Optional[Callable[[str], None]] = None, overwrite: bool = False,
                   folder: Optional[RunFolder] = None, measure: Optional[MeasureOptions] = None) -> dict[str, Any]:
    """Run every backend of `exp`, write everything under `out_dir`; returns the combined summary.

    The folder protocol of `servetwin.experiments.run.run_folder`: locked while this run writes, a
    non-empty folder refused unless `overwrite`, nothing touched before the engines are built and the
    first backend ran, summary.json written last. On KeyboardInterrupt the files of what ran are
    written (summary marked interrupted) and the interrupt is re-raised. `folder`: one the caller
    already acquired. `measure`: how the torch backend is measured (`run_backends`)."""
    if folder is None:
        with RunFolder(out_dir, overwrite=overwrite) as owned:
            return run_experiment(exp, out_dir, progress, log, folder=owned, measure=measure)
    import yaml  # noqa: PLC0415

    from servetwin.experiments.run.background import Prewarmed, parallel_ok  # noqa: PLC0415
    from servetwin.experiments.run.report import portable_config  # noqa: PLC0415

    log = log or (lambda msg: print(msg, file=sys.stderr))
    # the write phase runs in a child that imported pandas, pyarrow and matplotlib on a spare CPU while
    # the backends ran (~1 s of imports off the critical path); without one (one CPU, no fork) it runs here
    worker = Prewarmed(functools.partial(warm_outputs, exp.output.plots)) if parallel_ok() else None
    phase = {"sim_end": None}
    try:
        combined, _, runs = run_backends(exp, progress, log, measure=measure, timings=phase, defer=True)
        folder.begin()  # the first write: what an earlier run left is cleared only now
        requests_run = sum(r.num_requests for r in runs.values())
        if requests_run >= LARGE_RUN_REQUESTS:  # tables of a million requests take a while: say so first
            log(f"[outputs] writing the tables, trace.json, {'figures, ' if exp.output.plots else ''}report and "
                f"summary of {requests_run:,} requests")
        folder.write_text("config.yaml", yaml.safe_dump(portable_config(exp.to_dict(), out_dir), sort_keys=False))
        step_rows = sum(len(r.recorder.step_requests) for r in runs.values())
        if worker is not None and step_rows <= MAX_SHIPPED_STEP_ROWS:
            worker.submit(write_outputs, (exp, out_dir, {b: r.portable() for b, r in runs.items()}, combined))
            summaries, written = worker.result()
        else:  # here (pickling millions of per-request step rows costs more than the imports); the
            # prewarmed child, if any, still draws the figures
            summaries, written = write_outputs(exp, out_dir, runs, combined, worker)
    finally:
        if worker is not None:
            worker.close()  # a child still waiting (the run failed before writing): ended
    combined["backends"] = summaries
    for backend, s in summaries.items():
        log(backend_line(backend, s, s.get("interrupted", False)))
    for rel in written:
        folder.record(rel)
    folder.write_json("summary.json", combined)  # last: its presence and "interrupted" are the truth
    if phase["sim_end"] is not None:
        from servetwin.experiments.common.units import format_seconds  # noqa: PLC0415

        log(f"[outputs] tables, trace.json, {'figures, ' if exp.output.plots else ''}report and summary "
            f"written in {format_seconds(time.perf_counter() - phase['sim_end'])} after the last backend's run")
    if combined["interrupted"]:
        raise KeyboardInterrupt
    return combined


def warm_outputs(plots: bool) -> None:
    """What the output process imports while the backends run: pandas with its Parquet engine (one tiny
    table written to memory) and, for the figures, matplotlib (`plots.warm_plotting`)."""
    import io  # noqa: PLC0415

    import pandas as pd  # noqa: PLC0415

    pd.DataFrame({"a": [1]}).to_parquet(io.BytesIO(), index=False)
    if plots:
        from servetwin.experiments.run.plots import warm_plotting  # noqa: PLC0415

        warm_plotting()


MAX_SHIPPED_STEP_ROWS = 200_000  # per-request step rows worth pickling to the output process


def write_outputs(exp: ExperimentConfig, out_dir: str, runs: dict[str, BackendRun], combined: dict[str, Any],
                  worker=None) -> tuple[dict[str, dict], list[str]]:
    """Every file of the finished backends but config.yaml and summary.json: trace.json and the figures
    in forked children (started first: they need only the frames), the tables (Parquet) and each
    backend's summary.json meanwhile, then report.md. Each file is renamed into place complete. `worker`:
    a prewarmed child to draw the figures in (`plots.all_run_plots`). Returns (summary per backend, files
    written relative to out_dir)."""
    from servetwin.experiments.run.background import OutputJobs  # noqa: PLC0415
    from servetwin.experiments.run.report import write_report  # noqa: PLC0415

    jobs = OutputJobs()
    frames, summaries, written = {}, {}, []
    large = sum(r.num_requests for r in runs.values()) >= LARGE_RUN_REQUESTS
    say = (lambda m: print(f"[outputs] {m}", file=sys.stderr, flush=True)) if large else (lambda m: None)
    for backend, run in runs.items():
        # the tables first: the trace and figure writers forked below read them
        frames[backend] = run.recorder.frames()
        say(f"{backend}: tables built")
    for backend, run in runs.items():
        os.makedirs(os.path.join(out_dir, backend), exist_ok=True)
        trace_path = os.path.join(out_dir, backend, "trace.json")
        jobs.submit(f"{backend}/trace.json", run.recorder.write_trace, (trace_path,), trace_path,
                    background=exp.output.plots)  # with figures, the figures are the longest wait

    def inter_token_latencies() -> dict[str, Any]:
        # ~0.4 s for 2M tokens: computed while the forked children draw the figures that need no ITLs
        # (the engine's gaps, when they differ, by `summarize`: that array is not kept past it)
        for backend, run in runs.items():
            run.itls = run.recorder.itl_array()
        return {b: r.itls for b, r in runs.items()}

    plot_paths = None
    if exp.output.plots and frames:
        from servetwin.experiments.run.plots import all_run_plots, context_for  # noqa: PLC0415

        blocks = {b: {"num_gpu_blocks": r.info.num_gpu_blocks} for b, r in runs.items()}
        figures = all_run_plots(frames, inter_token_latencies, out_dir, context_for(exp, blocks), jobs, worker,
                                wait=False)
        itls = {b: r.itls for b, r in runs.items()}
    else:
        itls = inter_token_latencies()
    for backend, run in runs.items():
        # (the figures got the ITLs already: forked, pickled or drawn; nothing reads them after this)
        summaries[backend] = summarize(run, frames[backend], exp, run.itls, itls_read_after=False)
        bdir = os.path.join(out_dir, backend)
        for path in run.recorder.write(bdir, frames[backend], trace=False).values():
            written.append(os.path.relpath(path, out_dir))
        write_json(os.path.join(bdir, "summary.json"), summaries[backend])
        written.append(os.path.join(backend, "summary.json"))
        say(f"{backend}: tables and summary written")
    plots = exp.output.plots
    if plots and frames:
        try:
            plot_paths = figures()
        except ValueError:
            if not combined["interrupted"]:
                raise
            # interrupted early, the run may leave too little to draw (matplotlib: "Data cannot be
            # log-scaled"): its tables, report and summary still come, without figures, and the interrupt
            # still ends the command (exit 130), not this error (exit 2)
            plots, plot_paths = False, None
    answers = next((r.answers for r in runs.values() if r.answers), None)
    if answers:  # the real model's answers to the text prompts, all of them (report.md shows a few)
        atomic_write_text(os.path.join(out_dir, "torch", "answers.jsonl"),
                          "".join(json.dumps(a, ensure_ascii=False) + "\n" for a in answers))
        written.append(os.path.join("torch", "answers.jsonl"))
    say("writing the report (and waiting for trace.json" + (", the figures)" if plots else ")"))
    paths = write_report(exp, out_dir, dict(combined, backends=summaries, answers=answers), frames, itls, plots=plots,
                         jobs=jobs, plot_paths=plot_paths)
    written += [os.path.relpath(p, out_dir) for p in paths]
    written += [os.path.join(b, "trace.json") for b in runs if os.path.exists(os.path.join(out_dir, b, "trace.json"))]
    return summaries, written
