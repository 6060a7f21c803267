"""Costs of the routing ladder's normal-step and routing paths, this checkout against a baseline.

The cluster simulation (benchmarks/cluster_speed.py) spends, besides its fused implicit-decode steps, time on
routing (the llm-d router: the prompt's 16-token block keys, the approximate prefix index), on each admitted
request's prefix-cache block hashes (SHA-256 of the pickle, 128-token blocks) and on the normal steps. This
script times, in fresh processes importing each checkout (interleaved `--repeats` times):
- `block_hashes`: a 6,500-token prompt's block hashes (a `Request` with the scheduler's sha256 hasher, 128-token
  blocks), the prompt sent before (the ladder cycles 750 prompts over its 17,084 requests), us per request;
- `route`: one llm-d route (prefix-cache-affinity filter, token-load scorer) of such a prompt over 16
  endpoints, one of which holds it, and the index update after it, us per request;
- `--ladder N`: the ladder's first N requests (a stage boundary, as `cluster_speed.py --profile`): CPU
  seconds of `simulate_cluster` and, under cProfile, its function calls (load-independent).

    python benchmarks/normal_step_costs.py --baseline db4eb3c --repeats 3 --ladder 2070

Measured 2026-12-06 15:02-15:05 UTC on the shared 2-core machine under load (2-3; ratios, not results),
`--baseline` db4eb3c (this work's start, as a checkout folder) `--repeats 3 --runs 300 --ladder 5053`:
    block_hashes    157.75 -> 87.08 us per request   (0.55: the block hash cache, core/kv_cache/hashing.py)
    route           110.03 -> 88.94 us per request   (0.81: sim/routers.py's keys, index update and walk)
    ladder 5,053    12.59 -> 11.91 CPU s              (0.95, medians of 3 interleaved processes)
                    52.64 M -> 51.40 M function calls (0.976)
The same two cases timed in one process, old and new modules interleaved 15 times (medians): route 0.80,
block hashes 0.54. Concurrent pairs of whole runs (both checkouts at once, 5,053 requests): 0.98, 1.01, 0.98.
Outputs byte-identical to db4eb3c but for wall times: the ladder's first 2,070 and 5,053 requests (every file
of the run folder, trace.json included) and the single-engine bench (2,000 requests).

Tried and dropped: a normal step's trace row joining the step table's buffer (no flush per normal step, the
buffered rows read in place) - fewer calls, but 2-4% more CPU on the 5,053 requests (concurrent pairs against
the baseline: 0.96 without it, 0.98 with it): rows flushed long after they were made are cold in the CPU caches.

Where the time goes (py-spy, 150 Hz, the first 6,573 requests, shares of the process; baseline -> this):
block hashes 9.8% -> 8.0% (a cache hit still hashes and compares the block's 128 token ids, which are
cold in the CPU caches: the micro case above runs hot), admission in all 10.9% -> 8.3%, routing 8.1% ->
7.1% (the 256 keys of 16 tokens 3.0%), the fake-token salt (a CRC of the packed prompt) 3.0% -> 2.4%, the
step table's flush 4.8% -> 4.3%; the fused steps 36-39% and the normal steps' scheduling ~18% are the rest.
The single-engine bench uses the `builtin` block hash (`prefix_caching_hash_algo`), the ladder vLLM's default
sha256: the same decisions (only hash equality matters), so the ladder's case could name `builtin` too - a
config choice, not made here.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "benchmarks/published_cluster/cases/routing_gptoss120b_h100_16xtp1_llmd.yaml"


def _best_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def micro(runs: int) -> dict[str, float]:
    """Microseconds per request of the block hashes and of one route (see the module docstring)."""
    from types import SimpleNamespace  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from servetwin.core.kv_cache.hashing import get_request_block_hasher, sha256  # noqa: PLC0415
    from servetwin.core.request import Request  # noqa: PLC0415
    from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415
    from servetwin.sim.routers import (Endpoint, LlmdRouter, PrefixAffinityFilter, PrefixCacheScorer,  # noqa: PLC0415
                                       TokenLoadScorer)

    rng = random.Random(0)
    prompt = [rng.randrange(10, 200_000) for _ in range(6500)]
    hasher = get_request_block_hasher(128, sha256)
    params = SamplingParams(max_tokens=500)

    def hashes():
        return Request("r", prompt, params, arrival_time=0.0, block_hasher=hasher, hash_block_size=128)
    hashes()  # (sent before)
    out = {"block_hashes": _best_us(hashes, runs)}

    scorer = PrefixCacheScorer()
    router = LlmdRouter([(TokenLoadScorer(), 1.0)], np.random.default_rng(0),
                        [PrefixAffinityFilter(scorer, peak_prefill_throughput=39065)])
    endpoints = [Endpoint(i, f"r-{i}") for i in range(16)]
    for i, e in enumerate(endpoints):  # every index holds other prompts; endpoint 3 this one
        router.on_routed(SimpleNamespace(prompt_token_ids=[rng.randrange(10, 200_000) for _ in range(6500)]), e)
    request = SimpleNamespace(prompt_token_ids=prompt)
    router.on_routed(request, endpoints[3])

    def route():
        req = SimpleNamespace(prompt_token_ids=prompt)  # (a new request: its keys are not kept)
        decision = router.route(req, endpoints)
        router.on_routed(req, endpoints[decision.pick])
    out["route"] = _best_us(route, max(1, runs // 2))
    return out


def ladder(n: int, profile: bool) -> dict[str, float]:
    """CPU seconds of simulate_cluster for the ladder's first n requests (or its function calls)."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    from servetwin.experiments.config.schema import load_config  # noqa: PLC0415
    from servetwin.experiments.run.cluster_run import simulate_cluster  # noqa: PLC0415

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cluster_speed import _stages_for  # noqa: PLC0415

    path = Path(__import__("servetwin").__path__[0], CLUSTER)
    values = {"output.plots": False, "output.step_requests": False}
    exp = load_config(path, values=values)
    exp = load_config(path, values={**values, "workload.arrival.stages": _stages_for(exp, n), "workload.requests": n})
    if profile:
        prof = cProfile.Profile()
        prof.runcall(simulate_cluster, exp)
        return {"calls": float(pstats.Stats(prof).total_calls)}  # type: ignore[attr-defined]
    t0 = time.process_time()
    simulate_cluster(exp)
    return {"cpu_s": time.process_time() - t0}


