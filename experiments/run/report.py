"""`report.md` of a run: config, summary table per backend, key observations, plots."""
from __future__ import annotations

import os
from typing import Any, Optional

import yaml

from servetwin.core.testbed.atomic import atomic_write_text
from servetwin.experiments.common.md_tables import fmt, md_table
from servetwin.experiments.config.slo import slo_markdown
from servetwin.experiments.common.units import format_seconds

TOP_N = 10


def portable_config(cfg: Any, out_dir: str) -> Any:
    """The validated config with every absolute path to an existing file rewritten relative to `out_dir`
    (where config.yaml is written), so `DIR/config.yaml` runs again from any clone and names no home
    directory; a path on another drive stays as it is."""
    if isinstance(cfg, dict):
        return {k: portable_config(v, out_dir) for k, v in cfg.items()}
    if isinstance(cfg, list):
        return [portable_config(v, out_dir) for v in cfg]
    if isinstance(cfg, str) and os.path.isabs(cfg) and os.path.isfile(cfg):
        try:
            return os.path.relpath(cfg, os.path.abspath(out_dir))
        except ValueError:  # another drive (Windows)
            return cfg
    return cfg


SUMMARY_ROWS = [
    ("requests", "requests"), ("completed", "completed"), ("rejected", "rejected (never servable)"),
    ("num_steps", "engine steps"), ("wall_s", "wall time (s)"), ("simulated_s", "simulated time (s)"),
    ("duration_s", "makespan (s, run timeline, to the client's last chunk)"),
    ("engine_duration_s", "engine makespan (s, last step end)"),
    ("throughput_tok_s", "throughput (prompt+output tok/s)"),
    ("output_tok_s", "output tok/s"), ("request_throughput_s", "requests/s"),
]
DIST_ROWS = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"),
             ("engine_ttft_s", "engine TTFT"), ("engine_tpot_s", "engine TPOT"), ("engine_itl_s", "engine ITL"),
             ("engine_e2e_s", "engine E2E"), ("frontend_in_s", "front end in (client send -> engine)"),
             ("queue_s", "engine queue")]
TAIL_ROWS = [
    ("preemptions", "preemptions"), ("prefix_hit_rate", "prefix hit rate"), ("prompt_tokens", "prompt tokens"),
    ("cached_tokens", "cached prompt tokens (first admission)"),
    ("prefill_tokens_computed", "prefill tokens computed (sum of context tokens)"),
    ("prefill_saving_x", "prompt tokens / prefill computed"), ("output_tokens", "output tokens"),
    ("num_gpu_blocks", "KV blocks (num_gpu_blocks)"), ("block_size", "block size"),
    ("max_model_len", "max_model_len"), ("kv_peak_usage", "peak KV usage"), ("max_running", "max running"),
    ("max_waiting", "max waiting"),
]


def summary_table(summaries: dict[str, dict]) -> str:
    backends = list(summaries)
    rows = []
    for key, label in SUMMARY_ROWS:
        rows.append([label] + [summaries[b].get(key) for b in backends])
    for key, label in DIST_ROWS:
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append([f"{label} {stat} (s)"] + [(summaries[b].get(key) or {}).get(stat) for b in backends])
    for key, label in TAIL_ROWS:
        rows.append([label] + [summaries[b].get(key) for b in backends])
    return md_table(["metric"] + backends, rows)


