"""Chrome traces with vLLM's step ranges: read into servetwin's step table, written from one.

vLLM's GPU worker wraps each step's `execute_model` in a `torch.profiler.record_function` named by
`compute_iteration_details` (vllm/v1/utils.py; the spec's section 6.3):

    execute_context_{n}({tokens})_generation_{m}({tokens})
    execute_{total}_context_{n}(sq{q}sk{seq}sqsq{q2}sqsk{qseq})_generation_{m}(sq..sk..sqsq..sqsk..)   (detailed)

where per request q = scheduled tokens, seq = computed tokens before the step + q, summed per class.
`torch.profiler`'s `export_chrome_trace` writes the range as a complete event (`"ph": "X"`) of category
`user_annotation` on the CPU thread and, when CUDA activity is recorded, again as
`gpu_user_annotation` spanning the kernels it launched. One file per rank (TP workers each profile).

`read_profiler_traces` returns one row per step in `servetwin.core.testbed.trace.STEP_COLUMNS`
(columns a trace does not give are NaN) plus `cpu_duration_s`, `gpu_duration_s` (NaN without GPU
annotations), `gap_before_s` (from the previous step's end to this one's start) and, for the detailed
form, the per-class sums. `duration_s` is the GPU duration where there is one (the device time the
cost model predicts), else the CPU range's. Several ranks: the steps are matched by position (the
compositions must agree) and each step takes the slowest rank's durations. `write_profiler_trace`
writes a step table (a servetwin run's, the simulator's predictions) in the same shape.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import MAX_IMPORT_NUMBER, bounded_number, load_json_text, printable, read_import_text
from servetwin.core.testbed.step_ranges import CPU_CATEGORY, GPU_CATEGORY

PLAIN = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
_SUMS = r"\(sq(\d+)sk(\d+)sqsq(\d+)sqsk(\d+)\)"
DETAILED = re.compile(rf"^execute_(\d+)_context_(\d+){_SUMS}_generation_(\d+){_SUMS}$")
SUM_COLUMNS = ("ctx_sum_seq", "ctx_sum_q2", "ctx_sum_q_seq", "gen_sum_seq", "gen_sum_q2", "gen_sum_q_seq")
EXTRA_COLUMNS = ("cpu_duration_s", "gpu_duration_s", "gap_before_s", "rank_count") + SUM_COLUMNS


def parse_annotation(name: str) -> Optional[dict[str, int]]:
    """The step composition a range name states (None: not a step range)."""
    m = PLAIN.match(name)
    if m:
        nc, tc, ng, tg = map(int, m.groups())
        return {"num_context_reqs": nc, "num_context_tokens": tc, "num_generation_reqs": ng,
                "num_generation_tokens": tg}
    m = DETAILED.match(name)
    if not m:
        return None
    g = list(map(int, m.groups()))
    # total, then per class: requests, sq (tokens), sk, sqsq, sqsk
    out = {"num_context_reqs": g[1], "num_context_tokens": g[2], "num_generation_reqs": g[6],
           "num_generation_tokens": g[7]}
    out.update(zip(("ctx_sum_seq", "ctx_sum_q2", "ctx_sum_q_seq"), g[3:6]))
    out.update(zip(("gen_sum_seq", "gen_sum_q2", "gen_sum_q_seq"), g[8:11]))
    return out


# Step ranges one trace may hold: each becomes a row of the step table (a long vLLM profile has tens of
# thousands; a file of only step ranges at MAX_IMPORT_FILE_BYTES would hold 2.5M, several GB of rows).
MAX_TRACE_STEPS = 250_000
_CATEGORIES = (CPU_CATEGORY, GPU_CATEGORY)


class _TooManySteps(Exception):
    """Raised from inside json's parse (not a ValueError: load_json_text would call it bad JSON)."""


def _step_range_keeper() -> Callable[[dict], Any]:
    """json's object hook: a trace event is dropped as it is parsed unless it is a step range, which keeps
    only the keys read here (a 2M-event trace holds its few thousand steps, not 2M dicts with their args);
    past MAX_TRACE_STEPS step ranges the parse stops."""
    kept = 0

    def keep(obj: dict) -> Any:
        nonlocal kept
        if "ph" not in obj:
            return obj  # the top-level object, an event's args, metadata
        name = obj.get("name")
        if obj.get("ph") != "X" or obj.get("cat") not in _CATEGORIES or not isinstance(name, str) \
                or not name.startswith("execute_"):
            return None
        kept += 1
        if kept > 2 * MAX_TRACE_STEPS:  # a CPU and a GPU range per step
            raise _TooManySteps()
        return {"ph": "X", "cat": obj["cat"], "name": name, "ts": obj.get("ts"), "dur": obj.get("dur")}
    return keep


