"""Whether a change left every output file of `servetwin run` as it was: this checkout against a baseline.

Runs the single-engine bench (experiments/configs/bench_h100_llama8b.yaml) and the 16-instance routing
ladder (benchmarks/published_cluster/cases/routing_gptoss120b_h100_16xtp1_llmd.yaml) as whole `servetwin
run` processes of a baseline ("before": a git ref checked out with `git worktree add`, or an existing
checkout) and of this checkout ("after"), then compares every file of the two run folders byte for byte.
The only parts allowed to differ are the host's timings and the order of a list the run writes in
whatever order its writers finish:
- in every summary.json, the keys `wall_s` and `sim_speedup_x` (the host's seconds in the loop);
- in report.md, the lines that print them (`wall time (s)`, `... of host time (...x real time)`);
- the run folder's marker (`.servetwin-written`): compared as a set of lines (forked writers record
  their files as they finish).

By default both runs are cut short (the bench's first 300 requests; the ladder as two stages, 600
requests: a ~22 MB trace.json); `--full` runs both configs' own workloads (the ladder's 17,084 requests,
its 251 MB trace.json, ~1 min a run). Exit status 1 when a file differs (each named), 0 when all match.

Usage: python benchmarks/outputs_identical.py --baseline 8b47cd0 [--full] [--keep DIR]
       [--config PATH [--arg=--requests --arg=200 ...]]
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from sim_speed_process import baseline_checkout  # noqa: E402

SINGLE = ROOT / "experiments/configs/bench_h100_llama8b.yaml"
CLUSTER = ROOT / "benchmarks/published_cluster/cases/routing_gptoss120b_h100_16xtp1_llmd.yaml"
CUT = {SINGLE: ["--requests", "300"],
       CLUSTER: ["--requests", "600", "--set", "workload.arrival.stages=[{rate: 15, duration_s: 20}, "
                                              "{rate: 30, duration_s: 10}]"]}
HOST_TIME_KEYS = ("wall_s", "sim_speedup_x")
HOST_TIME_LINES = ("| wall time (s) |", "of host time (")
MARKER = ".servetwin-written"


def run(checkout: Path, config: Path, out: Path, extra: list[str], tmp: str) -> None:
    """One `servetwin run` process of `checkout` writing `out`."""
    link_dir = Path(tmp, f"link-{checkout.name}")
    if not link_dir.exists():  # the repository root is the package: a folder holding a `servetwin` link
        link_dir.mkdir()
        os.symlink(checkout, link_dir / "servetwin")
    cmd = [sys.executable, "-m", "servetwin.experiments.cli", "run", str(config), "-o", str(out), "--overwrite",
           "--no-progress", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(link_dir)),
                          cwd=tmp)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: servetwin run {config.name} failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")


def _without_host_times(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _without_host_times(v) for k, v in data.items() if k not in HOST_TIME_KEYS}
    if isinstance(data, list):
        return [_without_host_times(v) for v in data]
    return data


def same_file(a: Path, b: Path) -> bool:
    """Equal bytes, or equal but for the host's timings (module docstring)."""
    if filecmp.cmp(a, b, shallow=False):
        return True
    if a.name == "summary.json":
        return _without_host_times(json.loads(a.read_text())) == _without_host_times(json.loads(b.read_text()))
    if a.name == "report.md":
        def kept(p: Path) -> list[str]:
            return [line for line in p.read_text().splitlines() if not any(s in line for s in HOST_TIME_LINES)]
        return kept(a) == kept(b)
    if a.name == MARKER:
        return sorted(a.read_text().splitlines()) == sorted(b.read_text().splitlines())
    return False


def compare_folders(before: Path, after: Path) -> list[str]:
    """What differs between two run folders (files only in one, files whose contents differ)."""
    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    a, b = files(before), files(after)
    problems = [f"only before: {p}" for p in sorted(a - b)] + [f"only after: {p}" for p in sorted(b - a)]
    problems += [f"differs: {p}" for p in sorted(a & b) if not same_file(before / p, after / p)]
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git ref (or an existing checkout) to compare with")
    ap.add_argument("--full", action="store_true", help="the configs' own workloads (default: cut short)")
    ap.add_argument("--keep", type=Path, help="write the run folders here (default: a temporary folder)")
    ap.add_argument("--config", type=Path, help="this experiment YAML instead of the two (its own workload, "
                    "unless --arg gives e.g. --requests)")
    ap.add_argument("--arg", action="append", default=[], help="passed to `servetwin run` with --config "
                    "(repeatable: --arg=--requests --arg=200 --arg=--set --arg=output.plots=true)")
    args = ap.parse_args(argv)
    configs = [args.config.resolve()] if args.config else [SINGLE, CLUSTER]
    cut = {args.config.resolve(): args.arg} if args.config else CUT
    bad = 0
    with tempfile.TemporaryDirectory(prefix="servetwin-outputs-") as tmp:
        base = args.keep or Path(tmp)
        before, made = baseline_checkout(args.baseline, tmp)
        try:
            for config in configs:
                extra = [] if args.full else cut[config]
                folders = {}
                for label, checkout in (("before", before), ("after", ROOT)):
                    folders[label] = base / f"{config.stem}-{label}"
                    run(checkout, config, folders[label], extra, tmp)
                problems = compare_folders(folders["before"], folders["after"])
                count = sum(1 for p in folders["after"].rglob("*") if p.is_file())
                how = "the config's own workload" if args.full or (args.config and not args.arg) else "cut short"
                print(f"{config.name}: {'identical' if not problems else 'DIFFERENT'} ({count} files, {how})")
                for p in problems:
                    print(f"  {p}")
                bad += len(problems)
        finally:
            if made:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)],
                               capture_output=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
