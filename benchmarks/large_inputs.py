"""The worst case each documented input limit allows (issue 38 items 2 and 8; docs/limits.md): peak memory,
wall time and the longest silence (no stderr line) of the command in a child process.

Cases (each file generated into a temporary folder, removed after):
- `trace-csv`: a workload trace CSV of 10M lines (about 150 MB, under MAX_TRACE_FILE_BYTES) read by a run of
  `requests: 1000` (issue 38 item 2: was 6.5 GB and 163 s, 71 s of it silent);
- `chrome-trace`: a vLLM profiler trace of 2M events (about 230 MB, under MAX_IMPORT_FILE_BYTES), 1 in 100 a
  step range, through `servetwin import vllm-trace` (item 8: was 4.2 GB and 44 s);
- `chrome-steps`: a trace of MAX_TRACE_STEPS (250,000) steps, each a CPU and a GPU range (the most step
  rows one import builds);
- `requests-max`: `servetwin run` of 700,000 offline requests of 8 + 4 tokens on the simulator, no figures,
  no step rows: about the most the run memory budget (`sim.workload.check_run_memory`, 2 GB) allows (item
  8: 1M requests took 2.9 GB and 90 s with no progress line; now refused before anything is built).

PASS: peak RSS < 2 GB and no silence over 30 s (the targets of issue 38's "Done when"). Memory figures hold on
a loaded machine; times measured on one are not results (the script prints the load average).

Usage: python benchmarks/large_inputs.py [--case trace-csv|chrome-trace|chrome-steps|requests-max|all]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MEMORY_LIMIT_MB = 2048
SILENCE_LIMIT_S = 30.0


def measure(argv: list[str], timeout: float) -> tuple[int, float, float, float, str]:
    """(exit status, wall s, peak RSS MB, longest silence s, the line the longest silence followed) of
    `servetwin argv`."""
    proc = subprocess.Popen([sys.executable, "-m", "servetwin.experiments.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    t0 = time.monotonic()
    stamps = [t0]
    lines = ["(start)"]

    def read() -> None:
        for line in proc.stderr:  # tqdm's \r updates arrive as lines of their own: each counts
            stamps.append(time.monotonic())
            lines.append(line.strip())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = t0 + timeout
    while True:
        done, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            done, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    end = time.monotonic()
    reader.join(5)
    stamps.append(end)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    k = max(range(len(gaps)), key=gaps.__getitem__)
    return os.waitstatus_to_exitcode(status), end - t0, usage.ru_maxrss / 1024, gaps[k], f"after: {lines[k][:90]}"


def trace_csv(d: Path) -> list[str]:
    f = d / "big.csv"
    with open(f, "w") as out:
        out.write("arrival_s,prompt_tokens,output_tokens\n")
        block = "".join(f"{i * 0.001:.3f},{8 + i % 50},{4 + i % 7}\n" for i in range(100_000))
        for _ in range(100):  # 10M lines (the arrival times repeat per block: the reader sorts them)
            out.write(block)
    cfg = d / "trace.yaml"
    cfg.write_text("name: trace\nmodel: tiny-llama\nhardware: cpu\nbackends: [sim]\n"
                   f"workload: {{requests: 1000, arrival: {{type: trace, path: {json.dumps(str(f))}}}}}\n"
                   "output: {plots: false, step_requests: false}\n")
    return ["run", str(cfg), "-o", str(d / "out-trace"), "--no-progress"]


def chrome_trace(d: Path) -> list[str]:
    f = d / "trace.json"
    with open(f, "w") as out:
        out.write('{"traceEvents": [')
        t = 0
        for i in range(2_000_000):
            if i % 100 == 0:
                ev = {"ph": "X", "cat": "user_annotation", "name": "execute_context_1(64)_generation_31(31)",
                      "ts": t, "dur": 900, "pid": 1, "tid": 1, "args": {"External id": i}}
                t += 1000
            else:
                ev = {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16", "ts": t, "dur": 3, "pid": 0,
                      "tid": 7, "args": {"grid": [132, 1, 1]}}
            out.write(("," if i else "") + json.dumps(ev, separators=(",", ":")))
        out.write("]}")
    return ["import", "vllm-trace", str(f), "-o", str(d / "out-import")]


def chrome_steps(d: Path) -> list[str]:
    """The most step ranges one trace may hold (MAX_TRACE_STEPS), each a CPU and a GPU range."""
    from servetwin.experiments.vllm_import.profiler_trace import MAX_TRACE_STEPS  # noqa: PLC0415

    f = d / "steps.json"
    with open(f, "w") as out:
        out.write('{"traceEvents": [')
        for i in range(MAX_TRACE_STEPS):
            name = f"execute_context_{i % 3}({64 * (i % 3)})_generation_{31 + i % 5}({31 + i % 5})"
            for cat, tid in (("user_annotation", 1), ("gpu_user_annotation", 7)):
                ev = {"ph": "X", "cat": cat, "name": name, "ts": 1000 * i, "dur": 900, "pid": 1, "tid": tid}
                out.write(("," if i or cat == "gpu_user_annotation" else "") + json.dumps(ev, separators=(",", ":")))
        out.write("]}")
    return ["import", "vllm-trace", str(f), "-o", str(d / "out-steps")]


def requests_max(d: Path) -> list[str]:
    cfg = d / "many.yaml"
    cfg.write_text("name: many\nmodel: tiny-llama\nhardware: cpu\nbackends: [sim]\n"
                   "engine: {max_num_seqs: 256, max_num_batched_tokens: 8192, num_gpu_blocks: 65536}\n"
                   "workload: {requests: 700000, prompt_tokens: 8, output_tokens: 4, arrival: {type: offline}}\n"
                   "output: {plots: false, step_requests: false}\n")
    return ["run", str(cfg), "-o", str(d / "out-many")]


CASES = {"trace-csv": (trace_csv, 900.0), "chrome-trace": (chrome_trace, 600.0),
         "chrome-steps": (chrome_steps, 600.0), "requests-max": (requests_max, 1800.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ns = ap.parse_args()
    print(f"host load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (times under load are not results)")
    ok = True
    with tempfile.TemporaryDirectory(prefix="servetwin-large-") as tmp:
        for name, (build, timeout) in CASES.items():
            if ns.case not in (name, "all"):
                continue
            d = Path(tmp) / name
            d.mkdir()
            argv = build(d)
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            rc, wall, rss, silence, last = measure(argv, timeout)
            good = rc == 0 and rss < MEMORY_LIMIT_MB and silence < SILENCE_LIMIT_S
            ok &= good
            print(f"{name:14s} input {size / 1e6:7.1f} MB  exit {rc:3d}  wall {wall:7.1f} s  peak {rss:7.0f} MB  "
                  f"longest silence {silence:6.1f} s  {'PASS' if good else 'FAIL'}  {last[:100]}", flush=True)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