def _observations(exp, summaries: dict[str, dict], frames: dict[str, dict]) -> list[str]:
    from servetwin.experiments.run.plots import step_phase  # noqa: PLC0415

    obs: list[str] = []
    for backend, s in summaries.items():
        st = frames[backend]["steps"] if backend in frames else None
        head = f"**{backend}**"
        if s.get("interrupted"):
            obs.append(f"{head}: INTERRUPTED - the tables hold the steps recorded before Ctrl-C.")
        if st is None or not len(st):
            obs.append(f"{head}: no step ran.")
            continue
        first = st.iloc[0]
        obs.append(f"{head}: step 0 ran `{first.annotation}` ({int(first.total_tokens):,} tokens); "
                   f"{int(first.num_running)} running and {int(first.num_waiting)} waiting after scheduling it.")
        blocks, bs = s["num_gpu_blocks"], s["block_size"]
        pool = s.get("kv_pool") or {}
        src = ""
        if exp.engine.given.get("num_gpu_blocks") is not None:
            src = " (num_gpu_blocks given in the config)"
        elif pool:
            src = (f" (sized like the engine: {pool.get('available_kv_bytes', 0) / 2**30:.2f} GiB for KV after "
                   f"{pool.get('weight_bytes', 0) / 2**30:.2f} GiB weights, {pool.get('bytes_per_block', 0):,} "
                   "bytes per block)")
        groups = pool.get("kv_cache_groups")  # set unless one full-attention group
        groups = (f"; its blocks serve the KV cache groups {groups}: a block is one {bs}-token page of each "
                  "layer of one group, a request holds blocks in every group, a window group only those its "
                  "window still reads") if groups else ""
        obs.append(f"{head}: KV pool {blocks:,} blocks x {bs} tokens = {blocks * bs:,} tokens{src}{groups}; "
                   f"peak usage {100 * (s['kv_peak_usage'] or 0):.1f}%, fewest free blocks "
                   f"{s['kv_min_free_blocks']:,}.")
        pre_steps = int((st.num_preempted > 0).sum())
        obs.append(f"{head}: {s['preemptions']} preemptions" + (f" in {pre_steps} steps" if pre_steps else "")
                   + f"; at most {s['max_running']} running and {s['max_waiting']} waiting.")
        if s["prefill_tokens_computed"]:
            saving = s["prefill_saving_x"]
            line = (f"{head}: prefill computed {s['prefill_tokens_computed']:,} tokens for {s['prompt_tokens']:,} "
                    "prompt tokens" + (f" ({saving:.2f}x less work than the prompts)" if saving > 1.005
                                       else " (no saving)" if saving > 0.995
                                       else f" ({1 / saving:.2f}x the prompts: recomputation after preemption)"))
            if s.get("prefix_hit_rate") is not None:
                line += f", prefix-cache hit rate {100 * s['prefix_hit_rate']:.1f}%"
            obs.append(line + ".")
            conv = s.get("conversations")
            if conv and conv.get("later_turns_cached_share") is not None:
                obs.append(f"{head}: later conversation turns ({conv['later_turns']:,}) found "
                           f"{100 * conv['later_turns_cached_share']:.1f}% of their prompt tokens in the prefix "
                           f"cache (first turns: {100 * (conv['first_turns_cached_share'] or 0):.1f}%).")
            ctx = st[st.num_context_reqs > 0]
            near = ctx[ctx.num_context_tokens <= ctx.num_context_reqs * bs]
            if len(near):
                ex = ", ".join(f"`{a}`" for a in near.annotation.head(3))
                obs.append(f"{head}: {len(near)} steps carry only near-total prefix hits (at most one block of "
                           f"new prompt per context request), e.g. {ex}.")
        fe = s.get("frontend") or {}
        if fe.get("type") == "api_server" and fe.get("modelled", True):
            ttft, ettft, fin = (s.get(k) or {} for k in ("ttft_s", "engine_ttft_s", "frontend_in_s"))
            util = fe.get("cpu_utilization")
            obs.append(f"{head}: front end = API server ({fe.get('endpoint')} endpoint, coefficients "
                       f"`{fe.get('coefficients')}`), its CPU busy {fmt(fe.get('cpu_busy_s'))} s"
                       + (f" ({100 * util:.0f}% of the run)" if util is not None else "")
                       + f"; requests reach the engine {format_seconds(fin.get('mean') or 0)} (mean) after "
                       f"they are sent; TTFT at the client {format_seconds(ttft.get('mean') or 0)} vs "
                       f"{format_seconds(ettft.get('mean') or 0)} at the engine (mean).")
        elif fe.get("type") == "api_server":
            obs.append(f"{head}: {fe.get('note', 'front end not modelled')}.")
        else:
            obs.append(f"{head}: front end = offline (no HTTP): client and engine boundaries coincide.")
        phase = step_phase(st)
        parts = []
        for name in ("prefill only", "mixed", "decode only"):
            m = phase == name
            if m.any():
                parts.append(f"{name}: {int(m.sum())} steps, mean {format_seconds(float(st.duration_s[m].mean()))}")
        obs.append(f"{head}: step time by phase - " + "; ".join(parts) + ".")
        if s.get("measurement"):
            obs.append(f"{head}: {measurement_line(s['measurement'])}")
        if s.get("sim_speedup_x"):
            obs.append(f"{head}: simulated {format_seconds(s['simulated_s'])} in {format_seconds(s['wall_s'])} of "
                       f"host time ({s['sim_speedup_x']:,.1f}x real time).")
    if "sim" in summaries and "torch" in summaries:
        a, b = summaries["sim"], summaries["torch"]
        if a["duration_s"] and b["duration_s"]:
            obs.append(f"torch measured makespan / sim predicted makespan = {b['duration_s'] / a['duration_s']:.3g} "
                       f"({b['duration_s']:.3f} s vs {a['duration_s']:.3f} s; the sim's step times come from "
                       f"{_cost_model_source(exp)}).")
        sa, sb = frames["sim"]["steps"], frames["torch"]["steps"]
        if len(sa) and len(sb):
            n = min(len(sa), len(sb))
            same = int((sa.annotation.iloc[:n].to_numpy() == sb.annotation.iloc[:n].to_numpy()).sum())
            note = "" if combined_offline(exp) else "; online arrivals land at different steps"
            obs.append(f"scheduling: {same} of the first {n} steps have the same annotation in sim and torch "
                       f"({len(sa)} vs {len(sb)} steps in all{note}).")
    return obs


