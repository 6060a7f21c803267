"""The designed calibration steps and their measured rows: `CalibrationDesign` (the cases, `DESIGNS`),
`run_design` (drives crafted requests through a real `EngineCore`, timing every step), `step_rows` (a
trace's steps as cost-model inputs), `predicted_durations` and `pct_stats` (a cost model scored on them).
Used by `servetwin calibrate` (`servetwin.experiments.calibrate.calibrate`, whose docstring describes the
design) and the drift probe (`servetwin.experiments.calibrate.drift_probe`)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np


@dataclass
class CalibrationDesign:
    prefill_chunks: list[int]
    prefill_prefixes: list[int]
    prefill_batches: list[tuple[int, int]]  # (requests, tokens each)
    partial_prefills: list[int]  # extra tokens past the budget (prompt = budget + extra)
    decode_batches: list[int]
    decode_kv: list[int]
    decode_steps: int
    decode_shared: list[tuple[int, int]]  # (requests, kv) decodes over one shared cached prefix
    mixed: list[tuple[int, int, int]]  # (decoding requests, their kv, new chunk tokens)
    repeats: int
    decode_repeats: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_gpu_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    # pure-decode cases whose prompts hold more tokens than this (b x kv) are skipped: their prefills
    # would cost more than every other case (a CPU prefills ~1k tokens/s) and add no new shape
    max_decode_case_tokens: Optional[int] = None
    mixed_repeats: Optional[int] = None  # the mixed cases' repeats (None: `repeats`)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefill_batches"] = [list(x) for x in self.prefill_batches]
        d["mixed"] = [list(x) for x in self.mixed]
        d["decode_shared"] = [list(x) for x in self.decode_shared]
        return d


DESIGNS: dict[str, CalibrationDesign] = {
    # ~2 minutes for smollm2-135m bf16 on a 2-core AMD EPYC (1 torch thread; its steps cost ~1.2 ms per
    # token, so the decode cases' own prefills are capped and the mixed cases run once: 302 steps, ~116 s
    # predicted, against 469 steps and 209 s before - `make run` must fit in 5 minutes with it)
    "default": CalibrationDesign(
        prefill_chunks=[16, 48, 96, 192, 320, 512], prefill_prefixes=[0, 256, 768],
        prefill_batches=[(2, 64), (4, 32), (8, 16), (4, 128)], partial_prefills=[96],
        decode_batches=[1, 2, 4, 8, 16, 32], decode_kv=[32, 256, 640], decode_steps=4,
        decode_shared=[(4, 256), (8, 256), (16, 384), (32, 512)],
        mixed=[(1, 128, 64), (2, 256, 128), (4, 128, 32), (4, 256, 192), (8, 128, 96), (8, 512, 256),
               (12, 256, 160), (16, 128, 128), (16, 384, 32), (2, 768, 384)],
        repeats=2, decode_repeats=1, max_num_batched_tokens=512, max_num_seqs=64, num_gpu_blocks=2048,
        max_decode_case_tokens=8192, mixed_repeats=1),
    # seconds on tiny-llama: for tests and smoke runs
    "quick": CalibrationDesign(
        prefill_chunks=[16, 64, 128], prefill_prefixes=[0, 64],
        prefill_batches=[(4, 16)], partial_prefills=[32],
        decode_batches=[1, 4, 8], decode_kv=[32, 128], decode_steps=3, decode_shared=[(4, 64)],
        mixed=[(4, 64, 32)],
        repeats=2, decode_repeats=1, max_num_batched_tokens=256, max_num_seqs=16, num_gpu_blocks=256),
}


# -- running the design -------------------------------------------------------------------------
class _Driver:
    """Adds crafted requests to an engine and steps it until idle, timing every step."""

    def __init__(self, engine, recorder, vocab_size: int, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.recorder = recorder
        self.rng = np.random.default_rng(seed)
        self.vocab = max(int(vocab_size), 20)
        self.clock = clock
        self.t0 = clock()
        self.n = 0
        self.cpu_s: dict[int, float] = {}  # step -> process CPU seconds (contention check)

    def tokens(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(3, self.vocab, size=n)]

    def add(self, prompt: list[int], max_tokens: int, tag: str) -> str:
        from servetwin.core.request import Request  # noqa: PLC0415
        from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415

        self.n += 1
        rid = f"cal{self.n}-{tag}"
        now = self.clock() - self.t0
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                      arrival_time=now)
        self.engine.add_request(req)
        if self.recorder is not None:
            self.recorder.on_arrival(req, now)
        return rid

    def step(self) -> Any:
        c0 = time.process_time()
        t_start = self.clock() - self.t0
        result = self.engine.step()
        t_end = self.clock() - self.t0
        if result.scheduled is not None:
            self.cpu_s[result.scheduled.step] = time.process_time() - c0
        if self.recorder is not None:
            self.recorder.on_step(result, t_start, t_end)
        return result

    def run(self, max_steps: Optional[int] = None) -> None:
        k = 0
        while self.engine.has_work() and (max_steps is None or k < max_steps):
            self.step()
            k += 1


def _block_floor(n: int, b: int) -> int:
    return (n // b) * b


def run_design(engine, recorder, design: CalibrationDesign, vocab_size: int, seed: int = 0,
               log: Callable[[str], None] = lambda m: None, warmup: bool = True) -> dict[int, float]:
    """Run every case of `design` through `engine` (an `EngineCore`), recording steps in `recorder`;
    returns the process CPU seconds of every step."""
    B = design.block_size
    budget = design.max_num_batched_tokens
    if warmup:  # one pass of each kind, not recorded
        w = _Driver(engine, None, vocab_size, seed + 1000)
        w.add(w.tokens(min(128, budget)), 1, "w")
        w.run()
        p = w.tokens(64)
        for _ in range(3):
            w.add(p + w.tokens(16), 4, "w")
        w.run()
    d = _Driver(engine, recorder, vocab_size, seed)
    # pure prefills after a cached prefix; shapes interleaved within each repeat
    prefixes = {}
    for s in design.prefill_prefixes:
        s = _block_floor(s, B)
        if s > 0:
            prefixes[s] = d.tokens(s)
            d.add(prefixes[s], 1, f"prefix{s}")  # computes (and caches) the prefix; a sample too
            d.run()
        else:
            prefixes[0] = []
    for rep in range(design.repeats):
        for s, prefix in prefixes.items():
            for q in design.prefill_chunks:
                if q > budget:
                    continue
                d.add(prefix + d.tokens(q), 1, f"p{q}s{s}")
                d.run()
        for k, q in design.prefill_batches:
            if k * q > budget or k > design.max_num_seqs:
                continue
            for _ in range(k):
                d.add(d.tokens(q), 1, f"pb{k}x{q}")
            d.run()
        for extra in design.partial_prefills:
            d.add(d.tokens(budget + extra), 1, f"pp{extra}")
            d.run()
    log(f"calibrate: prefill cases done ({len(recorder.steps)} steps)")
    # pure decodes: b requests with their own prompts of kv tokens (their batched, chunked prefills are
    # samples too), then `decode_steps` decode steps
    for rep in range(design.decode_repeats):
        for kv in design.decode_kv:
            for b in design.decode_batches:
                if b > design.max_num_seqs or b * kv > (design.max_decode_case_tokens or b * kv):
                    continue
                for _ in range(b):
                    d.add(d.tokens(kv), design.decode_steps + 1, f"d{b}kv{kv}")
                d.run()
    # pure decodes over a shared cached prefix (prefix-sharing workloads read the same KV blocks)
    for b, kv in design.decode_shared:
        plen = max(_block_floor(kv - 16, B), 0)
        prefix = d.tokens(plen)
        if plen:
            d.add(prefix, 1, f"dprefix{kv}")
            d.run()
        if b <= design.max_num_seqs and b * 16 <= budget:
            for _ in range(b):
                d.add(prefix + d.tokens(16), design.decode_steps + 1, f"ds{b}kv{kv}")
            d.run()
    log(f"calibrate: decode cases done ({len(recorder.steps)} steps)")
    # mixed: b decoding requests, then a new chunk joins them
    for rep in range(design.repeats if design.mixed_repeats is None else design.mixed_repeats):
        for b, kv, q in design.mixed:
            if (b > design.max_num_seqs - 1 or b + q > budget
                    or b * kv > design.block_size * design.num_gpu_blocks // 2):
                continue
            for _ in range(b):
                d.add(d.tokens(kv), 6, f"m{b}kv{kv}")
            while d.engine.has_work():  # their (possibly chunked) prefill, then one pure decode
                r = d.step()
                so = r.scheduled
                if so is not None and so.num_scheduled_tokens and all(
                        n == 1 for n in so.num_scheduled_tokens.values()):
                    break
            d.add(d.tokens(q), 1, f"mc{q}")
            d.run()  # mixed step(s), then the decodes finish
    log(f"calibrate: mixed cases done ({len(recorder.steps)} steps)")
    return d.cpu_s


# -- fitting ------------------------------------------------------------------------------------
def step_phase_class(num_context_reqs: int, num_generation_reqs: int) -> str:
    """Phase class of a step by its annotation: pure prefill, pure decode or mixed."""
    if num_context_reqs and num_generation_reqs:
        return "mixed"
    return "prefill" if num_context_reqs else "decode"


def step_rows(steps, step_requests) -> tuple[list[int], list[Any], np.ndarray, list[str]]:
    """(step numbers, per step its `servetwin.sim.cost_model.StepSummary` (rows' q and s, sampling rows, shared KV
    tokens), measured durations, phase classes) from trace tables (steps without rows or with a
    non-positive duration are skipped; traces written before `shared_kv_tokens` existed count 0)."""
    from servetwin.sim.cost_model import StepSummary  # noqa: PLC0415

    if len(step_requests) == 0:
        raise ValueError("calibrate: the trace has no step_requests rows (record_step_requests was off)")
    by_step: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for step, q, s, smp in zip(step_requests.step.to_numpy(), step_requests.num_tokens.to_numpy(),
                               step_requests.num_computed_before.to_numpy(), step_requests.samples.to_numpy()):
        e = by_step.setdefault(int(step), ([], [], [0]))
        e[0].append(int(q))
        e[1].append(int(s))
        e[2][0] += bool(smp)
    shared = (steps.shared_kv_tokens.to_numpy() if "shared_kv_tokens" in steps.columns
              else np.zeros(len(steps), dtype=int))
    numbers, rows, durations, phases = [], [], [], []
    for step, dur, nc, ng, sh in zip(steps.step.to_numpy(), steps.duration_s.to_numpy(),
                                     steps.num_context_reqs.to_numpy(), steps.num_generation_reqs.to_numpy(), shared):
        e = by_step.get(int(step))
        if e is None or not dur > 0:
            continue
        numbers.append(int(step))
        rows.append(StepSummary.from_lists(e[0], e[1], e[2][0], shared_kv=int(sh)))
        durations.append(float(dur))
        phases.append(step_phase_class(int(nc), int(ng)))
    return numbers, rows, np.asarray(durations), phases


def predicted_durations(frames: dict, cost_model) -> np.ndarray:
    """The cost model's prediction for each recorded step's own composition (NaN where it has no rows)."""
    nums, rows, _, _ = step_rows(frames["steps"], frames["step_requests"])
    pred = {n: cost_model.predict(summary).duration_s for n, summary in zip(nums, rows)}
    return np.array([pred.get(int(s), np.nan) for s in frames["steps"].step.to_numpy()])


def pct_stats(abs_pct: np.ndarray) -> dict[str, Any]:
    """p50 / p90 / p99 / mean / max / count of percentage errors (NaNs left out)."""
    a = np.asarray(abs_pct, dtype=float)
    a = a[np.isfinite(a)]
    if a.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None, "count": 0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean()),
            "max": float(a.max()), "count": int(a.size)}
