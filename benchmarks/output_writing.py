"""Output-writing time of `servetwin run` against its simulation time (issue 14: writing <= 1/4 of it).

Each run is a fresh `servetwin run CONFIG -o TMP --overwrite --no-progress` in its own interpreter
(imports, forks and all, as a user runs it). The child times two phases:
- simulation: `servetwin.sim.engine.Simulation.run` (wall and CPU of the process);
- outputs: from the moment that call returned to the moment the command returned - building the tables,
  the summary, the Parquet files, trace.json, the figures, report.md and summary.json. Its CPU time is this
  process's plus every child process's (all of them are output writers: the forked trace/figure writers
  and the child that imports matplotlib while the simulation runs - that import is charged to the
  outputs here, although it ran on another CPU during the simulation).
Printed per run and as medians: both times, the ratio outputs/simulation (target <= 0.25) in wall time
and in CPU time (less disturbed by other load on a shared machine), with and without the figures.

`--compare DIR` runs another checkout (e.g. `git archive main | tar -x -C /tmp/before`) the same way,
interleaved with this one (before, after, after, before, ...) so the machine's drift hits both alike.

Usage: python benchmarks/output_writing.py [--config FILE] [--repeats 3] [--requests N] [--compare DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "bench_h100_llama8b.yaml"
TARGET = 0.25

# A fresh interpreter importing `servetwin` from CHECKOUT (the repo root is the package: a folder holding
# a `servetwin` link to it goes first on sys.path); it wraps Simulation.run to note when the simulation
# ends, then runs the CLI as a user would.
_CHILD = """
import json, os, sys, time
link_dir, checkout, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, link_dir)
import servetwin.sim.engine as engine_mod
assert os.path.realpath(engine_mod.__file__).startswith(checkout + "/"), (engine_mod.__file__, checkout)
from servetwin.experiments.cli import main
marks = {}
real_run = engine_mod.Simulation.run
def timed_run(self, *a, **kw):
    marks["sim_t0"], marks["sim_c0"] = time.perf_counter(), time.process_time()
    try:
        return real_run(self, *a, **kw)
    finally:
        marks["sim_t1"], marks["sim_c1"] = time.perf_counter(), time.process_time()
engine_mod.Simulation.run = timed_run
rc = main(argv)
t_end, c_end = time.perf_counter(), time.process_time()
ch = os.times()
print(json.dumps({"rc": rc, "sim_wall_s": marks["sim_t1"] - marks["sim_t0"],
                  "sim_cpu_s": marks["sim_c1"] - marks["sim_c0"],
                  "out_wall_s": t_end - marks["sim_t1"],
                  "out_cpu_s": c_end - marks["sim_c1"] + ch.children_user + ch.children_system}))
"""


def run_checkout(checkout: Path, config: Path, plots: bool, requests: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        link_dir = os.path.join(tmp, "link")
        os.makedirs(link_dir)
        os.symlink(checkout, os.path.join(link_dir, "servetwin"))
        argv = ["run", str(config), "-o", os.path.join(tmp, "out"), "--overwrite", "--no-progress"]
        argv += [] if plots else ["--no-plots"]
        argv += [] if requests is None else ["--requests", str(requests)]
        out = subprocess.run([sys.executable, "-c", _CHILD, link_dir, str(checkout), *argv], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=""), cwd=tmp)
        if out.returncode != 0:
            raise SystemExit(f"the run of {checkout} failed:\n{out.stderr[-4000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["files"] = sorted(os.path.relpath(os.path.join(d, f), os.path.join(tmp, "out"))
                            for d, _, fs in os.walk(os.path.join(tmp, "out")) for f in fs)
    r["ratio_wall"] = r["out_wall_s"] / r["sim_wall_s"]
    r["ratio_cpu"] = r["out_cpu_s"] / r["sim_cpu_s"]
    return r


def _row(label: str, r: dict) -> str:
    verdict = "ok" if r["ratio_wall"] <= TARGET else "ABOVE TARGET"
    return (f"{label:<26}{r['sim_wall_s']:>9.2f}{r['out_wall_s']:>9.2f}{r['ratio_wall']:>8.2f}"
            f"{r['sim_cpu_s']:>9.2f}{r['out_cpu_s']:>9.2f}{r['ratio_cpu']:>8.2f}  {verdict}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--compare", metavar="DIR", help="another servetwin checkout, run side by side")
    args = ap.parse_args(argv)
    checkouts = {"this": ROOT}
    if args.compare:
        other = Path(args.compare).resolve()
        if not (other / "__init__.py").is_file() or not (other / "experiments").is_dir():
            raise SystemExit(f"--compare: {other} is not a servetwin checkout")
        checkouts = {"before": other, "after": ROOT}
    print(f"{Path(args.config).name}, {args.repeats} run(s) per variant; target: outputs <= {TARGET:.2f} x "
          f"simulation; cpus: {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    for name, path in checkouts.items():
        print(f"  {name} = {path}")
    print(f"{'run':<26}{'sim s':>9}{'out s':>9}{'ratio':>8}{'sim cpu':>9}{'out cpu':>9}{'ratio':>8}")
    results: dict[tuple[str, bool], list[dict]] = {}
    labels = list(checkouts)
    for i in range(args.repeats):
        for plots in (True, False):
            for label in (labels if i % 2 == 0 else labels[::-1]):
                r = run_checkout(checkouts[label], Path(args.config).resolve(), plots, args.requests)
                results.setdefault((label, plots), []).append(r)
                print(_row(f"{i + 1} {label} {'figures' if plots else 'no figures'}", r), flush=True)
    print("medians:")
    for (label, plots), rs in results.items():
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("sim_wall_s", "out_wall_s", "ratio_wall", "sim_cpu_s", "out_cpu_s", "ratio_cpu")}
        print(_row(f"{label} {'figures' if plots else 'no figures'}", med))
    if args.compare:
        for plots in (True, False):
            a, b = results[("before", plots)][0]["files"], results[("after", plots)][0]["files"]
            if a != b:
                print(f"note ({'figures' if plots else 'no figures'}): the files differ: before only "
                      f"{sorted(set(a) - set(b))}, after only {sorted(set(b) - set(a))}")


if __name__ == "__main__":
    main()
