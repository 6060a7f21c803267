"""`servetwin run` of an experiment with a `cluster:` section: every instance's engines in one simulation
(`servetwin.sim.cluster`), then per-engine and whole-cluster metrics and the router's decision table.

Layout under the output folder DIR:

    DIR/config.yaml                              the validated config
    DIR/summary.json                             {"name", "interrupted", "workload", "backends": {"sim": cluster},
                                                  "cluster": {"instances": {name/rank: summary}, ...}}
    DIR/sim/summary.json                         the whole cluster's summary
    DIR/sim/router_decisions.parquet             request, t_s, pick, rank, candidates, scores
    DIR/sim/instances/<name>[-r<rank>]/          each engine's steps.parquet, requests.parquet, summary.json

The whole-cluster figures pool every engine's requests (latency distributions over all of them) over the
cluster's duration (the last engine's end). `write_cluster_outputs` adds report.md and the figures;
sim/trace.json and the engines' steps.parquet are written by forked children meanwhile
(`write_cluster_trace_file`, `write_steps_tables`).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

from servetwin.experiments.config.cluster import instance_engine_args
from servetwin.experiments.config.schema import ExperimentConfig
from servetwin.experiments.config.workloads import build_requests, workload_summary
from servetwin.experiments.run.runner import (SUMMARY_STEP_COLUMNS, BackendRun, _Progress, _progress_bar, dist_stats,
                                              kv_pool_dict, summarize, write_json)

CLUSTER_LATENCY_KEYS = ("ttft_s", "tpot_s", "e2e_s", "queue_s")
# the steps tables' columns the parent reads (`summarize`, and `cluster_figures`: t_start_s): the whole tables
# are built and written by a forked child (`write_steps_tables`)
PARENT_STEP_COLUMNS = SUMMARY_STEP_COLUMNS + ("t_start_s",)


def build_cluster(exp: ExperimentConfig) -> list[Any]:
    """Every instance copy's `InstanceEngines` (one engine per DP rank), in the config's order."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.sim.cluster import InstanceEngines  # noqa: PLC0415

    out = []
    for name, inst in exp.cluster.expanded():
        args = instance_engine_args(exp.engine_args("sim"), inst, inst.hardware_spec, exp.cluster.links)
        for endpoint, num_ranks in exp.cluster.endpoint_ranks(name, inst):
            engines = [create_engine_core(args) for _ in range(num_ranks)]
            moe = engines[0][1].executor.cost_model.model.num_experts > 0  # vLLM: MoE DP runs in lockstep
            out.append(InstanceEngines(endpoint, [e for e, _ in engines], inst.role, [info for _, info in engines],
                                       lockstep=moe and inst.data_parallel_size > 1, dp_group=name,
                                       tensor_parallel_size=args.tensor_parallel_size))
    return out


def pd_flow_factory(exp: ExperimentConfig, instances: list[Any]) -> Any:
    """The P/D path's builder for a cluster with prefill/decode instances (sim/pd_cluster.py), else None."""
    if not exp.cluster.disaggregated:
        return None
    import functools  # noqa: PLC0415

    from servetwin.sim.pd_cluster import PDFlow  # noqa: PLC0415
    from servetwin.sim.routers import build_router  # noqa: PLC0415

    prefill_router = build_router(exp.cluster.prefill_router, np.random.default_rng([exp.seed, 0x5EED, 1]))
    return functools.partial(PDFlow, prefill_router=prefill_router,
                             threshold_tokens=exp.cluster.router.pd_threshold_tokens,
                             tensor_parallel=[inst.tensor_parallel_size for inst in instances])


def engine_label(name: str, rank: int, dp: int) -> str:
    return name if dp == 1 else f"{name}-r{rank}"


