"""Fused native CPU kernels for a decoder layer's small ops (float32; built like `gpu/cpu_kernels.py`).

On a small model a step is bound by the number of torch ops, not by FLOPs: one `F.rms_norm` of a
`[16, 128]` batch is ~6 ATen ops and costs ~13 us on one thread, a routed MoE layer is ~25 ops plus
two batched GEMMs over every expert padded to the busiest one's rows. These kernels do each in one call:

1. `rms_norm` - RMSNorm over rows (HF numerics in float32: `(x * rsqrt(mean(x^2) + eps)) * w`); with a
   residual given it first adds it into `x` in place (vLLM's `fused_add_rms_norm`).
2. `qk_norm_rope` - in place on a packed `qkv` row: per-head RMSNorm of the q and k heads (Qwen3's
   q_norm / k_norm, when given), then the neox rotation of their first `rotary_dim` lanes with the
   cos/sin rows of each token's position (read straight from the rotary cache).
3. `fused_moe` - a whole routed MoE MLP: router logits, softmax, top-k (renormalised when the model
   says so), the (token, slot) pairs sorted by expert (counting sort), each expert's SwiGLU (gpt-oss:
   clamped, with biases) over exactly its rows in tiles of 4 (no padding, each weight row streamed once
   per tile), and each token's weighted sum of its k rows in slot order.

Results equal the torch ops up to float rounding (other summation orders, a Cephes `exp` in the
SwiGLU); tests/gpu/test_cpu_layer_kernels.py compares every kernel with the torch reference at random
shapes. `SERVETWIN_CPU_KERNELS=0` or no C compiler: the accessor returns None and the callers
(`RMSNorm`, `Attention`, `FusedMoE`) run their torch ops, which are also the CUDA path.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

from servetwin.gpu.cpu_kernels import C_PRELUDE, build_library

_SOURCE = C_PRELUDE + r"""
#include <stdlib.h>
#include <string.h>

/* ---- RMSNorm ------------------------------------------------------------------------------------ */

static inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
    const float r = 1.f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * w[i];
}

/* out[r] = RMSNorm(x[r]) * w for r < rows; with `res` given x[r] += res[r] first (in place). Row strides
   in floats (res: contiguous rows of n). */
void rms_norm(float* x, const float* res, const float* w, float* out, int64_t rows, int64_t n,
              int64_t x_stride, int64_t out_stride, float eps, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (rows * n > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        float* xr = x + r * x_stride;
        if (res)
            for (int64_t i = 0; i < n; ++i) xr[i] += res[r * n + i];
        norm_row(xr, w, out + r * out_stride, n, eps);
    }
}

/* ---- q/k RMSNorm + neox RoPE, in place ---------------------------------------------------------- */

/* qkv [T, stride]: heads 0..H-1 (q) then H..H+HKV-1 (k), D floats each from column 0. Per head: RMSNorm
   with qw / kw (when not NULL), then out_i = x_i cos_i - x_{i+h} sin_i, out_{i+h} = x_{i+h} cos_{i+h} +
   x_i sin_{i+h} (h = rot / 2) with the cache rows [P, rot] of pos[t]; lanes rot..D-1 are left as they are.
   Returns -1 (nothing written) when a position is outside the cache. */