def load_chrome_trace(path: str | Path) -> list[Any]:
    """The step-range events of a Chrome trace JSON file (plain or gzip; other events come back as None),
    read through `core.limits` (regular file, size and inflated-size limits, nesting, UTF-8)."""
    text = read_import_text(path, "trace")
    try:
        data = load_json_text(text, path, "trace", object_hook=_step_range_keeper())
    except _TooManySteps:
        raise ConfigError("trace", f"{path} holds more than {MAX_TRACE_STEPS:,} steps (the limit of one trace; "
                                   "profile a shorter window)") from None
    del text
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ConfigError(f"{path}.traceEvents", "must be a list of trace events (not a Chrome trace JSON?)")
    steps = sum(1 for ev in events if isinstance(ev, dict) and ev.get("cat") == CPU_CATEGORY)
    if steps > MAX_TRACE_STEPS:
        raise ConfigError("trace", f"{path} holds {steps:,} steps, more than the limit of {MAX_TRACE_STEPS:,} "
                                   "(profile a shorter window)")
    return events


def _composition(name: str, where: str) -> Optional[dict[str, int]]:
    comp = parse_annotation(name)
    if comp is not None and max(comp.values()) > MAX_IMPORT_NUMBER:
        raise ConfigError(where, f"a step range states a count over the limit of {MAX_IMPORT_NUMBER}: "
                                 f"{printable(name, 80)}")
    return comp


def _step_events(events: list, path: str, category: str) -> list[tuple[float, float, str]]:
    out = []
    for i, ev in enumerate(events):
        if not isinstance(ev, dict) or ev.get("ph") != "X" or ev.get("cat") != category \
                or not isinstance(ev.get("name"), str):
            continue  # (only step ranges reach here as events; an object without "ph" is kept whole)
        where = f"{path}.traceEvents[{i}]"
        if _composition(ev["name"], f"{where}.name") is None:
            continue
        ts = bounded_number(ev.get("ts"), f"{where}.ts")  # microseconds since the profiler's epoch
        dur = bounded_number(ev.get("dur"), f"{where}.dur", low_open=True)  # a step takes time
        out.append((ts * 1e-6, dur * 1e-6, ev["name"], i))
    out.sort()
    if category == CPU_CATEGORY:  # one thread runs the steps one after another
        for (t0, d0, _, _), (t1, _, _, i) in zip(out, out[1:]):
            if t1 < t0 + d0 - _OVERLAP_TOLERANCE_S:
                raise ConfigError(f"{path}.traceEvents[{i}].ts", f"this step range starts {1e6 * (t0 + d0 - t1):.3f} "
                                                               "us before the previous one ends (steps do not overlap)")
    return [(t, d, n) for t, d, n, _ in out]


_OVERLAP_TOLERANCE_S = 1e-6  # the trace's microsecond rounding


def _rank_table(path: str | Path) -> tuple[list[tuple[float, float, str]], Optional[list[float]]]:
    events = load_chrome_trace(path)
    cpu = _step_events(events, str(path), CPU_CATEGORY)
    if not cpu:
        raise ConfigError(str(path), "no execute_context_X(a)_generation_Y(b) ranges (category user_annotation): "
                                     "not a vLLM / servetwin step trace")
    gpu = _step_events(events, str(path), GPU_CATEGORY)
    if gpu and [n for _, _, n in gpu] != [n for _, _, n in cpu]:
        raise ConfigError(str(path), f"{len(gpu)} GPU step annotations do not match the {len(cpu)} CPU ones")
    return cpu, ([d for _, d, _ in gpu] if gpu else None)


