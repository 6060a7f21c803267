"""Cost of the process boundary: in-process vs multi-process `LLM`, side by side.

Many small `LLM.generate` calls (1, 2, 4 or 8 prompts; 1-4 output tokens) with `multiprocess=False` and
`multiprocess=True`, same model and engine arguments, interleaved so drift hits both alike. Backends:
`fake` always, `torch` with `tiny-llama` when `servetwin.gpu.executor` imports (`--backends` to choose).

Printed per backend:
- per-call time of both clients (median over the calls of each shape), the per-call overhead
  (multi-process minus in-process) and the ratio;
- a least-squares fit of the per-call overhead, `a + b * steps + c * rows` (rows = requests x steps);
- the per-step IPC cost measured inside the engine process: encoding and sending each step's outputs
  plus checking the input socket, fitted as `c_ipc_step + c_ipc_req * outputs_in_step`.

The engine-side fit is what the simulator's cost model means by its IPC terms (`ipc_step`: once per
step, `ipc_req`: per scheduled request, both only with a multi-process front end, see
`sim/coefficients.py`), so `--save` writes it to `experiments/calibrations/ipc_overhead.yaml` as
`coefficients.c_ipc_step` / `c_ipc_req` (also `c_ipc_step_s` / `c_ipc_req_s`): from the torch backend
when it ran (a real model's millisecond steps let the engine's ZMQ I/O thread fall asleep, so each send
pays a wake-up that the fake backend's hot loop does not), else from the fake backend; all numbers and
the provenance (date, machine, Python, load) go to the file too.

torch runs with OMP_NUM_THREADS=1 unless set (both processes; see below).
Usage: python benchmarks/ipc_overhead.py [--reps 60] [--backends fake,torch] [--save]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# One intra-op thread per process: two processes with spinning OpenMP pools on a small host measure the
# thread oversubscription, not the process boundary. The engine process inherits this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from servetwin.core.engine.llm import LLM  # noqa: E402
from servetwin.core.sampling_params import SamplingParams  # noqa: E402

SHAPES = [(k, m) for k in (1, 2, 4, 8) for m in (1, 2, 3, 4)]
OUT = ROOT / "experiments" / "calibrations" / "ipc_overhead.yaml"


def backend_kwargs(backend: str) -> dict:
    if backend == "fake":
        return dict(model="fake", backend="fake", skip_tokenizer_init=True)
    if backend == "torch":
        return dict(model="tiny-llama", backend="torch", num_gpu_blocks=512, max_model_len=512)
    raise ValueError(f"backends: unknown backend {backend!r} (allowed: fake, torch)")


def backend_available(backend: str) -> bool:
    if backend == "fake":
        return True
    try:
        __import__("servetwin.gpu.executor")
    except Exception:  # noqa: BLE001
        return False
    return True


def lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    import numpy as np  # noqa: PLC0415

    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(ys, dtype=float), rcond=None)
    return [float(c) for c in coef]


def prompts_for(k: int, call: int) -> list[list[int]]:
    # distinct prompts per call (no prefix-cache hits across calls), 8-15 tokens
    return [[10 + (call * 37 + i * 11 + j) % 200 for j in range(8 + (call + i) % 8)] for i in range(k)]


def measure(backend: str, reps: int) -> dict:
    kw = backend_kwargs(backend)
    inproc = LLM(multiprocess=False, **kw)
    mp = LLM(multiprocess=True, **kw)
    clients = {"inproc": inproc, "mp": mp}
    times: dict[str, dict[tuple[int, int], list[float]]] = {name: {s: [] for s in SHAPES} for name in clients}
    try:
        for warm in range(20):  # warm-up: imports, allocator, caches
            for llm in clients.values():
                llm.generate(prompts_for(2, warm), SamplingParams(max_tokens=2, temperature=0.0))
        mp.llm_engine.client.utility("clear_ipc_profile")
        call = 0
        for rep in range(reps):
            for k, m in SHAPES:
                call += 1
                params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                prompts = prompts_for(k, call)
                order = ("inproc", "mp") if (rep + k + m) % 2 == 0 else ("mp", "inproc")
                for name in order:
                    t0 = time.perf_counter()
                    outs = clients[name].generate(prompts, params)
                    times[name][(k, m)].append(time.perf_counter() - t0)
                    assert all(len(o.outputs[0].token_ids) == m for o in outs)
        profile = mp.llm_engine.client.utility("get_ipc_profile")
    finally:
        inproc.close()
        mp.close()
    return {"times": times, "profile": profile}


def analyse(backend: str, data: dict) -> dict:
    times = data["times"]
    med = {name: {s: statistics.median(v) for s, v in per.items()} for name, per in times.items()}
    rows, ys = [], []
    print(f"\n== {backend}: per-call time (median of {len(times['mp'][SHAPES[0]])} calls per shape) ==")
    print(f"{'prompts':>7} {'tokens':>6} {'in-proc us':>11} {'multi-proc us':>14} {'overhead us':>12} {'ratio':>6}")
    for k, m in SHAPES:
        a, b = med["inproc"][(k, m)], med["mp"][(k, m)]
        print(f"{k:>7} {m:>6} {a * 1e6:>11.1f} {b * 1e6:>14.1f} {(b - a) * 1e6:>12.1f} {b / a:>6.2f}")
        rows.append([1.0, float(m), float(k * m)])
        ys.append(b - a)
    mean_in = statistics.mean(med["inproc"].values())
    mean_mp = statistics.mean(med["mp"].values())
    per_call = statistics.mean(ys)
    a0, b0, c0 = lstsq(rows, ys)
    print(f"mean per call: in-process {mean_in * 1e6:.1f} us, multi-process {mean_mp * 1e6:.1f} us, "
          f"overhead {per_call * 1e6:.1f} us per call, ratio {mean_mp / mean_in:.2f}x")
    print(f"client-side fit: overhead = {a0 * 1e6:.1f} us per call + {b0 * 1e6:.2f} us per step "
          f"+ {c0 * 1e6:.2f} us per request-step")

    prof = data["profile"]["steps"]
    per_step = [send + recv for _, send, recv in prof]
    # robust fit: the median per number of outputs (a shared 2-core host deschedules the engine now and
    # then, which puts a long tail on single samples), then a line through the medians
    groups: dict[int, list[float]] = {}
    for (n, send, recv) in prof:
        groups.setdefault(int(n), []).append(send + recv)
    keys = sorted(groups)
    c_step, c_req = lstsq([[1.0, float(n)] for n in keys], [statistics.median(groups[n]) for n in keys])
    n_in = max(1, data["profile"]["input_msgs"])
    print(f"engine-side IPC per step ({len(prof)} steps): mean {statistics.mean(per_step) * 1e6:.2f} us, "
          f"median {statistics.median(per_step) * 1e6:.2f} us; by outputs per step: "
          + ", ".join(f"{n}: {statistics.median(groups[n]) * 1e6:.1f} us" for n in keys))
    print(f"engine-side fit: {c_step * 1e6:.2f} us per step + {c_req * 1e6:.3f} us per output; input handling "
          f"(decode + add to the scheduler) {data['profile']['input_time_s'] / n_in * 1e6:.1f} us per input "
          f"message ({n_in} messages)")
    return {
        "per_call_inproc_s": mean_in, "per_call_mp_s": mean_mp, "per_call_overhead_s": per_call,
        "ratio": mean_mp / mean_in,
        "client_fit": {"per_call_s": a0, "per_step_s": b0, "per_request_step_s": c0},
        "engine_fit": {"c_ipc_step_s": c_step, "c_ipc_req_s": c_req, "steps": len(prof),
                       "mean_step_ipc_s": statistics.mean(per_step),
                       "median_step_ipc_s": statistics.median(per_step),
                       "input_per_message_s": data["profile"]["input_time_s"] / n_in},
        "shapes": {f"{k}x{m}": {"inproc_s": med["inproc"][(k, m)], "mp_s": med["mp"][(k, m)]} for k, m in SHAPES},
    }


def save(results: dict, reps: int) -> None:
    import yaml  # noqa: PLC0415

    source = "torch" if "torch" in results else "fake"
    fit = results[source]["engine_fit"]
    c_step = max(0.0, fit["c_ipc_step_s"])
    c_req = max(0.0, fit["c_ipc_req_s"])
    doc = {
        "description": ("IPC overhead of the multi-process front end (ZMQ + msgspec), measured by "
                        "benchmarks/ipc_overhead.py. c_ipc_step / c_ipc_req: engine-side cost per step and per "
                        "output of sending the step's outputs and checking the input socket, line through the "
                        f"per-output-count medians, clipped at 0; from the {source} backend ("
                        + ("a real model: steps take milliseconds, so every send also wakes the idle ZMQ I/O "
                           "thread; the fake backend's hot loop pays less, see measurements" if source == "torch"
                           else "the torch backend was not available") +
                        "). Merge `coefficients` into a hardware spec's coefficients (servetwin.sim.coefficients names)."),
        "source_backend": source,
        "coefficients": {"c_ipc_step": c_step, "c_ipc_req": c_req},
        "c_ipc_step_s": c_step,
        "c_ipc_req_s": c_req,
        "provenance": {
            "date": _dt.date.today().isoformat(),
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()})",
            "python": platform.python_version(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "command": "python benchmarks/ipc_overhead.py --save " + f"--reps {reps}",
            "backends": sorted(results),
        },
        "measurements": {b: _plain(r) for b, r in results.items()},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w") as f:
        f.write("# Written by benchmarks/ipc_overhead.py - measured, not hand-edited.\n")
        yaml.safe_dump(doc, f, sort_keys=False)
    print(f"\nwrote {OUT.relative_to(ROOT)}")


def _plain(obj):
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    return obj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=60, help="calls per shape and client (default 60)")
    p.add_argument("--backends", default="fake,torch", help="comma-separated: fake, torch (default both)")
    p.add_argument("--save", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    ns = p.parse_args(argv)
    results = {}
    for backend in [b.strip() for b in ns.backends.split(",") if b.strip()]:
        if not backend_available(backend):
            print(f"\n== {backend}: skipped (backend not importable) ==")
            continue
        reps = ns.reps if backend == "fake" else max(5, ns.reps // 4)
        results[backend] = analyse(backend, measure(backend, reps))
    if ns.save:
        if not results:
            raise SystemExit("--save: nothing was measured")
        save(results, ns.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
