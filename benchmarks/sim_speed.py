"""Simulator speed on `experiments/configs/bench_h100_llama8b.yaml`: simulated seconds per wall second,
steps per second and requests per second.

Target: >= 1000x real time; below 200x is reported as a failure. For scale, Vidur 0.0.26 manages
about 15x on a similar workload on this machine class. The simulator runs steady decodes implicitly
(sim/scheduler.py + sim/lazy_decode.py, exact); `--variants` also runs without them, and in sync
scheduling with the decode fast-forward (sim/fast_forward.py) and step by step.
`--breakdown` also runs the same requests (arrivals, prompts) with one output token each - the
per-request and per-step floor (admission, prefix hashing, prefill, completion, one engine step per
arrival) - and splits the wall time into that floor and the per-row cost of decode steps.

`--bounds` times, alone, the prefix-cache block hashes vLLM's state holds (one sha256 per full block)
plus one SimPy event and one cost-model prediction per step, and prints the speed that work caps.

`--compare DIR` times another checkout of servetwin (e.g. `git worktree add /tmp/before <commit>`)
side by side with this one on the same config, "as configured": `--repeats` fresh processes each,
interleaved (before, after, after, before, ...) so the machine's drift hits both alike; it prints
every run, the medians and the ratios of the speed (wall) and of the CPU time each run used (less
disturbed by other load on a shared machine).

`--compiled` times this checkout's pure-Python source (SERVETWIN_PURE_PYTHON=1) side by side with
its optional compiled build (scripts/build_compiled.py, `make build-compiled`: mypyc), the same way;
besides the loop it reports each whole process (interpreter start, imports, engine build, the run):
its wall time and the CPU time it used.
Measured 2026-12-02 (`--compiled --repeats 3`, bench_h100_llama8b.yaml, 10k requests, 30,098 steps,
333.8 simulated s; the 2-core VM shared with other sessions; 15 modules compiled by mypyc 2.4.1):
    build      loop x real time     loop cpu s    process wall s    process cpu s   (medians)
    pure             69.7               5.05            5.59              5.45
    compiled        105.2               3.44            3.76              3.85
    compiled/pure   1.51x faster        0.68            0.67              0.71
(single runs: pure 65.5-71.7x, compiled 96.5-114.4x.) A second invocation (`--repeats 2`): loop
61.1x -> 86.5x (1.42x), loop CPU 6.01 -> 4.32 s, process wall 6.50 -> 4.76 s, process CPU 6.53 -> 4.83 s.
Traces and tables of `servetwin run` on this config are byte-identical between the two builds
(docs/compiled_build.md has the rest).

`--breakdown`, 2026-12-02 10:40 UTC, everything else paused, two runs of each build (29,881 steps):
    build      loop x     floor per request    per decode row    ceiling with decode rows free
    pure      81-82x        185-190 us          1.13-1.14 us           176-181x
    compiled  98-114x       129-132 us          0.81-1.07 us           252-260x
The floor (admission, prefix hashing, prefill, completion and the engine step each arrival brings:
vLLM's own per-request path) caps the loop below 400x even if every decode row cost nothing.

Usage: python benchmarks/sim_speed.py [--requests N] [--variants] [--breakdown] [--bounds]
       python benchmarks/sim_speed.py --compare DIR [--repeats 3] [--requests N]
       python benchmarks/sim_speed.py --compiled [--repeats 3] [--requests N]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servetwin.core.engine.engine_args import EngineArgs  # noqa: E402
from servetwin.core.engine.engine_factory import create_engine_core  # noqa: E402
from servetwin.sim.engine import Simulation  # noqa: E402
from servetwin.sim.workload import build_workload, rng_streams  # noqa: E402


def run_once(cfg: dict, requests: int, async_scheduling: bool, fast_forward: bool,
             max_tokens: int | None = None, lazy_decode: bool = True) -> dict:
    engine_kw = dict(cfg["engine"], async_scheduling=async_scheduling)
    args = EngineArgs.from_kwargs(model=cfg["model"], backend="sim", hardware=cfg["hardware"],
                                  skip_tokenizer_init=True, **engine_kw)
    engine, info = create_engine_core(args)
    spec, reqs = build_workload(dict(cfg["workload"], requests=requests), vocab_size=info.vocab_size)
    if max_tokens is not None:
        reqs = [dataclasses.replace(r, max_tokens=max_tokens) for r in reqs]
    sim = Simulation(engine, reqs, spec.arrival, rng=rng_streams(spec.seed)["runtime"],
                     record_step_requests=False, fast_forward=fast_forward, lazy_decode=lazy_decode)
    t0 = time.perf_counter()
    res = sim.run()
    wall = time.perf_counter() - t0
    return {"simulated_s": res.end_time_s, "wall_s": wall, "steps": res.num_steps,
            "completed": len(res.completion_s), "x": res.end_time_s / wall,
            "rows": sum(sim.recorder.steps.column("num_reqs")),
            "steps_per_s": res.num_steps / wall, "req_per_s": len(res.completion_s) / wall}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "experiments/configs/bench_h100_llama8b.yaml"))
    ap.add_argument("--requests", type=int, default=None, help="override workload.requests")
    ap.add_argument("--variants", action="store_true", help="also sync scheduling, with and without fast-forward")
    ap.add_argument("--breakdown", action="store_true",
                    help="also the one-output-token floor run and the wall-time split")
    ap.add_argument("--bounds", action="store_true",
                    help="also time vLLM's block hashes and the per-step minimum alone")
    ap.add_argument("--compare", metavar="DIR", help="time this other servetwin checkout side by side")
    ap.add_argument("--compiled", action="store_true",
                    help="time the pure-Python source and the compiled build of this checkout side by side")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side with --compare or --compiled (default 3)")
    args = ap.parse_args(argv)
    cfg = yaml.safe_load(open(args.config))
    n = args.requests or cfg["workload"]["requests"]
    if args.compare:
        compare(Path(args.compare).resolve(), args.config, n, args.repeats)
        return
    if args.compiled:
        compare_compiled(args.config, n, args.repeats)
        return
    async_cfg = bool(cfg["engine"].get("async_scheduling", False))
    cases = [("as configured", async_cfg, True, True)]
    if args.variants:
        cases += [("  no implicit decodes", async_cfg, True, False),
                  ("sync", False, True, True), ("sync + fast-forward", False, True, False),
                  ("sync, step by step", False, False, False)]
    print(f"{cfg['name']}: {n} requests, {cfg['model']} on {cfg['hardware']}")
    print(f"{'case':<22}{'simulated s':>12}{'wall s':>9}{'x real time':>13}{'steps/s':>10}{'req/s':>9}")
    results = []
    for label, async_sched, ff, lazy in cases:
        r = run_once(cfg, n, async_sched, ff, lazy_decode=lazy)
        results.append(r)
        verdict = "" if r["x"] >= 1000 else ("  (below the 1000x target)" if r["x"] >= 200
                                             else "  (FAILURE: below 200x)")
        print(f"{label:<22}{r['simulated_s']:>12.1f}{r['wall_s']:>9.2f}{r['x']:>13.1f}"
              f"{r['steps_per_s']:>10.0f}{r['req_per_s']:>9.0f}{verdict}")
    if args.breakdown:
        breakdown(cfg, n, results[0])
    if args.bounds:
        bounds(cfg, n, results[0])


# A fresh interpreter that imports `servetwin` from checkout CHECKOUT (the repo root is the package:
# a folder holding a `servetwin` link to it goes first on sys.path) and runs that checkout's own
# `benchmarks/sim_speed.py:run_once` on the config as configured.
_CHILD = """
import importlib.util, json, os, sys, yaml
link_dir, checkout, config, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, link_dir)
import servetwin
import servetwin.core.sched.scheduler as scheduler_module
assert os.path.realpath(scheduler_module.__file__).startswith(checkout + "/"), (scheduler_module.__file__, checkout)
spec = importlib.util.spec_from_file_location("sim_speed_under_test", checkout + "/benchmarks/sim_speed.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
cfg = yaml.safe_load(open(config))
import dataclasses
from servetwin.core.engine.engine_args import EngineArgs
known = {f.name for f in dataclasses.fields(EngineArgs)}  # settings newer than the checkout are left out
dropped = sorted(set(cfg["engine"]) - known)
cfg["engine"] = {k: v for k, v in cfg["engine"].items() if k in known}
import time
cpu0 = time.process_time()
r = mod.run_once(cfg, n, bool(cfg["engine"].get("async_scheduling", False)), True)
r["cpu_s"] = time.process_time() - cpu0  # engine + workload build and the run, on this process's CPU
r["dropped"] = dropped
r["compiled"] = len(getattr(servetwin, "compiled_modules", list)())
print(json.dumps(r))
"""


def _run_checkout(checkout: Path, config: str, n: int, env_extra: dict | None = None) -> dict:
    """The child's figures, plus `cpu_s`: the CPU time of its `run_once` (engine and workload build
    included, imports not), which a shared machine's other load disturbs less than the wall time;
    `process_wall_s` / `process_cpu_s`: the whole child process (interpreter start and imports too)."""
    with tempfile.TemporaryDirectory() as link_dir:
        os.symlink(checkout, os.path.join(link_dir, "servetwin"))
        env = dict(os.environ, PYTHONPATH="", **(env_extra or {}))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _CHILD, link_dir, str(checkout), config, str(n)],
                             capture_output=True, text=True, env=env, cwd=link_dir)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"the run of {checkout} failed:\n{out.stderr[-4000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["process_wall_s"] = wall
    r["process_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return r


def compare(other: Path, config: str, n: int, repeats: int) -> None:
    """Medians of `repeats` interleaved runs of `other` ("before") and this checkout ("after")."""
    if not (other / "benchmarks" / "sim_speed.py").is_file() or not (other / "__init__.py").is_file():
        raise SystemExit(f"--compare: {other} is not a servetwin checkout (no benchmarks/sim_speed.py)")
    print(f"{Path(config).name}: {n} requests, as configured; before = {other}, after = {ROOT}")
    side_by_side({"before": (other, {}), "after": (ROOT, {})}, config, n, repeats, "checkout")


def compare_compiled(config: str, n: int, repeats: int) -> None:
    """This checkout's pure-Python source ("pure") against its compiled build ("compiled")."""
    sides = {"pure": (ROOT, {"SERVETWIN_PURE_PYTHON": "1"}), "compiled": (ROOT, {"SERVETWIN_PURE_PYTHON": "0"})}
    print(f"{Path(config).name}: {n} requests, as configured; {ROOT}: pure Python vs the compiled build")
    runs = side_by_side(sides, config, n, repeats, "build")
    if runs["compiled"][0]["compiled"] == 0:
        print("note: nothing ran compiled (no build here): run scripts/build_compiled.py (make build-compiled)")


