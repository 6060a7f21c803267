"""Per-step costs of the fused implicit-decode step's three parts, one step at a time and in bulk.

`Simulation._fused_step` (sim/engine.py) prices, records and hands on each quiet step with three calls:
`CostModel.decode_duration`, `TraceRecorder.on_implicit_step` and `ApiServerFrontend.on_step_output`. A
window of n quiet steps can use their bulk forms instead: `CostModel.decode_durations`,
`TraceRecorder.on_implicit_steps` and `ApiServerFrontend.on_step_outputs_at` (the same floats, rows and
state: tests/core/test_core_trace_bulk.py, tests/sim/test_sim_frontend_bulk.py,
tests/sim/test_sim_decode_durations.py). This script times each, in microseconds per step, for a batch of
`--batch` requests over runs of `--steps` steps (a cluster engine's quiet run: 4 requests, a few dozen
steps), on gpt-oss-120b / H100 with vLLM's API-server front end (one server, its handler keeping up).

`--baseline REF` (a git ref or a servetwin checkout): the same timings of that checkout's single-step
calls in a fresh process, interleaved with this checkout's (`--repeats` each), so that a loaded machine
hits both alike; the table gives both and their ratio. The bulk forms exist in this checkout only.

    python benchmarks/fused_step_costs.py --baseline main --repeats 3

Measured (2026-12-06 14:21 UTC, the shared 2-core machine, load ~2.4: ratios only), `--baseline` 8b47cd0 (the
checkout before this work), `--repeats 3 --runs 100`, us per step, this / baseline:
    decode_duration     0.78 / 1.42  (0.55)   decode_durations    0.66
    on_implicit_step    1.75 / 3.20  (0.55)   on_implicit_steps   0.80
    on_step_output      2.26 / 3.72  (0.61)   on_step_outputs_at  2.14
    the three           4.79 / 8.33  (0.58)   in bulk             3.61
(`on_implicit_step` includes building its `ImplicitDecodes`, as the fused step does.) On the routing ladder's
first 810 requests (benchmarks/cluster_speed.py's cut), the simulation loop alone, the two checkouts one after
the other, twice: 4.1 / 3.4 s before, 2.9 / 2.7 s after (load 2-2.4); its outputs (step, request and router
tables, trace.json) byte-identical, also for 2,070 requests and for the single-engine bench (2,000 requests).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("decode_duration", "decode_durations", "on_implicit_step", "on_implicit_steps", "on_step_output",
         "on_step_outputs_at")


class _Clock:
    """The front end's view of SimPy for quiet outputs: a clock the caller sets (no event is created)."""

    def __init__(self) -> None:
        self.now = 0.0

    def timeout(self, delay):  # (quiet outputs never wait: a call here is a wrong benchmark)
        raise AssertionError("a quiet step's output created a SimPy timer")

    def event(self):
        raise AssertionError("no request is submitted here")


def _times(n: int, t0: float, d: float) -> tuple[list[float], list[float]]:
    starts = [t0 + i * d for i in range(n)]
    return starts, [t + d for t in starts]


