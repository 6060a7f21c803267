"""Measured steps (a profiler trace's step table) matched with the simulator's steps of the same run.

A profiler range names a step's composition (context / generation requests and tokens), not which
requests it ran or how much KV each had. The scheduler is vLLM's and deterministic, so the run's
workload replayed through the simulator with the run's engine settings schedules the same steps: the
two sequences of compositions are matched (`difflib.SequenceMatcher`, longest common runs, in order),
and each matched measured step gets the simulated step's rows (tokens and computed-before per request).
Steps that do not match (a different arrival timing online, a trace that starts mid-run) are left out
and counted. The result feeds `servetwin compare --measured` (predicted vs measured per phase) and
`servetwin calibrate --from-vllm` (the cost model fitted to the measured durations).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from servetwin.core.config_error import ConfigError

KEY = ("num_context_reqs", "num_context_tokens", "num_generation_reqs", "num_generation_tokens")


@dataclass(slots=True)
class MatchedSteps:
    steps: Any  # the simulator's step rows of the matched steps, `duration_s` = the measured duration
    step_requests: Any  # the simulator's rows of those steps
    predicted_s: np.ndarray  # the simulator's duration of each matched step
    measured_index: np.ndarray  # row positions in the measured table
    measured_total: int
    simulated_total: int
    cost_model: Any

    @property
    def share(self) -> float:
        return len(self.measured_index) / self.measured_total if self.measured_total else 0.0


def composition_keys(steps) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in row) for row in steps[list(KEY)].to_numpy()]


def load_sim_experiment(path: str, overrides: Optional[list[str]] = None, hardware: Any = None):
    """An experiment YAML for the simulator alone, step rows recorded (`hardware`: replaces its own)."""
    from servetwin.experiments.config.schema import load_config  # noqa: PLC0415

    values: dict[str, Any] = {"backends": ["sim"], "output.step_requests": True, "output.plots": False}
    if hardware is not None:
        values["hardware"] = hardware
    return load_config(path, overrides=list(overrides or []), values=values)


def simulate(exp, log: Callable[[str], None] = lambda m: None) -> tuple[dict, Any]:
    """A `load_sim_experiment` run: (its trace frames, its cost model)."""
    from servetwin.experiments.run.runner import run_backends  # noqa: PLC0415

    _, frames, runs = run_backends(exp, progress=False, log=log)
    run = runs["sim"]
    if run.error:
        raise ConfigError("workload", f"the simulator could not run it: {run.error}")
    return frames["sim"], run.info.executor.cost_model


def match_steps(measured, exp, log: Callable[[str], None] = lambda m: None,
                frames: Optional[dict] = None, cost_model: Any = None) -> MatchedSteps:
    """Match a measured step table with the simulated run of `exp` (see the module docstring)."""
    if frames is None:
        frames, cost_model = simulate(exp, log)
    sim_steps, sim_rows = frames["steps"], frames["step_requests"]
    a, b = composition_keys(measured), composition_keys(sim_steps)
    blocks = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks()
    mi = np.array([blk.a + k for blk in blocks for k in range(blk.size)], dtype=int)
    si = np.array([blk.b + k for blk in blocks for k in range(blk.size)], dtype=int)
    if not len(mi):
        raise ConfigError("--measured", "no measured step matches a simulated one: is the experiment the "
                                        "measured run (same requests, order and engine settings)?")
    matched = sim_steps.iloc[si].copy()
    predicted = matched.duration_s.to_numpy(dtype=float).copy()
    matched["duration_s"] = measured.duration_s.to_numpy(dtype=float)[mi]
    keep = set(int(s) for s in matched.step)
    rows = sim_rows[sim_rows.step.isin(keep)]
    return MatchedSteps(matched, rows, predicted, mi, len(measured), len(sim_steps), cost_model)


def by_phase(m: MatchedSteps) -> dict[str, dict[str, Any]]:
    """Per phase class (prefill, decode, mixed, all): steps, median and p90 |error| %, median signed
    error %, measured and predicted total seconds (error = (predicted - measured) / measured)."""
    from servetwin.experiments.calibrate.design import step_phase_class  # noqa: PLC0415

    meas = m.steps.duration_s.to_numpy(dtype=float)
    phases = np.array([step_phase_class(int(c), int(g)) for c, g in
                       zip(m.steps.num_context_reqs.to_numpy(), m.steps.num_generation_reqs.to_numpy())])
    ok = meas > 0
    err = np.where(ok, (m.predicted_s - meas) / np.where(ok, meas, 1.0), np.nan) * 100.0
    out = {}
    for name in ("prefill", "decode", "mixed", "all"):
        sel = ok & ((phases == name) if name != "all" else True)
        if not sel.any():
            continue
        e = err[sel]
        out[name] = {"steps": int(sel.sum()), "abs_pct_p50": float(np.median(np.abs(e))),
                     "abs_pct_p90": float(np.quantile(np.abs(e), 0.9)), "signed_pct_p50": float(np.median(e)),
                     "measured_s": float(meas[sel].sum()), "predicted_s": float(m.predicted_s[sel].sum())}
    return out


def render_phases(m: MatchedSteps, table: dict[str, dict[str, Any]]) -> str:
    lines = [f"matched {len(m.measured_index)} of {m.measured_total} measured steps "
             f"({100 * m.share:.1f}%; the simulator ran {m.simulated_total})", "",
             "| phase | steps | per-step abs err p50 | p90 | signed p50 | measured s | predicted s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in table.items():
        lines.append(f"| {name} | {r['steps']} | {r['abs_pct_p50']:.2f}% | {r['abs_pct_p90']:.2f}% | "
                     f"{r['signed_pct_p50']:+.2f}% | {r['measured_s']:.4f} | {r['predicted_s']:.4f} |")
    return "\n".join(lines)