def side_by_side(sides: dict[str, tuple[Path, dict]], config: str, n: int, repeats: int,
                 kind: str) -> dict[str, list[dict]]:
    """`repeats` runs of each side (label -> (checkout, extra environment)), interleaved (a, b, b,
    a, ...), then the medians and the second side's ratios to the first."""
    (a, b) = sides
    runs: dict[str, list[dict]] = {a: [], b: []}
    print(f"{'run':<6}{kind:<10}{'loop wall s':>12}{'x real time':>13}{'steps/s':>10}{'cpu s':>8}"
          f"{'process wall s':>16}{'process cpu s':>15}")
    for i in range(repeats):
        for label in ((a, b) if i % 2 == 0 else (b, a)):
            checkout, env = sides[label]
            r = _run_checkout(checkout, config, n, env)
            runs[label].append(r)
            print(f"{i + 1:<6}{label:<10}{r['wall_s']:>12.2f}{r['x']:>13.1f}{r['steps_per_s']:>10.0f}"
                  f"{r['cpu_s']:>8.2f}{r['process_wall_s']:>16.2f}{r['process_cpu_s']:>15.2f}", flush=True)
    for label, rs in runs.items():
        if rs[0].get("dropped"):
            print(f"note: {label} does not know engine settings {rs[0]['dropped']}: left out of its runs")
    if runs[a][0]["steps"] != runs[b][0]["steps"] or runs[a][0]["simulated_s"] != runs[b][0]["simulated_s"]:
        print("note: the two sides simulate different runs (steps or simulated time differ)")
    for key, what, better in (("x", "x real time (loop)", "> 1"), ("cpu_s", "cpu s (loop)", "< 1"),
                              ("process_wall_s", "process wall s", "< 1"), ("process_cpu_s", "process cpu s", "< 1")):
        med = {label: statistics.median(r[key] for r in rs) for label, rs in runs.items()}
        print(f"median {what}: {a} {med[a]:.2f}, {b} {med[b]:.2f}, {b}/{a} {med[b] / med[a]:.3f} "
              f"({better}: {b} is faster)")
    return runs