def simulate_cluster(exp: ExperimentConfig, progress: bool = False):
    """(ClusterSimulation after its run, per-engine BackendRuns by label, requests, interrupted)."""
    from servetwin.sim.cluster import ClusterSimulation  # noqa: PLC0415
    from servetwin.sim.routers import build_router  # noqa: PLC0415

    instances = build_cluster(exp)
    vocab = min(info.vocab_size for inst in instances for info in inst.infos if info.vocab_size)
    requests, arrival, rng = build_requests(exp, vocab)
    router_rng = np.random.default_rng([exp.seed, 0x5EED])  # the router's own draws (random picks, tie-breaks)
    router = build_router(exp.cluster.router, router_rng)
    bar = _progress_bar(progress, len(requests), f"{exp.name} [sim cluster]")
    counter = _Progress(bar)
    frontend = exp.frontend.resolved(exp.hardware_spec.device_type)
    sim = ClusterSimulation(instances, router, requests, arrival, rng=rng, run=exp.name,
                            scrape_interval_s=exp.cluster.router.scrape_interval_s,
                            record_step_requests=exp.output.step_requests, frontend=frontend,
                            on_complete=counter.on_complete, on_reject=counter.on_reject,
                            pd_flow=pd_flow_factory(exp, instances), sim_workers=exp.cluster.sim_workers)
    t0 = time.perf_counter()
    interrupted = False
    try:
        sim.run()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    routed: dict[tuple[str, int], int] = {}
    for d in sim.result.decisions:
        routed[(d.pick, d.rank)] = routed.get((d.pick, d.rank), 0) + 1
    runs: dict[str, BackendRun] = {}
    engine_runs = sim.engine_runs()
    for inst in instances:
        dp = len(inst.engines)
        for rank, (e, info) in enumerate(zip([e for n, _, e in engine_runs if n == inst.name], inst.infos)):
            r = e.result
            runs[engine_label(inst.name, rank, dp)] = BackendRun(
                "sim", r.recorder, info, wall, r.end_time_s, routed.get((inst.name, rank), 0),
                len(r.completion_s), dict(r.rejected), interrupted,
                frontend=e.frontend_summary if e.frontend_summary is not None else frontend.describe(),
                kv_pool=kv_pool_dict(info))
    return sim, runs, requests, interrupted


