"""Shared helpers for the integration tests: run one workload through the sim and the torch backend,
compare their traces and check the scheduler invariants on every step row."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.testbed.iteration import parse_annotation
from servetwin.core.testbed.trace import TraceRecorder

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# the step columns that are scheduling decisions (everything but run/backend and the clock)
STEP_DECISION_COLUMNS = [
    "step", "num_reqs", "num_context_reqs", "num_context_tokens", "num_generation_reqs",
    "num_generation_tokens", "total_tokens", "annotation", "sum_q2", "sum_q_kv", "sum_kv", "max_kv",
    "num_running", "num_waiting", "num_preempted", "num_finished", "kv_free_blocks", "kv_usage",
    "prefix_queries", "prefix_hits", "shared_kv_tokens",
]
STEP_REQUEST_DECISION_COLUMNS = ["step", "request_id", "num_tokens", "num_computed_before", "phase", "samples"]
REQUEST_DECISION_COLUMNS = ["request_id", "parent_id", "prompt_tokens", "cached_tokens", "output_tokens",
                            "num_preemptions", "finish_reason"]


@dataclass
class Scenario:
    """Engine settings (EngineArgs names) and the workload, in offline order. `model` is a built-in
    tiny model; the sim reads its config.json (tiny-llama is also a sim preset)."""
    engine: dict[str, Any]
    requests: list[Any] = field(default_factory=list)  # servetwin.sim.workload.WorkloadRequest, arrival_s == 0
    model: str = "tiny-llama"

    def engine_args(self, backend: str) -> EngineArgs:
        kw = dict(self.engine)
        model = self.model
        if backend == "torch":
            kw.update(device="cpu", dtype=kw.get("dtype", "float32"))
        elif model != "tiny-llama":
            from servetwin.gpu.models.registry import resolve_model  # noqa: PLC0415 (builds it once)
            model = str(resolve_model(model).path)
            # The sim prices experts by their storage format and knows no float32 MoE kernel (vLLM serves
            # MoE in bf16 or lower). Offline decisions never read the step time and the pool size is
            # given, so the sim's dtype changes its clock only, never a decision.
            kw.setdefault("dtype", "bfloat16")
        return EngineArgs.from_kwargs(model=model, backend=backend, **kw)


class SchedulerOutputLog:
    """Wraps an engine's executor and keeps, per executed step, what the scheduler decided: tokens per
    request, the block ids handed out per KV cache group (new and resumed requests: all of them;
    running ones: the new ones), and the preempted requests. Token ids are left out: the sim's are fake."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.steps: list[dict[str, Any]] = []

    def execute_model(self, so: Any) -> Any:
        cached = so.scheduled_cached_reqs
        blocks = {r.req_id: ("new", r.num_computed_tokens, r.block_ids) for r in so.scheduled_new_reqs}
        for rid, ids, s in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            blocks[rid] = ("resumed" if rid in cached.resumed_req_ids else "running", s, ids)
        self.steps.append(dict(tokens=dict(so.num_scheduled_tokens), blocks=blocks,
                               preempted=sorted(so.preempted_req_ids), finished=sorted(so.finished_req_ids)))
        return self.inner.execute_model(so)

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped executor's
        return getattr(self.inner, name)