int qk_norm_rope(float* qkv, int64_t T, int64_t stride, int64_t H, int64_t HKV, int64_t D, const float* qw,
                 const float* kw, float eps, const float* cos_c, const float* sin_c, int64_t rot, int64_t P,
                 const int64_t* pos, int nthreads) {
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < T; ++t)
        if (pos[t] < 0 || pos[t] >= P) return -1;
    #pragma omp parallel for num_threads(nthreads) if (T * (H + HKV) * D > 65536)
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos_c + pos[t] * rot;
        const float* s = sin_c + pos[t] * rot;
        for (int64_t j = 0; j < H + HKV; ++j) {
            float* h = qkv + t * stride + j * D;
            const float* w = j < H ? qw : kw;
            if (w) norm_row(h, w, h, D, eps);
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = h[i], x2 = h[i + half];
                h[i] = x1 * c[i] - x2 * s[i];
                h[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
    return 0;
}

/* ---- routed MoE ----------------------------------------------------------------------------------- */

/* y[r] = bias + a[r] . w for R (<= 4) rows against an input-major weight w [K, N] (row-major): each weight
   row is loaded once per tile and used for the R rows; 64 output columns at a time in 16 accumulators. */
static inline __attribute__((always_inline)) void mm_tile(const float* const* a, const int R, const float* w,
                                                          const float* bias, int64_t K, int64_t N,
                                                          float* const* y) {
    int64_t c = 0;
    for (; c + 64 <= N; c += 64) {
        v16 acc[4][4];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) acc[r][i] = bias ? ld(bias + c + 16 * i) : splat(0.f);
        for (int64_t k = 0; k < K; ++k) {
            const float* wk = w + k * N + c;
            const v16 w0 = ld(wk), w1 = ld(wk + 16), w2 = ld(wk + 32), w3 = ld(wk + 48);
            for (int r = 0; r < R; ++r) {
                const v16 xa = splat(a[r][k]);
                acc[r][0] += xa * w0; acc[r][1] += xa * w1; acc[r][2] += xa * w2; acc[r][3] += xa * w3;
            }
        }
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) *(v16*)(y[r] + c + 16 * i) = acc[r][i];
    }
    for (; c + 16 <= N; c += 16) {
        v16 acc[4];
        for (int r = 0; r < R; ++r) acc[r] = bias ? ld(bias + c) : splat(0.f);
        for (int64_t k = 0; k < K; ++k) {
            const v16 w0 = ld(w + k * N + c);
            for (int r = 0; r < R; ++r) acc[r] += splat(a[r][k]) * w0;
        }
        for (int r = 0; r < R; ++r) *(v16*)(y[r] + c) = acc[r];
    }
    for (; c < N; ++c)
        for (int r = 0; r < R; ++r) {
            float v = bias ? bias[c] : 0.f;
            for (int64_t k = 0; k < K; ++k) v += a[r][k] * w[k * N + c];
            y[r][c] = v;
        }
}

static void mm_rows(const float* const* a, int R, const float* w, const float* bias, int64_t K, int64_t N,
                    float* const* y) {
    switch (R) {  /* a constant R per case: the tile's loops over rows unroll, accumulators stay in registers */
        case 4: mm_tile(a, 4, w, bias, K, N, y); break;
        case 3: mm_tile(a, 3, w, bias, K, N, y); break;
        case 2: mm_tile(a, 2, w, bias, K, N, y); break;
        default: mm_tile(a, 1, w, bias, K, N, y); break;
    }
}

/* out[0..I) = act(gate = h[0..I), up = h[I..2I)): silu(gate) * up, or with a limit (gpt-oss)
   (clamp(up, -limit, limit) + 1) * gate' * sigmoid(alpha * gate'), gate' = min(gate, limit).
   sigmoid(z) from e = exp(-|z|) <= 1: 1 / (1 + e) for z >= 0, e / (1 + e) below. */
static void swiglu_row(const float* h, float* out, int64_t I, int has_limit, float limit, float alpha) {
    int64_t i = 0;
    const float sa = has_limit ? alpha : 1.f;
    for (; i + 16 <= I; i += 16) {
        v16 g = ld(h + i), u = ld(h + I + i);
        if (has_limit) {
            g = vsel(g > splat(limit), splat(limit), g);
            u = vsel(u > splat(limit), splat(limit), vsel(u < splat(-limit), splat(-limit), u));
            u = u + splat(1.f);
        }
        const v16 z = g * splat(sa);
        const v16 e = vexp_neg(vsel(z > splat(0.f), -z, z));
        const v16 sig = vsel(z >= splat(0.f), splat(1.f) / (splat(1.f) + e), e / (splat(1.f) + e));
        *(v16*)(out + i) = (g * sig) * u;
    }
    for (; i < I; ++i) {
        float g = h[i], u = h[I + i];
        if (has_limit) {
            g = g > limit ? limit : g;
            u = u > limit ? limit : (u < -limit ? -limit : u);
            u += 1.f;
        }
        const float z = g * sa, e = expf(-fabsf(z));
        out[i] = (g * (z >= 0.f ? 1.f / (1.f + e) : e / (1.f + e))) * u;
    }
}

/* Router for one token: probs = softmax(x . gw^T + gb) over E experts, the top K (first index on ties),
   renormalised to sum 1 when `renorm`. */
static void route(const float* x, const float* gw, const float* gb, int64_t E, int64_t Hd, int64_t K,
                  int renorm, float* p, int32_t* ids, float* wts) {
    float m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) {
        p[e] = dot(x, gw + e * Hd, Hd) + (gb ? gb[e] : 0.f);
        m = p[e] > m ? p[e] : m;
    }
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) { p[e] = expf(p[e] - m); sum += p[e]; }
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    float tot = 0.f;
    for (int64_t j = 0; j < K; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
            if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
        if (best < 0) best = j;  /* NaN logits: any valid index (the output is NaN anyway) */
        ids[j] = (int32_t)best;
        wts[j] = p[best];
        tot += p[best];
        p[best] = -1.f;  /* taken */
    }
    if (renorm)
        for (int64_t j = 0; j < K; ++j) wts[j] /= tot;
}