def measure(batch: int, steps: int, runs: int) -> dict[str, float]:
    """Microseconds per step of each case available in the imported servetwin (best of 5 timings)."""
    from servetwin.core.sched.output import ImplicitDecodes
    from servetwin.core.testbed.trace import TraceRecorder
    from servetwin.sim.cost_model import CostModel
    from servetwin.sim.frontend import ApiServerFrontend, load_frontend_spec

    cm = CostModel("gpt-oss-120b", "h100-sxm", async_scheduling=True)
    d = cm.decode_duration(batch, batch * 2000)
    usage, free, shared = [0.25] * steps, [5000] * steps, [512] * steps
    out: dict[str, float] = {}

    def best(fn, setup=None) -> float:
        samples = []
        for _ in range(5):
            state = setup() if setup else None
            samples.append(timeit.timeit(lambda: fn(state), number=runs) / (runs * steps) * 1e6)
        return min(samples)

    def single_cost(_):
        for i in range(steps):
            cm.decode_duration(batch, batch * 2000 + i * batch, 512)
    out["decode_duration"] = best(single_cost)
    if hasattr(cm, "decode_durations"):
        out["decode_durations"] = best(lambda _: cm.decode_durations(batch, batch * 2000, 512, steps))

    def recorder():
        return [TraceRecorder("run", "sim"), 0]

    def single_trace(state):
        rec, s = state
        starts, ends = _times(steps, s * d, d)
        for i in range(steps):
            rec.on_implicit_step(s + i, s + i, starts[i], ends[i], ImplicitDecodes(batch, 2000 * batch + i * batch, 2100 + i),
                                 batch, 5000, 0.25, 512, s + i - 1)
        state[1] = s + steps
    out["on_implicit_step"] = best(single_trace, recorder)
    if hasattr(TraceRecorder, "on_implicit_steps"):
        def bulk_trace(state):
            rec, s = state
            starts, ends = _times(steps, s * d, d)
            rec.on_implicit_steps(s, s, starts, ends, ImplicitDecodes(batch, 2000 * batch, 2100), batch, free, usage,
                                  shared, s - 1)
            state[1] = s + steps
        out["on_implicit_steps"] = best(bulk_trace, recorder)

    def frontend():
        clock = _Clock()
        return [ApiServerFrontend(clock, load_frontend_spec("vllm"), "completions", None), clock, 0.0]

    def single_output(state):
        fe, clock, t = state
        for i in range(steps):
            t += d
            clock.now = t
            fe.on_step_output(t, batch, 0, [])
        state[2] = t
    out["on_step_output"] = best(single_output, frontend)
    if hasattr(ApiServerFrontend, "on_step_outputs_at"):
        def bulk_output(state):
            fe, clock, t = state
            ends = [t + (i + 1) * d for i in range(steps)]
            fe.on_step_outputs_at(ends, ends, batch)
            state[2] = clock.now = ends[-1]
        out["on_step_outputs_at"] = best(bulk_output, frontend)
    return out


def _child(checkout: Path, args: argparse.Namespace, tmp: str) -> dict[str, float]:
    """`measure` in a fresh process importing `checkout` as servetwin."""
    link_dir = Path(tmp, f"link-{abs(hash(str(checkout)))}")
    if not link_dir.exists():
        link_dir.mkdir()
        os.symlink(checkout, link_dir / "servetwin")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--batch", str(args.batch), "--steps",
           str(args.steps), "--runs", str(args.runs)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(link_dir)),
                         cwd=tmp)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: measuring failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="git ref (or an existing checkout) whose single-step calls to time too")
    ap.add_argument("--batch", type=int, default=4, help="requests in the batch (default 4)")
    ap.add_argument("--steps", type=int, default=32, help="steps per run (the bulk forms' n; default 32)")
    ap.add_argument("--runs", type=int, default=200, help="runs per timing (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per checkout, interleaved (default 3)")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # (the child process)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.batch, args.steps, args.runs)))
        return
    from sim_speed_process import baseline_checkout  # noqa: PLC0415  (benchmarks/ is on sys.path)

    with tempfile.TemporaryDirectory() as tmp:
        checkouts = {"this": ROOT}
        made = False
        if args.baseline:
            checkouts["baseline"], made = baseline_checkout(args.baseline, tmp)
        try:
            runs: dict[str, list[dict[str, float]]] = {label: [] for label in checkouts}
            for _ in range(args.repeats):
                for label, checkout in checkouts.items():
                    runs[label].append(_child(checkout, args, tmp))
        finally:
            if made:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkouts["baseline"])],
                               capture_output=True)
    med = {label: {case: statistics.median(r[case] for r in rs) for case in CASES if all(case in r for r in rs)}
           for label, rs in runs.items()}
    print(f"us per step (median of {args.repeats} processes, best of 5 timings each; batch {args.batch}, "
          f"runs of {args.steps} steps)")
    print(f"{'case':22s} {'this':>9s}" + (f" {'baseline':>9s} {'this/base':>9s}" if args.baseline else ""))
    for case in CASES:
        if case not in med["this"]:
            continue
        line = f"{case:22s} {med['this'][case]:9.3f}"
        if args.baseline:
            base = med["baseline"].get(case)
            line += f" {base:9.3f} {med['this'][case] / base:9.2f}" if base else f" {'-':>9s} {'-':>9s}"
        print(line)
    singles = ("decode_duration", "on_implicit_step", "on_step_output")
    bulks = ("decode_durations", "on_implicit_steps", "on_step_outputs_at")
    this = med["this"]
    print(f"the three, one step at a time: {sum(this[c] for c in singles):.3f} us; in bulk: "
          f"{sum(this[c] for c in bulks):.3f} us per step")
    if args.baseline:
        print(f"baseline, one step at a time: {sum(med['baseline'][c] for c in singles):.3f} us")


if __name__ == "__main__":
    main()