def assert_same_scheduler_outputs(a: SchedulerOutputLog, b: SchedulerOutputLog) -> None:
    assert len(a.steps) == len(b.steps), f"executed steps differ: sim {len(a.steps)} vs torch {len(b.steps)}"
    for i, (x, y) in enumerate(zip(a.steps, b.steps)):
        assert x == y, f"step {i}: sim {x} != torch {y}"


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> Any:
    """Import `benchmarks/<name>.py` (a script, not a package module) as a module."""
    spec = importlib.util.spec_from_file_location(f"servetwin_bench_{name}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_case_dir(case_dir: Path, cases: dict[str, str], metric: str) -> None:
    """A `servetwin validate` directory: cases/NAME.yaml from `cases`, and a placeholder published.json
    with one `metric` per case (overwritten by `publish`)."""
    (case_dir / "cases").mkdir()
    for name, text in cases.items():
        (case_dir / "cases" / f"{name}.yaml").write_text(text)
    (case_dir / "published.json").write_text(json.dumps({n: {"source": "test", "published": {metric: 1.0}}
                                                         for n in cases}))


def publish(case_dir: Path, results: list, metric: str, source: str) -> None:
    """Write validate results' predictions of `metric` (each case's first row) as the 'published' figures."""
    published = {r.name: {"source": source, "published": {metric: r.rows[0][2]}} for r in results}
    (case_dir / "published.json").write_text(json.dumps(published))


def run_sim(scenario: Scenario, fast_forward: bool = True,
            log: Optional[list[SchedulerOutputLog]] = None) -> tuple[dict[str, pd.DataFrame], Any]:
    """Offline sim run; with `log` (a list), its executor is wrapped in a SchedulerOutputLog appended there."""
    from servetwin.sim.arrivals import Offline  # noqa: PLC0415
    from servetwin.sim.engine import Simulation  # noqa: PLC0415

    engine, info = create_engine_core(scenario.engine_args("sim"))
    _attach_log(engine, log)
    sim = Simulation(engine, [replace(r) for r in scenario.requests], Offline(), run="twin",
                     fast_forward=fast_forward)
    result = sim.run()
    assert not result.rejected, result.rejected
    assert not result.unfinished, result.unfinished
    return sim.recorder.frames(), info


def _attach_log(engine: Any, log: Optional[list[SchedulerOutputLog]]) -> None:
    if log is not None:
        engine.executor = SchedulerOutputLog(engine.executor)
        log.append(engine.executor)


def run_torch(scenario: Scenario,
              log: Optional[list[SchedulerOutputLog]] = None) -> tuple[dict[str, pd.DataFrame], Any]:
    """Offline torch run (CPU, float32); `log` as in `run_sim`."""
    from servetwin.core.testbed.realtime import run_realtime  # noqa: PLC0415

    engine, info = create_engine_core(scenario.engine_args("torch"))
    _attach_log(engine, log)
    recorder = TraceRecorder("twin", "torch")
    rejected: dict[str, str] = {}
    run_realtime(engine, [replace(r) for r in scenario.requests], recorder, offline=True, rejected=rejected)
    assert not rejected, rejected
    return recorder.frames(), info


def _decisions(frames: dict[str, pd.DataFrame]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    steps = frames["steps"][STEP_DECISION_COLUMNS].reset_index(drop=True)
    sreq = (frames["step_requests"][STEP_REQUEST_DECISION_COLUMNS]
            .sort_values(["step", "request_id"], kind="stable").reset_index(drop=True))
    reqs = (frames["requests"][REQUEST_DECISION_COLUMNS]
            .sort_values("request_id", kind="stable").reset_index(drop=True))
    return steps, sreq, reqs


def first_difference(a: pd.DataFrame, b: pd.DataFrame) -> str:
    if len(a) != len(b):
        return f"row counts differ: sim {len(a)} vs torch {len(b)}"
    for i in range(len(a)):
        ra, rb = a.iloc[i].to_dict(), b.iloc[i].to_dict()
        if ra != rb:
            diff = {k: (ra[k], rb.get(k)) for k in ra if ra[k] != rb.get(k)}
            return f"row {i}: {diff} (sim, torch); sim row {ra}"
    return "no difference"


def assert_same_decisions(fs: dict[str, pd.DataFrame], ft: dict[str, pd.DataFrame]) -> None:
    for name, a, b in zip(("steps", "step_requests", "requests"), _decisions(fs), _decisions(ft)):
        assert a.equals(b), f"{name} differ between sim and torch: {first_difference(a, b)}"


def check_step_invariants(frames: dict[str, pd.DataFrame], *, max_num_batched_tokens: int, max_num_seqs: int,
                          num_gpu_blocks: int, max_model_len: int,
                          expected_outputs: Optional[dict[str, int]] = None) -> None:
    """Every step row and every request row of one trace obeys the scheduler's limits and the schema."""
    steps, sreq, reqs = frames["steps"], frames["step_requests"], frames["requests"]
    assert len(steps) > 0
    assert steps.step.is_unique and steps.step.is_monotonic_increasing
    usable = num_gpu_blocks - 1
    per_step = {s: g for s, g in sreq.groupby("step")}
    for row in steps.itertuples(index=False):
        where = f"step {row.step} ({row.backend}): {row._asdict()}"
        assert 0 < row.total_tokens <= max_num_batched_tokens, where
        assert row.num_running <= max_num_seqs and row.num_reqs <= max_num_seqs, where
        assert row.num_reqs <= row.num_running, where  # everything scheduled is running
        assert row.num_context_tokens + row.num_generation_tokens == row.total_tokens, where
        assert row.num_context_reqs + row.num_generation_reqs == row.num_reqs, where
        # one token per decode (a request resumed after preemption recomputes as "generation")
        assert row.num_generation_tokens >= row.num_generation_reqs, where
        assert 0 <= row.kv_free_blocks <= usable, where
        assert abs(row.kv_usage - (1.0 - row.kv_free_blocks / usable)) < 1e-9, where
        assert 0 <= row.prefix_hits <= row.prefix_queries, where
        assert 0 < row.max_kv <= row.sum_kv and row.max_kv <= max_model_len, where
        assert row.sum_q2 <= row.sum_q_kv, where  # q <= kv for every request
        ann = parse_annotation(row.annotation)
        assert (ann.num_ctx_requests, ann.num_ctx_tokens, ann.num_generation_requests,
                ann.num_generation_tokens) == (row.num_context_reqs, row.num_context_tokens,
                                               row.num_generation_reqs, row.num_generation_tokens), where
        g = per_step[row.step]
        q = g.num_tokens
        kv = g.num_computed_before + g.num_tokens
        assert len(g) == row.num_reqs and g.request_id.is_unique, where
        assert int(q.sum()) == row.total_tokens, where
        assert int((q * q).sum()) == row.sum_q2 and int((q * kv).sum()) == row.sum_q_kv, where
        assert int(kv.sum()) == row.sum_kv and int(kv.max()) == row.max_kv, where
        ctx = g[g.phase == "context"]
        assert len(ctx) == row.num_context_reqs and int(ctx.num_tokens.sum()) == row.num_context_tokens, where
    assert set(per_step) == set(steps.step)
    # per request: computed tokens grow chunk by chunk, restarting only after a preemption
    prompt_len = dict(zip(reqs.request_id, reqs.prompt_tokens))
    preemptions = dict(zip(reqs.request_id, reqs.num_preemptions))
    for rid, g in sreq.sort_values("step", kind="stable").groupby("request_id"):
        done, restarts = None, 0
        for r in g.itertuples(index=False):
            if done is not None and r.num_computed_before != done:
                assert r.num_computed_before < done, (rid, r)
                restarts += 1
            done = r.num_computed_before + r.num_tokens
            if preemptions[rid] > 0:
                continue  # recomputation after a preemption may be chunked in either phase
            if r.phase == "generation":
                assert r.num_tokens == 1 and r.samples, (rid, r)
            else:
                # a prefill chunk samples exactly when it reaches the end of the prompt
                assert r.samples == (done == prompt_len[rid]), (rid, r)
        assert restarts <= preemptions[rid], (rid, restarts, preemptions[rid])
    assert int(steps.num_preempted.sum()) == int(reqs.num_preemptions.sum())
    assert int(steps.num_finished.sum()) == len(reqs)
    assert (reqs.finish_reason == "length").all(), reqs
    if expected_outputs is not None:
        assert dict(zip(reqs.request_id, reqs.output_tokens)) == expected_outputs