/* out [T, Hd] = the MoE MLP of x [T, Hd]: router gw [E, Hd] (+ gb [E]), experts w13 [E, Hd, 2I] (gate
   columns, then up; + b13 [E, 2I]) and w2 [E, I, Hd] (+ b2 [E, Hd]). Returns 0, or -1 if out of memory. */
int fused_moe(const float* x, int64_t T, int64_t Hd, const float* gw, const float* gb, int64_t E, int64_t K,
              int renorm, const float* w13, const float* b13, const float* w2, const float* b2, int64_t I,
              int has_limit, float limit, float alpha, float* out, int nthreads) {
    const int64_t P = T * K;
    int32_t* ids = malloc(P * sizeof(int32_t));
    float* wts = malloc(P * sizeof(float));
    int64_t* order = malloc(P * sizeof(int64_t));
    int64_t* start = calloc(E + 1, sizeof(int64_t));
    float* rows = malloc(P * Hd * sizeof(float));  /* each (token, slot) pair's expert output */
    float* probs = malloc(T * E * sizeof(float));
    int rc = 0;
    if (!ids || !wts || !order || !start || !rows || !probs) { rc = -1; goto done; }
    #pragma omp parallel for num_threads(nthreads) if (T * E * Hd > 262144)
    for (int64_t t = 0; t < T; ++t)
        route(x + t * Hd, gw, gb, E, Hd, K, renorm, probs + t * E, ids + t * K, wts + t * K);
    /* counting sort of the pairs by expert (stable: token order within an expert) */
    for (int64_t q = 0; q < P; ++q) start[ids[q] + 1]++;
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    {
        int64_t* fill = malloc(E * sizeof(int64_t));
        if (!fill) { rc = -1; goto done; }
        memcpy(fill, start, E * sizeof(int64_t));
        for (int64_t q = 0; q < P; ++q) order[fill[ids[q]]++] = q;
        free(fill);
    }
    #pragma omp parallel num_threads(nthreads)
    {
        float* h = malloc(4 * 3 * I * sizeof(float));  /* a tile's gate|up rows [4, 2I] and activations [4, I] */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < E; ++e) {
            if (!h) continue;
            for (int64_t s = start[e]; s < start[e + 1]; s += 4) {
                const int R = (int)(start[e + 1] - s < 4 ? start[e + 1] - s : 4);
                const float* xa[4]; float* hy[4]; const float* aa[4]; float* ya[4];
                for (int r = 0; r < R; ++r) {
                    const int64_t q = order[s + r];
                    xa[r] = x + (q / K) * Hd;
                    hy[r] = h + r * 2 * I;
                    aa[r] = h + 8 * I + r * I;
                    ya[r] = rows + q * Hd;
                }
                mm_rows(xa, R, w13 + e * Hd * 2 * I, b13 ? b13 + e * 2 * I : NULL, Hd, 2 * I, hy);
                for (int r = 0; r < R; ++r) swiglu_row(hy[r], (float*)aa[r], I, has_limit, limit, alpha);
                mm_rows(aa, R, w2 + e * I * Hd, b2 ? b2 + e * Hd : NULL, I, Hd, ya);
            }
        }
        if (!h) rc = -1;
        free(h);
    }
    #pragma omp parallel for num_threads(nthreads) if (T * K * Hd > 262144)
    for (int64_t t = 0; t < T; ++t) {  /* each token's weighted sum of its k rows, in slot order */
        float* o = out + t * Hd;
        const float* r0 = rows + t * K * Hd;
        for (int64_t i = 0; i < Hd; ++i) o[i] = wts[t * K] * r0[i];
        for (int64_t j = 1; j < K; ++j) {
            const float wj = wts[t * K + j];
            const float* rj = r0 + j * Hd;
            for (int64_t i = 0; i < Hd; ++i) o[i] += wj * rj[i];
        }
    }