def breakdown(cfg: dict, n: int, full: dict) -> None:
    """Wall time = floor (same requests, 1 output token) + the rows of the decode steps."""
    async_sched = bool(cfg["engine"].get("async_scheduling", False))
    floor = run_once(cfg, n, async_sched, True, max_tokens=1)
    extra_rows = full["rows"] - floor["rows"]
    per_row_us = (full["wall_s"] - floor["wall_s"]) / extra_rows * 1e6 if extra_rows > 0 else float("nan")
    share = 1 - floor["wall_s"] / full["wall_s"]
    print(f"\nbreakdown (as configured): {full['steps']} steps, {full['rows']:,} batch rows "
          f"(request-steps), {full['completed']} requests")
    print(f"  floor run (same arrivals and prompts, 1 output token each): {floor['wall_s']:.2f} s wall, "
          f"{floor['steps']} steps, {floor['rows']:,} rows -> {floor['wall_s'] / n * 1e6:.0f} us per request "
          "(admission, hashing, prefill, completion, its steps)")
    print(f"  decode rows: {per_row_us:.2f} us per additional row, {share * 100:.0f}% of the wall time")
    print(f"  ceiling if decode rows cost nothing: {full['simulated_s'] / floor['wall_s']:.0f}x real time; "
          f"1000x needs the whole run in {full['simulated_s'] / 1000 * 1e3:.0f} ms, "
          f"i.e. {full['simulated_s'] / 1000 / n * 1e6:.0f} us per request all included")