def read_profiler_traces(paths: Iterable[str | Path], run: str = "measured",
                         log: Optional[Callable[[str], None]] = None):
    """One row per step (a pandas DataFrame, see the module docstring) from one trace per rank. `log`: a
    line per file read and per PROGRESS_EVERY_STEPS rows built (default: stderr, for large traces only)."""
    import pandas as pd  # noqa: PLC0415

    from servetwin.core.testbed.trace import STEP_COLUMNS  # noqa: PLC0415

    paths = list(paths)
    if not paths:
        raise ConfigError("--measured", "no trace file given")
    ranks = []
    for p in paths:
        ranks.append(_rank_table(p))
        _progress(log, f"trace: {p}: {len(ranks[-1][0]):,} step ranges read", len(ranks[-1][0]))
    cpu0 = ranks[0][0]
    for p, (cpu, _) in zip(paths[1:], ranks[1:]):
        if [n for _, _, n in cpu] != [n for _, _, n in cpu0]:
            raise ConfigError(str(p), f"its steps differ from {paths[0]}'s (ranks of one run have the same steps)")
    cpu_dur = np.max([[d for _, d, _ in cpu] for cpu, _ in ranks], axis=0)
    gpus = [g for _, g in ranks if g is not None]
    gpu_dur = np.max(gpus, axis=0) if gpus else np.full(len(cpu0), np.nan)
    t0 = cpu0[0][0]
    rows = []
    prev_end = None
    for i, ((ts, _, name), dc, dg) in enumerate(zip(cpu0, cpu_dur, gpu_dur)):
        comp = parse_annotation(name)
        start = ts - t0
        row = dict.fromkeys(STEP_COLUMNS, np.nan)
        row.update(run=run, backend="measured", step=i, t_start_s=start, annotation=name, **comp)
        duration = float(dg) if np.isfinite(dg) else float(dc)
        row.update(duration_s=duration, t_end_s=start + float(dc), cpu_duration_s=float(dc), gpu_duration_s=float(dg),
                   gap_before_s=np.nan if prev_end is None else start - prev_end, rank_count=len(paths))
        row["num_reqs"] = comp["num_context_reqs"] + comp["num_generation_reqs"]
        row["total_tokens"] = comp["num_context_tokens"] + comp["num_generation_tokens"]
        rows.append(row)
        if (i + 1) % PROGRESS_EVERY_STEPS == 0:
            _progress(log, f"trace: {i + 1:,}/{len(cpu0):,} step rows built", len(cpu0))
        prev_end = start + float(dc)
    return pd.DataFrame(rows, columns=list(STEP_COLUMNS) + [c for c in EXTRA_COLUMNS])


PROGRESS_EVERY_STEPS = 100_000


def _progress(log: Optional[Callable[[str], None]], msg: str, steps: int) -> None:
    """`log(msg)`; without a `log`, stderr for a large trace only (a line per file is noise for the usual
    few thousand steps, and a 500k-step trace reads for most of a minute)."""
    if log is not None:
        log(msg)
    elif steps >= PROGRESS_EVERY_STEPS:
        print(msg, file=sys.stderr, flush=True)


def detailed_annotation(rows: Iterable[tuple[int, int, bool]]) -> str:
    """vLLM's detailed range name from a step's rows (scheduled tokens q, computed before s, context?)."""
    sums = {True: [0, 0, 0, 0, 0], False: [0, 0, 0, 0, 0]}  # n, q, seq, q2, q*seq
    for q, s, ctx in rows:
        e = sums[bool(ctx)]
        seq = s + q
        e[0] += 1
        e[1] += q
        e[2] += seq
        e[3] += q * q
        e[4] += q * seq
    c, g = sums[True], sums[False]
    return f"execute_{c[1] + g[1]}_context_{c[0]}{_sums_text(c)}_generation_{g[0]}{_sums_text(g)}"


def _sums_text(e: list[int]) -> str:
    return f"(sq{e[1]}sk{e[2]}sqsq{e[3]}sqsk{e[4]})"


def step_table_annotations(steps, step_requests, detailed: bool) -> list[str]:
    """Each step's range name: the table's plain annotation, or the detailed form from its rows."""
    if not detailed:
        return [str(a) for a in steps.annotation.tolist()]
    by_step: dict[int, list[tuple[int, int, bool]]] = {}
    for st, q, s, phase in zip(step_requests.step.to_numpy(), step_requests.num_tokens.to_numpy(),
                               step_requests.num_computed_before.to_numpy(), step_requests.phase.to_numpy()):
        by_step.setdefault(int(st), []).append((int(q), int(s), phase == "context"))
    return [detailed_annotation(by_step.get(int(st), [])) for st in steps.step.to_numpy()]


def write_profiler_trace(steps, path: str | Path, step_requests=None, detailed: bool = False,
                         gpu: bool = True, process: str = "servetwin") -> Path:
    """Write a step table as a Chrome trace (`servetwin.core.testbed.step_ranges`): per step a
    `user_annotation` range (and a `gpu_user_annotation` one when `gpu`) named as vLLM names it, at the
    step's start with its duration; `.gz` paths are gzip-compressed, as vLLM's `*.pt.trace.json.gz`."""
    from servetwin.core.testbed.step_ranges import write_step_ranges  # noqa: PLC0415

    if detailed and step_requests is None:
        raise ValueError("write_profiler_trace: the detailed annotation needs the step_requests table")
    names = step_table_annotations(steps, step_requests, detailed)
    return write_step_ranges(path, zip(names, steps.t_start_s.to_numpy(dtype=float), steps.duration_s.to_numpy(dtype=float)),
                             gpu=gpu, process=process)