def cluster_summary(exp: ExperimentConfig, sim: Any, summaries: dict[str, dict], frames: dict[str, dict],
                    itls: list[np.ndarray], wall_s: float, num_requests: int,
                    engine_itls: Optional[list[np.ndarray]] = None) -> dict[str, Any]:
    """The whole cluster's figures: every engine's requests pooled, over the cluster's duration (with the
    config's SLOs: their evaluation on the pooled requests and gaps; `engine_itls`: the engine-boundary gaps,
    for `engine_itl_*` targets)."""
    import pandas as pd  # noqa: PLC0415

    from servetwin.experiments.run.binding import cluster_binding  # noqa: PLC0415
    from servetwin.experiments.run.steady_state import steady_state  # noqa: PLC0415
    from servetwin.sim.cluster_offload import cpu_tier_totals  # noqa: PLC0415

    reqs = pd.concat([f["requests"] for f in frames.values()], ignore_index=True) if frames else pd.DataFrame()
    if len(reqs) and exp.cluster.disaggregated:  # P/D: the client's requests are the decode side's records
        from servetwin.sim.pd_cluster import PREFILL_SUFFIX  # noqa: PLC0415

        reqs = reqs[~reqs.request_id.astype(str).str.endswith(PREFILL_SUFFIX)]
    duration = max((s["duration_s"] for s in summaries.values()), default=0.0)
    finished = reqs[reqs.finish_reason.notna() & (reqs.finish_reason != "abort")] if len(reqs) else reqs
    output_done = int(finished.output_tokens.sum()) if len(finished) else 0
    prompt_done = int(finished.prompt_tokens.sum()) if len(finished) else 0
    completed = len(sim.result.completion_s)

    gaps = np.concatenate(itls) if itls else np.array([])  # (every engine's client gaps, pooled: one fresh array)

    def per_s(x: float) -> Optional[float]:
        return x / duration if duration > 0 else None

    queries = sum(s["prefix_queries"] for s in summaries.values())
    hits = sum(s["prefix_hits"] for s in summaries.values())
    out: dict[str, Any] = {
        "run": exp.name, "backend": "sim", "cluster": True, "requests": num_requests, "completed": completed,
        "rejected": len(sim.result.rejected), "wall_s": wall_s, "simulated_s": sim.result.end_time_s,
        "duration_s": duration, "num_steps": sum(s["num_steps"] for s in summaries.values()),
        "num_engines": len(summaries), "num_gpus": exp.cluster.num_gpus(exp.engine.args.tensor_parallel_size),
        "router": exp.cluster.router.type,
        "throughput_tok_s": per_s(prompt_done + output_done), "output_tok_s": per_s(output_done),
        "request_throughput_s": per_s(completed),
        "itl_s": dist_stats(gaps, scratch=True),  # (reordered in place: the SLO's counts below do not mind)
        "prefix_queries": queries, "prefix_hits": hits, "prefix_hit_rate": hits / queries if queries else None,
        "preemptions": sum(s["preemptions"] for s in summaries.values()),
        "kv_peak_usage": max((s["kv_peak_usage"] or 0.0 for s in summaries.values()), default=None),
        "requests_per_engine": {k: s["requests"] for k, s in summaries.items()},
        "links": {k: v.to_dict() for k, v in exp.cluster.links.items()},
    }
    tiers = cpu_tier_totals([s.engine for _, _, s in sim.simulations()])
    if tiers is not None:  # instances with a CPU KV tier (sim/cluster_offload.py)
        out["cpu_tier"] = tiers
    for key in CLUSTER_LATENCY_KEYS:
        out[key] = dist_stats(reqs[key]) if len(reqs) else dist_stats([])
    # (the pooled requests' verdict, its wait floor from the engines' median step)
    p50s = [x for s in summaries.values() if (x := (s.get("step_duration_s") or {}).get("p50")) is not None]
    state = steady_state(reqs, float(np.median(p50s)) if p50s else None)  # (None for too few requests)
    if exp.slo is not None and not exp.slo.empty:
        from servetwin.experiments.config.slo import evaluate_slo  # noqa: PLC0415

        out["slo"] = evaluate_slo(exp.slo, reqs, gaps, duration,
                                  np.concatenate(engine_itls) if engine_itls else gaps)
        out["goodput_req_s"] = out["slo"]["goodput_req_s"]
    out["steady_state"] = state  # (what `capacity` reads of a probe)
    binding = cluster_binding(summaries, num_requests - completed - out["rejected"], state)
    if binding is not None:
        out["binding"] = binding
    return out


def write_cluster_trace_file(path: str, exp: ExperimentConfig, runs: dict[str, BackendRun], sim: Any) -> str:
    """sim/trace.json: one Perfetto process per engine, then the router's decisions (and, for P/D, the KV
    transfers with their flow arrows). Needs only what the simulation recorded (no table)."""
    from servetwin.core.testbed.perfetto import write_cluster_trace  # noqa: PLC0415

    write_cluster_trace(path, exp.name, [(label, run.recorder.steps, list(run.recorder.requests.values()))
                                         for label, run in runs.items()],
                        ((d.t, d.request_id, d.pick if d.rank is None or d.rank == 0 else f"{d.pick}-r{d.rank}")
                         for d in sim.result.decisions),
                        transfers=[] if sim.pd is None else  # P/D: the KV reads, with flow arrows
                        [(t.request_id, t.prefill, t.decode, t.start_s, t.end_s) for t in sim.pd.record.transfers.values()])
    return path


def steps_table_paths(runs: dict[str, BackendRun]) -> dict[str, str]:
    """Each engine's steps.parquet (relative to the output folder), by label."""
    return {label: os.path.join("sim", "instances", label, "steps.parquet") for label in runs}


def write_steps_tables(out_dir: str, runs: dict[str, BackendRun]) -> str:
    """Every engine's steps.parquet (the tables' largest: ~750k rows over the routing ladder's 16 engines);
    returns the last one's path."""
    path = ""
    for label, rel in steps_table_paths(runs).items():
        recorder = runs[label].recorder
        path = recorder.write(os.path.dirname(os.path.join(out_dir, rel)), {"steps": recorder.steps.to_frame()},
                              trace=False)["steps"]
    return path