def bounds(cfg: dict, n: int, full: dict) -> None:
    """Time, on this machine, alone: the prefix-cache block hashes that keeping vLLM's state exactly
    takes (every full block of every request hashed, as vLLM does, with its default `sha256`: SHA-256
    of the pickled (parent, tokens, extra) tuple) and, per engine step, one SimPy event and one
    cost-model prediction. (A simulator could skip hashes no lookup can ever match - computing a
    block's hash only when a request with the same first block arrives - at the price of state that
    no longer equals vLLM's; servetwin does not.)"""
    import pickle  # noqa: PLC0415

    import simpy  # noqa: PLC0415

    from servetwin.core.kv_cache.hashing import hash_block_tokens, sha256  # noqa: PLC0415
    from servetwin.sim.cost_model import CostModel, StepSummary  # noqa: PLC0415

    block_size = int(cfg["engine"].get("block_size", 16))
    _, reqs = build_workload(dict(cfg["workload"], requests=n), vocab_size=128_000)
    num_hashes = sum((len(r.prompt_token_ids) + r.max_tokens) // block_size for r in reqs)
    tokens = list(range(1000, 1000 + block_size))
    t0 = time.perf_counter()
    parent = None
    for _ in range(num_hashes):
        parent = hash_block_tokens(sha256, parent, tokens)
    t_hash = time.perf_counter() - t0
    key = (parent, tuple(tokens), None)  # what every hash serialises first, whatever the hash function
    t0 = time.perf_counter()
    for _ in range(num_hashes):
        pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)
    t_pickle = time.perf_counter() - t0

    steps = full["steps"]
    cm = CostModel(cfg["model"], cfg["hardware"])
    env = simpy.Environment()
    summary = StepSummary(num_reqs=100, num_tokens=100, num_sampling=100, decode_reqs=100, decode_sum_kv=40_000)

    def engine():
        for _ in range(steps):
            yield env.timeout(cm.predict(summary).duration_s)

    env.process(engine())
    t0 = time.perf_counter()
    env.run()
    t_step = time.perf_counter() - t0
    sim_s = full["simulated_s"]
    print("\nbounds (vLLM's block hashes + the per-step minimum, timed alone on this machine):")
    print(f"  block hashes: {num_hashes:,} (one per full block of each request's final tokens) in "
          f"{t_hash:.3f} s ({t_hash / num_hashes * 1e6:.2f} us each); the pickling alone (also under vLLM's "
          f"xxhash option) {t_pickle:.3f} s = {t_pickle / (full['simulated_s'] / 1000) * 100:.0f}% of the 1000x budget")
    print(f"  per step, one SimPy event + one cost-model prediction: {steps:,} steps in {t_step:.3f} s")
    print(f"  => at most {sim_s / (t_hash + t_step):.0f}x real time even if everything else were free; "
          f"the hashes alone use {t_hash / (sim_s / 1000) * 100:.0f}% of the 1000x budget "
          f"({sim_s / 1000 * 1e3:.0f} ms); as configured the run spends {full['wall_s']:.2f} s")


if __name__ == "__main__":
    main()