def _cost_model_source(exp) -> str:
    """Which hardware the simulator's step costs come from, and whether it is a calibration (by file name:
    the report names no absolute path)."""
    from servetwin.experiments.calibrate.torch_measure import calibration_info  # noqa: PLC0415

    label, prov = calibration_info(exp)
    name = os.path.basename(label) if isinstance(exp.hardware, str) and os.path.isabs(label) else label
    if prov.get("validated_on"):  # a GPU preset: what it was fitted and judged on
        return f"the `{name}` hardware preset ({prov['validated_on']})"
    if not prov.get("calibrated"):
        return f"the `{name}` hardware cost model (uncalibrated coefficients)"
    return (f"the calibration `{name}`, fitted on {prov.get('device', 'an unrecorded device')} with "
            f"{prov.get('torch_threads', '?')} torch thread(s); `servetwin compare` measures its drift")


def measurement_line(m: dict[str, Any]) -> str:
    """How a torch run was measured: threads, warm-up, the contention check (`torch_measure`)."""
    from servetwin.experiments.calibrate.torch_measure import CONTENDED_ADVICE, is_contended  # noqa: PLC0415

    c, retry = m["contention"], m["retry_contended"]
    warm = "no warm-up" if m.get("warmup_s") is None else f"warm-up {format_seconds(m['warmup_s'])} (not recorded)"
    line = (f"measured with {m['torch_threads']} torch thread(s), {warm}; contention check: "
            f"{100 * (c.get('contended_step_share') or 0):.1f}% of the steps lost their CPU to other processes "
            f"(median cpu_share {c.get('median_cpu_share') or 0:.2f})")
    if m.get("discarded_runs"):
        line += f"; {len(m['discarded_runs'])} contended run(s) discarded and run again"
    if m.get("calibration_mismatches"):
        line += "; the simulator's calibration does not describe this run: " + "; ".join(m["calibration_mismatches"])
    if is_contended(c, retry["max_contended_share"]):
        return line + f". **Warning**: more than {100 * retry['max_contended_share']:g}% of the steps were " \
                      f"contended: {CONTENDED_ADVICE}."
    return line + "."


def combined_offline(exp) -> bool:
    from servetwin.sim.arrivals import Offline  # noqa: PLC0415

    return isinstance(exp.workload.arrival, Offline)


def annotation_histogram(frames: dict[str, dict], top_n: int = TOP_N) -> str:
    parts = []
    for backend, fr in frames.items():
        st = fr["steps"]
        if not len(st):
            continue
        counts = st.annotation.value_counts().head(top_n)
        mean_ms = st.groupby("annotation").duration_s.mean() * 1e3
        rows = [[f"`{a}`", int(c), float(mean_ms[a])] for a, c in counts.items()]
        parts.append(f"**{backend}** ({st.annotation.nunique():,} distinct annotations in {len(st):,} steps)\n\n"
                     + md_table(["annotation", "steps", "mean duration (ms)"], rows))
    return "\n\n".join(parts)


ANSWERS_SHOWN = 6


def answers_markdown(answers: Optional[list[dict[str, Any]]]) -> list[str]:
    """A few of the real model's answers (text prompts on the torch backend); all are in torch/answers.jsonl."""
    if not answers:
        return []
    out = ["## Answers (torch backend, greedy)", "",
           f"The first {min(ANSWERS_SHOWN, len(answers))} of {len(answers)} (all in `torch/answers.jsonl`). Every "
           "request runs to its max_tokens (ignore_eos, so both backends schedule the same steps); an answer is "
           "shown up to its first end-of-sequence token.", ""]
    for a in answers[:ANSWERS_SHOWN]:
        prompt = " ".join(str(a["prompt"]).split())
        prompt = prompt if len(prompt) <= 240 else prompt[:80] + " ... " + prompt[-150:]  # the question ends it
        answer = str(a["answer"]).strip() or "(empty)"
        end = "" if a.get("ended_by_eos") else f" (no EOS within {a.get('output_tokens')} tokens)"
        out += [f"**{a['id']}**: {prompt}", "", *("> " + line for line in answer.splitlines() if line.strip()),
                "", f"<sub>{a.get('output_tokens')} output tokens{end}</sub>", ""]
    return out


