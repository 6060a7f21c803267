"""Time a model's dense layer GEMMs at each token count M, through the kernels its forward uses.

`servetwin calibrate` turns these times into `Efficiency.gemm_m_curve` (the fraction of the dense peak
the layers' GEMMs reach at M tokens): on a CPU the BLAS library's time is not a smooth function of M
(kernels switch with M; `servetwin.sim.coefficients`), so the simulator follows the measured curve
instead of a half-saturation size. One layer's four projections (qkv, o, gate_up, down) are timed with
random activations - the values do not matter to the time - and the median of `repeats` runs is kept.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Iterable

import torch

from servetwin.gpu.models.layers import linear


def layer_projections(model: Any) -> list[tuple[torch.Tensor, Any]]:
    """(weight, bias) of the first layer's dense projections, in forward order."""
    layer = model.layers[0]
    mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    return [(m.weight, m.bias) for m in mods]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def layer_gemm_seconds(model: Any, ms: Iterable[int], repeats: int = 5, inner: int = 3) -> dict[int, float]:
    """{M: seconds of one layer's projections at M tokens} (median over `repeats` of `inner` runs each,
    after one warm-up run per M)."""
    projections = layer_projections(model)
    weight = projections[0][0]
    out: dict[int, float] = {}
    for m in ms:
        xs = [torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for w, _ in projections]
        for x, (w, b) in zip(xs, projections):  # warm-up: kernel selection, caches
            linear(x, w, b)
        times = []
        for _ in range(repeats):
            _sync(weight.device)
            t0 = time.perf_counter()
            for _ in range(inner):
                for x, (w, b) in zip(xs, projections):
                    linear(x, w, b)
            _sync(weight.device)
            times.append((time.perf_counter() - t0) / inner)
        out[int(m)] = statistics.median(times)
    return out


def curve_token_counts(max_tokens: int) -> list[int]:
    """Every M up to 64 (where kernels switch most), then steps of 8 to 128, 32 to 512, 128 beyond."""
    ms = list(range(1, 65)) + list(range(72, 129, 8)) + list(range(160, 513, 32)) + list(range(640, max_tokens + 1, 128))
    ms = [m for m in ms if m <= max_tokens]
    if ms[-1] != max_tokens:
        ms.append(max_tokens)
    return ms