def write_cluster_outputs(exp: ExperimentConfig, out_dir: str, folder: Any, summaries: dict[str, dict],
                          frames: dict[str, dict], whole: dict[str, Any]) -> None:
    """report.md (the cluster's and every engine's table) and, with `output.plots`, the cluster's figures."""
    from servetwin.experiments.run.cluster_report import cluster_figures, cluster_report  # noqa: PLC0415

    figures = cluster_figures(out_dir, frames) if exp.output.plots else []
    for path in figures:
        folder.record(os.path.relpath(path, out_dir))
    folder.write_text("report.md", cluster_report(exp, whole, summaries, [os.path.relpath(p, out_dir) for p in figures]))


def decisions_frame(sim: Any):
    import pandas as pd  # noqa: PLC0415

    rows = [{"request_id": d.request_id, "t_s": d.t, "pick": d.pick, "rank": d.rank,
             "candidates": list(d.candidates), "scores": None if d.scores is None else [float(x) for x in d.scores]}
            for d in sim.result.decisions]
    return pd.DataFrame(rows, columns=["request_id", "t_s", "pick", "rank", "candidates", "scores"])


def run_cluster_experiment(exp: ExperimentConfig, out_dir: str, folder: Any, progress: bool = True,
                           log: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Run the cluster, write everything under `out_dir` (the run-folder protocol of `run_experiment`)."""
    from servetwin.experiments.run.background import frozen_heap  # noqa: PLC0415

    log = log or (lambda msg: print(msg, file=sys.stderr))
    t0 = time.perf_counter()
    sim, runs, requests, interrupted = simulate_cluster(exp, progress)
    wall = time.perf_counter() - t0
    folder.begin()
    with frozen_heap():  # the simulation's millions of objects, all still in use: not scanned again
        combined = _write_outputs(exp, out_dir, folder, sim, runs, requests, interrupted, wall)
    whole = combined["backends"]["sim"]
    log(f"[sim cluster] {whole['completed']}/{whole['requests']} requests on {whole['num_engines']} engines "
        f"({whole['num_gpus']} GPUs), router {whole['router']}, {whole['simulated_s']:.1f}s simulated in "
        f"{wall:.1f}s wall")
    if interrupted:
        raise KeyboardInterrupt
    return combined


def _write_outputs(exp: ExperimentConfig, out_dir: str, folder: Any, sim: Any, runs: dict[str, BackendRun],
                   requests: list[Any], interrupted: bool, wall: float) -> dict[str, Any]:
    """Every file of the cluster's run but the top summary.json (written last by the caller); trace.json,
    the longest to write, in a forked child (`OutputJobs`) while the tables and summaries are built here.
    Returns the combined summary."""
    import yaml  # noqa: PLC0415

    from servetwin.experiments.run.background import OutputJobs  # noqa: PLC0415
    from servetwin.experiments.run.report import portable_config  # noqa: PLC0415

    jobs = OutputJobs()
    trace_rel = os.path.join("sim", "trace.json")
    folder.own(trace_rel)  # in the marker before the fork: the child's rename then adds no second line
    trace = folder.file(trace_rel)
    jobs.submit(trace_rel, write_cluster_trace_file, (trace, exp, runs, sim), trace)
    # (speed: the steps tables, built and written in a second child: the routing ladder's parent did ~4 s of
    # CPU here against the trace child's ~3; now ~2.7 against ~3.3 and ~1 in this child, on two CPUs; pandas
    # imported first, for it and for the parent)
    import pandas  # noqa: F401, PLC0415

    steps_rels = steps_table_paths(runs)
    folder.own(*steps_rels.values())  # (as trace.json above)
    if steps_rels:
        jobs.submit("steps", write_steps_tables, (out_dir, runs), os.path.join(out_dir, list(steps_rels.values())[-1]))
    folder.write_text("config.yaml", yaml.safe_dump(portable_config(exp.to_dict(), out_dir), sort_keys=False))
    summaries, frames, whole = summarize_cluster(exp, sim, runs, len(requests), wall)
    for label, run in runs.items():
        edir = os.path.join(out_dir, "sim", "instances", label)
        os.makedirs(edir, exist_ok=True)
        tables = {name: frame for name, frame in frames[label].items() if name != "steps"}  # (the child's)
        for path in run.recorder.write(edir, tables, trace=False).values():
            folder.record(os.path.relpath(path, out_dir))
        write_json(os.path.join(edir, "summary.json"), summaries[label])
        folder.record(os.path.join("sim", "instances", label, "summary.json"))
    write_json(os.path.join(out_dir, "sim", "summary.json"), whole)
    folder.record(os.path.join("sim", "summary.json"))
    decisions = decisions_frame(sim)
    path = os.path.join(out_dir, "sim", "router_decisions.parquet")
    decisions.to_parquet(path, index=False)
    folder.record(os.path.relpath(path, out_dir))
    if sim.pd is not None:  # P/D: the KV transfer timeline
        from servetwin.sim.pd_cluster import transfers_frame  # noqa: PLC0415

        path = os.path.join(out_dir, "sim", "kv_transfers.parquet")
        transfers_frame(sim.pd.record).to_parquet(path, index=False)
        folder.record(os.path.relpath(path, out_dir))
    write_cluster_outputs(exp, out_dir, folder, summaries, frames, whole)
    jobs.wait()  # (a child that failed: its files redone here)
    folder.record(trace_rel)
    for rel in steps_rels.values():
        folder.record(rel)
    combined = _combined(exp, requests, interrupted, whole, summaries)
    folder.write_json("summary.json", combined)  # last: its presence and "interrupted" are the truth
    return combined


def summarize_cluster(exp: ExperimentConfig, sim: Any, runs: dict[str, BackendRun], num_requests: int,
                      wall: float) -> tuple[dict[str, dict], dict[str, dict], dict[str, Any]]:
    """(each engine's summary, each engine's tables as the parent reads them, the whole cluster's summary)."""
    summaries, frames, itls, engine_gaps = {}, {}, [], []
    slo = exp.slo is not None and not exp.slo.empty  # (the engine-boundary gaps kept for its evaluation alone)
    for label, run in runs.items():
        frames[label] = run.recorder.frames(PARENT_STEP_COLUMNS)
        run.itls, engine_itls = run.recorder.itl_arrays()  # (speed: one pass over the token times for both)
        itls.append(np.asarray(run.itls, dtype=float))
        if slo:
            engine_gaps.append(np.asarray(engine_itls, dtype=float))
        summaries[label] = summarize(run, frames[label], exp, run.itls, engine_itls)
    whole = cluster_summary(exp, sim, summaries, frames, itls, wall, num_requests, engine_gaps)
    if sim.pd is not None:
        whole["pd"] = sim.pd.summary()
    return summaries, frames, whole


def _combined(exp: ExperimentConfig, requests: list[Any], interrupted: bool, whole: dict[str, Any],
              summaries: dict[str, dict]) -> dict[str, Any]:
    return {"name": exp.name, "interrupted": interrupted, "backends_requested": exp.backends,
            "workload": workload_summary(requests), "backends": {"sim": whole}, "cluster": {"engines": summaries}}


def cluster_run_summary(exp: ExperimentConfig, progress: bool = False) -> dict[str, Any]:
    """The combined summary `run_cluster_experiment` returns, with nothing written (a capacity probe's run);
    `combined["interrupted"]` set on Ctrl-C."""
    t0 = time.perf_counter()
    sim, runs, requests, interrupted = simulate_cluster(exp, progress)
    summaries, _, whole = summarize_cluster(exp, sim, runs, len(requests), time.perf_counter() - t0)
    return _combined(exp, requests, interrupted, whole, summaries)


__all__ = ["run_cluster_experiment", "simulate_cluster", "cluster_summary", "summarize_cluster", "cluster_run_summary",
           "build_cluster", "decisions_frame"]
