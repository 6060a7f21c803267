"""The drift probe: a few fixed engine steps that tell whether a CPU runs as fast as when calibrated.

A calibration describes the machine at the time it was measured. On a shared or virtual machine the
speed of this Python-heavy engine drifts with what the neighbours do (on the 2-vCPU VM this was written
on: the same steps 2x slower half an hour apart, with no process of ours running, while runs a few
seconds apart agreed within 3%). So `servetwin calibrate` measures the probe right after its design and
records how its fitted model scores it (`provenance.drift_probe`), and `servetwin compare` measures the
same probe again just before the scored runs. The drift is the ratio of the two measurements, so the
model's own error on the probe's shapes cancels:

    drift % = ((1 + e_now) / (1 + e_calibration) - 1) * 100,   e = median (predicted - measured) / measured

(negative: the machine is slower now). Each probe's steps are designed, never the scored run's. Steps
that lost their core for part of their time (process CPU time < 0.9 x wall: other processes, or a
hypervisor's steal on a virtual machine) are left out of the median: they measure the neighbours.

Design: single prefills of 32, 128 and 256 tokens and decode batches of 4 and 8 requests at 128 tokens
of context (4 steps each), three times, on a fresh engine over the given executor (token budget 256, 8
sequences, chunked prefill, prefix caching). It needs 64 KV blocks of 16 tokens; a pool too small for
it, a max_model_len under 257 tokens or another block size has no probe (`probe_args` returns None) - a drift is then unknown.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from servetwin.experiments.calibrate.design import CalibrationDesign, pct_stats, predicted_durations, run_design
from servetwin.experiments.calibrate.torch_measure import CONTENDED_BELOW, cpu_shares

PROBE_BLOCK_SIZE, PROBE_MIN_TOKENS = 16, 1024
MIN_CLEAN_STEPS = 10  # fewer uncontended steps than this: the median is taken over every step
PROBE = {"prefill_chunks": [32, 128, 256], "decode_batches": [4, 8], "decode_kv": [128], "decode_steps": 4,
         "repeats": 3, "max_num_batched_tokens": 256, "max_num_seqs": 8}
PROBE_DESIGN = dict(PROBE, block_size=PROBE_BLOCK_SIZE)  # as recorded: a probe is comparable to an equal one


def probe_args(engine_args: Any, num_gpu_blocks: int, max_model_len: int) -> Optional[Any]:
    """The engine arguments the probe runs with, or None when this engine cannot run it."""
    longest = max(max(PROBE["prefill_chunks"]) + 1, max(PROBE["decode_kv"]) + PROBE["decode_steps"])
    if (engine_args.block_size != PROBE_BLOCK_SIZE or num_gpu_blocks * PROBE_BLOCK_SIZE < PROBE_MIN_TOKENS
            or max_model_len < longest):
        return None
    return dataclasses.replace(engine_args, max_num_batched_tokens=PROBE["max_num_batched_tokens"],
                               max_num_seqs=PROBE["max_num_seqs"], enable_chunked_prefill=True,
                               enable_prefix_caching=True)


def measure_probe(engine_args: Any, info: Any) -> Optional[dict[str, Any]]:
    """Run the probe on a fresh engine over `info`'s executor; its trace frames (None: no probe here).
    The executor forgets the probe's requests after."""
    from servetwin.core.engine.engine_factory import create_engine_core  # noqa: PLC0415
    from servetwin.core.testbed.trace import TraceRecorder  # noqa: PLC0415

    args = probe_args(engine_args, info.num_gpu_blocks, info.max_model_len)
    if args is None:
        return None
    design = CalibrationDesign(prefill_chunks=PROBE["prefill_chunks"], prefill_prefixes=[0], prefill_batches=[],
                               partial_prefills=[], decode_batches=PROBE["decode_batches"],
                               decode_kv=PROBE["decode_kv"], decode_steps=PROBE["decode_steps"], decode_shared=[],
                               mixed=[], repeats=PROBE["repeats"], decode_repeats=1,
                               max_num_batched_tokens=PROBE["max_num_batched_tokens"],
                               max_num_seqs=PROBE["max_num_seqs"], num_gpu_blocks=info.num_gpu_blocks)
    import torch  # noqa: PLC0415

    info.executor.reset()
    engine, _ = create_engine_core(args, info=info)
    recorder = TraceRecorder("probe", "torch")
    cpu_s = run_design(engine, recorder, design, info.vocab_size or 256, seed=99, warmup=False)
    info.executor.reset()
    frames = recorder.frames()
    frames["cpu_share"] = cpu_shares(frames["steps"], cpu_s, torch.get_num_threads())
    return frames


def score_probe(frames: dict[str, Any], cost_model: Any) -> dict[str, Any]:
    """How `cost_model` predicts the probe's measured steps: the signed median and |error| stats (%)."""
    pred = predicted_durations(frames, cost_model)
    meas = frames["steps"].duration_s.to_numpy(dtype=float)
    signed = (pred - meas) / meas * 100.0
    ok = np.isfinite(signed)
    share = frames.get("cpu_share")
    contended = 0
    if share is not None:  # steps that lost their core (other processes, a hypervisor's steal) say nothing
        clean = ok & ~(np.asarray(share, dtype=float) < CONTENDED_BELOW)  # of this machine's own speed
        contended = int((ok & ~clean).sum())
        if clean.sum() >= MIN_CLEAN_STEPS:
            ok = clean
    return {"steps": int(ok.sum()), "contended_steps": contended,
            "signed_pct_error_median": float(np.median(signed[ok])) if ok.any() else None,
            "abs_pct_error": pct_stats(np.abs(signed[ok])), "design": PROBE_DESIGN}


def drift_pct(now: Optional[float], at_calibration: Optional[float]) -> Optional[float]:
    """The machine's speed now against when calibrated, from the two probes' signed medians (%)."""
    if now is None or at_calibration is None or at_calibration <= -100.0:
        return None
    return ((1.0 + now / 100.0) / (1.0 + at_calibration / 100.0) - 1.0) * 100.0


def probe_at_calibration(provenance: dict[str, Any]) -> Optional[float]:
    """The probe's signed median the calibration recorded for itself, when it ran the same probe."""
    rec = provenance.get("drift_probe") or {}
    if rec.get("design") != PROBE_DESIGN:
        return None
    return rec.get("signed_pct_error_median")