done:
    free(ids); free(wts); free(order); free(start); free(rows); free(probs);
    return rc;
}
"""

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class LayerKernels:
    """ctypes wrappers of the three kernels; every tensor float32 on the CPU (`layer_kernels_for`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms = lib.rms_norm
        self._rms.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _F, _C]
        self._rms.restype = None
        self._rope = lib.qk_norm_rope
        self._rope.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _F, _P, _P, _I, _I, _P, _C]
        self._rope.restype = _C
        self._moe = lib.fused_moe
        self._moe.argtypes = [_P, _I, _I, _P, _P, _I, _I, _C, _P, _P, _P, _P, _I, _C, _F, _F, _P, _C]
        self._moe.restype = _C

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """RMSNorm of the rows of `x` (`[..., n]`, rows contiguous); with `residual` (same shape,
        contiguous) `x += residual` first, in place. Returns a new contiguous tensor."""
        n = x.shape[-1]
        assert x.stride(-1) == 1 and weight.is_contiguous() and weight.shape == (n,)
        x2 = x.view(-1, n)
        assert residual is None or (residual.is_contiguous() and residual.shape == x.shape)
        out = torch.empty(x.shape, dtype=torch.float32)
        self._rms(x2.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), x2.shape[0], n,
                  x2.stride(0), n, eps, torch.get_num_threads())
        return out

    def qk_norm_rope(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor], eps: float,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor) -> None:
        """In place on `qkv` `[T, >= (H + Hkv) * D]` (contiguous rows): the q and k heads normalised
        (when weights are given) and rotated; `cos_cache`/`sin_cache` `[P, rotary_dim]`, positions int64
        `[T]` (IndexError, qkv untouched, if one is outside [0, P))."""
        T = qkv.shape[0]
        assert qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= (num_heads + num_kv_heads) * head_dim
        assert cos_cache.is_contiguous() and sin_cache.is_contiguous() and positions.dtype == torch.int64
        pos = positions.contiguous()
        if self._rope(qkv.data_ptr(), T, qkv.stride(0), num_heads, num_kv_heads, head_dim, _ptr(q_weight),
                      _ptr(k_weight), eps, cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[1],
                      cos_cache.shape[0], pos.data_ptr(), torch.get_num_threads()) != 0:
            raise IndexError(f"qk_norm_rope: a position is outside the rotary cache of {cos_cache.shape[0]}")

    def fused_moe(self, x: torch.Tensor, gate_w: torch.Tensor, gate_b: Optional[torch.Tensor], w13: torch.Tensor,
                  w13_b: Optional[torch.Tensor], w2: torch.Tensor, w2_b: Optional[torch.Tensor], top_k: int,
                  renormalize: bool, swiglu_limit: Optional[float], swiglu_alpha: float) -> torch.Tensor:
        """The routed MoE MLP of `x` `[T, Hd]` (see the module docstring); weights as `FusedMoE` holds them."""
        T, Hd = x.shape
        E, I = w13.shape[0], w2.shape[1]
        assert w13.shape == (E, Hd, 2 * I) and w2.shape == (E, I, Hd) and gate_w.shape == (E, Hd)
        ts = [x, gate_w, gate_b, w13, w13_b, w2, w2_b]
        assert all(t is None or t.is_contiguous() for t in ts)
        out = torch.empty(T, Hd, dtype=torch.float32)
        if T == 0:
            return out
        rc = self._moe(x.data_ptr(), T, Hd, gate_w.data_ptr(), _ptr(gate_b), E, top_k, int(renormalize),
                       w13.data_ptr(), _ptr(w13_b), w2.data_ptr(), _ptr(w2_b), I, int(swiglu_limit is not None),
                       0.0 if swiglu_limit is None else swiglu_limit, swiglu_alpha, out.data_ptr(),
                       torch.get_num_threads())
        if rc != 0:
            raise MemoryError("fused_moe: out of memory")
        return out


_lock = threading.Lock()
_kernels: Optional[LayerKernels] = None
_tried = False


def layer_kernels() -> Optional[LayerKernels]:
    """The fused layer kernels, or None (disabled, no compiler, build failure: use the torch ops)."""
    global _kernels, _tried
    if not _tried:
        with _lock:
            if not _tried:
                lib = build_library("servetwin_cpu_layer_kernels", _SOURCE)
                _kernels = None if lib is None else LayerKernels(lib)
                _tried = True
    return _kernels


def layer_kernels_for(*tensors: Optional[torch.Tensor]) -> Optional[LayerKernels]:
    """The kernels when every given tensor is float32 on the CPU and autograd is off (the kernels write
    raw memory), else None. Checked before any build: a CUDA model never compiles or loads them."""
    if torch.is_grad_enabled() or not all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32)
                                          for t in tensors):
        return None
    return layer_kernels()