def write_report(exp, out_dir: str, combined: dict[str, Any], frames: dict[str, dict],
                 itls: dict[str, list], plots: bool = True, jobs=None, worker=None,
                 plot_paths: Optional[dict[str, Optional[str]]] = None) -> list[str]:
    """The figures (unless `plots` is false, or `plot_paths` says they are drawn already), then report.md,
    each renamed into place complete; `jobs`: an OutputJobs still writing other files of the run, waited
    for before the report is written; `worker`: a prewarmed child that draws the figures
    (`plots.all_run_plots`). Returns the paths written."""
    summaries = combined["backends"]
    if plot_paths is not None:
        if jobs is not None:
            jobs.wait()
    elif plots and frames:
        from servetwin.experiments.run.plots import all_run_plots, context_for  # noqa: PLC0415

        plot_paths = all_run_plots(frames, itls, out_dir, context_for(exp, summaries), jobs, worker)
    else:
        plot_paths = {}
        if jobs is not None:
            jobs.wait()
    w = combined.get("workload", {})
    lines = [f"# {exp.name}", ""]
    if exp.description:
        lines += [exp.description.strip(), ""]
    if combined.get("interrupted"):
        lines += ["**Interrupted (Ctrl-C): the files hold what finished before the interrupt.**", ""]
    lines += ["## Config", "", "```yaml", yaml.safe_dump(portable_config(exp.to_dict(), out_dir), sort_keys=False).rstrip(), "```", ""]
    if w.get("requests"):
        lines += ["## Workload", "",
                  f"{w['requests']:,} requests ({w['sequences']:,} sequences), arrival `{w.get('arrival')}`, "
                  f"last arrival at {w['last_arrival_s']:.3f} s; prompt tokens mean {w['prompt_tokens_mean']:.1f} "
                  f"(min {w['prompt_tokens_min']}, max {w['prompt_tokens_max']}, total {w['prompt_tokens_total']:,}); "
                  f"output tokens mean {w['output_tokens_mean']:.1f} (total {w['output_tokens_total']:,}).", ""]
        if w.get("conversations"):
            lines[-1:-1] = [f"{w['conversations']:,} multi-turn conversations, {w['turns_per_conversation_mean']:.2f} "
                            f"turns each on average (at most {w['turns_max']}); a later turn's prompt is the history "
                            "(previous prompt + the engine's answer) plus a new message, so the prefix-cache rows "
                            "below show the sharing; arrival = conversation starts, lengths as planned."]
    bound = [f"- **{b}**: {s['binding']['line']}." for b, s in summaries.items() if s.get("binding")]
    if bound:
        lines += ["## What limits this result", "", *bound, "",
                  "From the run's own measurements (experiments/run/binding.py states the rules and thresholds).", ""]
    lines += ["## Summary", "", summary_table(summaries) if summaries else "(no backend ran)", "",
              "Throughput counts prompt + output tokens of completed sequences over the makespan (from t = 0 "
              "to the client's last chunk; the end of the last step without a modelled front end); latencies "
              "follow `servetwin.core.testbed.trace`: TTFT / TPOT / ITL / E2E at the client boundary `vllm bench "
              "serve` measures (a modelled API server's ingress and output delivery included), the `engine` rows "
              "at the engine (from the request reaching it; a token's time is the end of the step that computed "
              "it). The sim's times are simulated, torch's are measured.", "",
              *slo_markdown(summaries), "## Key observations", ""]
    lines += [f"- {o}" for o in _observations(exp, summaries, frames)] + [""]
    lines += answers_markdown(combined.get("answers"))
    lines += [f"## Most frequent step annotations (top {TOP_N})", "", annotation_histogram(frames), ""]
    if plot_paths:
        lines += ["## Plots", ""]
        titles = {"latency_cdf": "Latency CDFs (log time axis, p50 / p99 marked)",
                  "timeline": "Timeline: running / waiting, KV usage, throughput, arrivals / completions, "
                              "preemptions",
                  "request_gantt": "Per-request queue / prefill / decode (a sample of requests)",
                  "step_time": "Step duration vs scheduled tokens (by phase)"}
        for key, path in plot_paths.items():
            if path:
                lines += [f"### {titles.get(key, key)}", "", f"![{key}]({os.path.basename(path)})", ""]
    lines += ["## Files", "", "- `summary.json` (all backends), `config.yaml` (validated config)"]
    for b in summaries:
        lines.append(f"- `{b}/`: `steps.parquet`, `step_requests.parquet`, `requests.parquet`, "
                     "`trace.json` (open in Perfetto), `summary.json`")
    path = os.path.join(out_dir, "report.md")
    atomic_write_text(path, "\n".join(lines) + "\n")
    return [p for p in plot_paths.values() if p] + [path]