def _in_process(checkout: Path, tmp: str, args: list[str]) -> dict[str, float]:
    """This script's `--child` in a fresh process importing `checkout` as servetwin."""
    link = Path(tmp, f"link-{abs(hash(str(checkout)))}")
    if not link.exists():
        link.mkdir()
        os.symlink(checkout, link / "servetwin")
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *args], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(link)), cwd=tmp)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: measuring failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="git ref (or an existing checkout) to time too")
    ap.add_argument("--runs", type=int, default=200, help="calls per timing (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="processes per checkout, interleaved (default 3)")
    ap.add_argument("--ladder", type=int, metavar="N", help="also the ladder's first N requests (a stage boundary)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # (the child process: micro RUNS | ladder N | calls N)
    args = ap.parse_args(argv)
    if args.child:
        kind, value = args.child[0], int(args.child[1])
        print(json.dumps(micro(value) if kind == "micro" else ladder(value, kind == "calls")))
        return
    from sim_speed_process import baseline_checkout  # noqa: PLC0415  (benchmarks/ is on sys.path)

    jobs = [["micro", str(args.runs)]] + ([["ladder", str(args.ladder)]] if args.ladder else [])
    with tempfile.TemporaryDirectory() as tmp:
        checkouts, made = {"this": ROOT}, False
        if args.baseline:
            checkouts["baseline"], made = baseline_checkout(args.baseline, tmp)
        results: dict[str, list[dict[str, float]]] = {label: [] for label in checkouts}
        try:
            for i in range(args.repeats):
                for label, checkout in (list(checkouts.items()) if i % 2 == 0 else list(checkouts.items())[::-1]):
                    merged: dict[str, float] = {}
                    for job in jobs:
                        merged.update(_in_process(checkout, tmp, job))
                    results[label].append(merged)
            if args.ladder:  # call counts: one process each
                for label, checkout in checkouts.items():
                    calls = _in_process(checkout, tmp, ["calls", str(args.ladder)])["calls"]
                    for r in results[label]:
                        r["calls"] = calls
        finally:
            if made:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkouts["baseline"])],
                               capture_output=True)
    cases = list(results["this"][0])
    print(f"median of {args.repeats} processes per checkout (us per request; ladder: CPU s, function calls)")
    print(f"{'case':14s} {'this':>12s}" + (f" {'baseline':>12s} {'this/base':>9s}" if args.baseline else ""))
    for case in cases:
        this = statistics.median(r[case] for r in results["this"])
        line = f"{case:14s} {this:12.2f}"
        if args.baseline:
            base = statistics.median(r[case] for r in results["baseline"])
            line += f" {base:12.2f} {this / base:9.3f}"
        print(line)


if __name__ == "__main__":
    main()
