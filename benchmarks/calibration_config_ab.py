"""Does the calibration's engine configuration change what a torch step costs? Within ONE process, the same
decode-heavy workload runs alternately on two torch engines that differ only in engine settings: the automatic
calibration's design (`servetwin.experiments.calibrate.design.DESIGNS["default"]`: max_num_seqs 64, 2048 KV
blocks, max_model_len 2048, 512-token budget) and `make run`'s compare config (experiments/configs/default.yaml:
8 / 256 / 512 / 256). It prints the median duration of the steps that decode the whole batch, per repeat.

    python benchmarks/calibration_config_ab.py [--model tiny-llama] [--batch 8] [--repeats 6] [--threads 1]

Why: on the 2-vCPU VM the compare's decode steps once ran 25-40% faster than the calibration's steps of the
same shape a minute earlier. If the configurations explained it, the two columns here would differ; one process
keeps the host's phase the same for both (run it with everything else paused).

Measured 2026-12-02 08:00 UTC (tiny-llama, batch 8, 1 thread, everything else paused): compare 1.37-1.55 ms
(median 1.53), design 1.37-1.49 ms (median 1.44): the design's configuration is not slower. The same decode
step measured 0.68 ms at 07:52 and 0.85-0.94 ms at 08:04 (in other processes, on either CPU: `taskset -c 0|1`):
the host's speed, not the configuration, moved the calibration away from the run (issue 25's note).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import yaml

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.experiments.calibrate.design import DESIGNS
from servetwin.experiments.calibrate.torch_measure import set_torch_threads

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "default.yaml"
KEYS = ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "max_model_len")  # where the two differ
_COMPARE = yaml.safe_load(DEFAULT_YAML.read_text())["engine"]
CONFIGS = {"compare": {k: _COMPARE[k] for k in KEYS}, "design": {k: getattr(DESIGNS["default"], k) for k in KEYS}}


def decode_step_ms(engine, rng: np.random.Generator, vocab: int, tag: str, batch: int, prompt: int,
                   outputs: int) -> float:
    """Median wall time of the steps that decode all `batch` requests (one token each, nothing admitted)."""
    for i in range(batch):
        tokens = [int(t) for t in rng.integers(3, vocab, prompt)]
        engine.add_request(Request(f"{tag}-{i}", tokens, SamplingParams(max_tokens=outputs, ignore_eos=True)))
    durations = []
    while engine.has_work():
        t0 = time.perf_counter()
        result = engine.step()
        dt = time.perf_counter() - t0
        so = result.scheduled
        if so is not None and so.total_num_scheduled_tokens == batch and not so.scheduled_new_reqs:
            durations.append(dt)
    return 1e3 * statistics.median(durations)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    set_torch_threads(args.threads)
    engines, vocab = {}, 0
    for name, kw in CONFIGS.items():
        engine_args = EngineArgs.from_kwargs(model=args.model, backend="torch", device="cpu",
                                             enable_prefix_caching=False, **kw)
        engines[name], info = create_engine_core(engine_args)
        vocab = info.vocab_size
    rng = np.random.default_rng(0)
    for name, engine in engines.items():  # warm-up, not recorded
        decode_step_ms(engine, rng, vocab, f"warm-{name}", args.batch, 64, 40)
    results: dict[str, list[float]] = {name: [] for name in engines}
    for k in range(args.repeats):  # alternating order: drift within the process hits both alike
        for name in (list(engines) if k % 2 == 0 else list(reversed(engines))):
            results[name].append(decode_step_ms(engines[name], rng, vocab, f"{name}-{k}", args.batch, 64, 40))
    for name, values in results.items():
        print(f"{name:8s} decode step ms per repeat {[round(v, 3) for v in values]}  median {statistics.median(values):.3f}")
    a, b = (statistics.median(results[n]) for n in ("design", "compare"))
    print(f"design / compare: {a / b:.3f}")


if __name__ == "__main__":
    main()
