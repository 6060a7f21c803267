"""Native CPU kernels for the decode steps of the torch backend (float32; plain C, built on first use).

1. `paged_decode_attention` - paged attention for one query token per request. The pure-torch path
   gathers every request's blocks into a contiguous buffer (`index_select`) and runs SDPA over it: the
   KV cache is read, written to the buffer and read again, and SDPA's CPU kernel is slow for one query
   row per head. This kernel reads each request's blocks straight from the paged cache, once: per
   request it walks the block table, scores a block's 16 keys for every head (vectorised; the last
   partial block masked) and accumulates the values, prefetching the next block. Block size 16 and a
   head dim that is a multiple of 16 (the fast path) take three passes: all scores into a per-thread
   buffer, one softmax per head over the whole row, then the values (tiny-qwen3-moe's 4 heads of 32,
   one thread: 277 -> 202 us for 16 requests of 400 tokens with the blocks in cache, 389 -> 285 us with
   them spread over a 4352-block cache, against an online softmax whose per-block max/exp/sum and
   rescaling cost more than the dot products at this head dim); other sizes keep an online softmax.
2. `small_m_linear` - `x @ w.T (+ b)` for a handful of rows (a decode batch). A decode step streams
   every weight once; MKL's sgemm reaches well under half of the memory bandwidth at M ~ 16, this
   kernel streams the weights 4 rows at a time against 4 input rows held in L1 and prefetches ahead
   (x1.4-1.9 at 4-16 rows; `servetwin.gpu.models.layers.linear` uses it up to `SMALL_M_MAX` rows).
3. `argmax_rows` - greedy sampling's `argmax(-1)` (first maximum; a NaN counts as the maximum, as in
   torch), single-threaded: torch's parallel argmax over a `[16, 49152]` batch costs 1-8 ms here.

Work is spread over OpenMP threads (torch's own OpenMP runtime, already loaded by torch;
`torch.get_num_threads()` threads). Results equal the torch ops up to float rounding (other summation
orders; the linear kernel's error against float64 is below MKL's on the shapes measured) - the tests
compare both paths (tests/gpu/test_cpu_kernels.py, tests/gpu/test_torch_paged_attention.py).

The C source is compiled on first use with the system C compiler (`cc -O3 -march=native -fopenmp`)
into a cache directory (`$SERVETWIN_KERNEL_CACHE`, default `~/.cache/servetwin/kernels`), keyed by the
source, the flags, the compiler and the CPU, and loaded with ctypes (which releases the GIL during a
call). When no compiler is found, the build fails, or `SERVETWIN_CPU_KERNELS=0`, the accessors return
None and callers use the torch ops.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

MAX_HEADS, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 64, 256, 64

C_PRELUDE = r"""
#include <math.h>
#include <stdint.h>

/* Shared by every kernel library: GCC/Clang vector extensions (16 float lanes) and a few helpers. */

/* Dot product in 16 independent lanes (vectorised without reassociating a single sum). */
static inline float dot(const float* a, const float* b, int64_t D) {
    float p[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16)
        for (int j = 0; j < 16; ++j) p[j] += a[d + j] * b[d + j];
    float s = 0.f;
    for (; d < D; ++d) s += a[d] * b[d];
    for (int j = 0; j < 8; ++j) p[j] += p[j + 8];
    for (int j = 0; j < 4; ++j) p[j] += p[j + 4];
    return s + ((p[0] + p[2]) + (p[1] + p[3]));
}

typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16 __attribute__((vector_size(64), aligned(4), may_alias));

static inline v16 ld(const float* p) { return *(const v16*)p; }
static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16 vsel(i16 m, v16 a, v16 b) { return (v16)(((i16)a & m) | ((i16)b & ~m)); }

/* Lane t of the result = the sum of P[t]'s 16 lanes (a fixed pairwise tree, 15 shuffle-adds). */
static inline v16 transpose_sum16(const v16* P) {
    const i16 m1l = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 m1h = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 m2l = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const i16 m2h = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const i16 m3l = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const i16 m3h = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const i16 m4l = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i16 m4h = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 c[8], d[4], e[2];
    for (int i = 0; i < 8; ++i)  /* c[i]: lanes 0-7 partial sums of P[2i], lanes 8-15 of P[2i+1] */
        c[i] = __builtin_shuffle(P[2 * i], P[2 * i + 1], m1l) + __builtin_shuffle(P[2 * i], P[2 * i + 1], m1h);
    for (int i = 0; i < 4; ++i)  /* d[i]: 4 partials each of P[4i .. 4i+3] */
        d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], m2l) + __builtin_shuffle(c[2 * i], c[2 * i + 1], m2h);
    for (int i = 0; i < 2; ++i)  /* e[i]: 2 partials each of P[8i .. 8i+7] */
        e[i] = __builtin_shuffle(d[2 * i], d[2 * i + 1], m3l) + __builtin_shuffle(d[2 * i], d[2 * i + 1], m3h);
    return __builtin_shuffle(e[0], e[1], m4l) + __builtin_shuffle(e[0], e[1], m4h);
}

static inline float hmax(v16 a) {
    float m = a[0];
    for (int i = 1; i < 16; ++i) m = a[i] > m ? a[i] : m;
    return m;
}

static inline float hsum(v16 a) {
    float t[8];
    for (int j = 0; j < 8; ++j) t[j] = a[j] + a[j + 8];
    for (int j = 0; j < 4; ++j) t[j] += t[j + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* exp(x) for x <= 0 (Cephes expf: Cody-Waite reduction and a degree-5 polynomial, ~1 ulp, like
   SDPA's vectorised exp); below -87 it returns ~2^-126 instead of 0 (masked lanes are zeroed). */
static inline v16 vexp_neg(v16 x) {
    x = vsel(x < splat(-87.0f), splat(-87.0f), x);
    const v16 magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v16 n = (x * splat(1.44269504088896341f) + magic) - magic;
    v16 r = x - n * splat(0.693359375f);
    r = r + n * splat(2.12194440e-4f);
    v16 p = splat(1.9875691500E-4f);
    p = p * r + splat(1.3981999507E-3f);
    p = p * r + splat(8.3334519073E-3f);
    p = p * r + splat(4.1665795894E-2f);
    p = p * r + splat(1.6666665459E-1f);
    p = p * r + splat(5.0000001201E-1f);
    p = p * r * r + r + splat(1.0f);
    const i16 e = (__builtin_convertvector(n, i16) + 127) << 23;
    return p * (v16)e;
}
"""

_SOURCE = C_PRELUDE + r"""
#include <stdlib.h>

#define MAXH %(max_heads)d
#define MAXD %(max_head_dim)d
#define MAXBS %(max_block_size)d

/* ---- generic path: any block size and head dim ---------------------------------------------- */

static inline void prefetch_block(const float* k_cache, const float* v_cache, int64_t blk, int64_t floats) {
    const char* nk = (const char*)(k_cache + blk * floats);
    const char* nv = (const char*)(v_cache + blk * floats);
    for (int64_t off = 0; off < floats * (int64_t)sizeof(float); off += 64) {
        __builtin_prefetch(nk + off, 0, 3);
        __builtin_prefetch(nv + off, 0, 3);
    }
}

static void decode_one_generic(const float* qp, float* op, const float* k_cache, const float* v_cache,
                               const int64_t* bt, int64_t L, int64_t H, int64_t HKV, int64_t D,
                               int64_t BS, float scale) {
    const int64_t G = H / HKV;
    const int64_t blk_floats = BS * HKV * D;
    float m[MAXH], l[MAXH], acc[MAXH * MAXD], s[MAXH * MAXBS];
    for (int64_t j = 0; j < H; ++j) { m[j] = -INFINITY; l[j] = 0.f; }
    for (int64_t i = 0; i < H * D; ++i) acc[i] = 0.f;
    const int64_t nblk = (L + BS - 1) / BS;
    for (int64_t b = 0; b < nblk; ++b) {
        const int64_t n = (L - b * BS) < BS ? (L - b * BS) : BS;
        const float* kb = k_cache + bt[b] * blk_floats;
        const float* vb = v_cache + bt[b] * blk_floats;
        if (b + 1 < nblk) prefetch_block(k_cache, v_cache, bt[b + 1], blk_floats);
        for (int64_t t = 0; t < n; ++t)  /* the block's keys in memory order */
            for (int64_t j = 0; j < H; ++j)
                s[j * MAXBS + t] = dot(qp + j * D, kb + (t * HKV + j / G) * D, D) * scale;
        for (int64_t j = 0; j < H; ++j) {
            float* sj = s + j * MAXBS;
            float bm = -INFINITY;
            for (int64_t t = 0; t < n; ++t) bm = sj[t] > bm ? sj[t] : bm;
            const float nm = bm > m[j] ? bm : m[j];
            const float alpha = expf(m[j] - nm);
            float sum = 0.f;
            for (int64_t t = 0; t < n; ++t) { sj[t] = expf(sj[t] - nm); sum += sj[t]; }
            l[j] = l[j] * alpha + sum;
            m[j] = nm;
            float* a = acc + j * D;
            for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        }
        for (int64_t t = 0; t < n; ++t)
            for (int64_t j = 0; j < H; ++j) {
                const float p = s[j * MAXBS + t];
                const float* vt = vb + (t * HKV + j / G) * D;
                float* a = acc + j * D;
                for (int64_t d = 0; d < D; ++d) a[d] += p * vt[d];
            }
    }
    for (int64_t j = 0; j < H; ++j) {
        const float inv = 1.f / l[j];
        for (int64_t d = 0; d < D; ++d) op[j * D + d] = acc[j * D + d] * inv;
    }
}

/* ---- fast path: block size 16, head dim a multiple of 16 -------------------------------------- */

/* One request's scores [H][nblk * 16], a per-thread buffer grown on demand and kept (NULL: no memory). */
static __thread float* score_buf = NULL;
static __thread int64_t score_cap = 0;

static float* score_space(int64_t n) {
    if (n > score_cap) {
        float* p = realloc(score_buf, n * sizeof(float));
        if (!p) return NULL;
        score_buf = p;
        score_cap = n;
    }
    return score_buf;
}

static inline void prefetch_one(const float* cache, int64_t blk, int64_t floats) {
    const char* p = (const char*)(cache + blk * floats);
    for (int64_t off = 0; off < floats * (int64_t)sizeof(float); off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* Three passes over one request (no online rescaling: with a small head dim the per-block max, exp and
   sum of an online softmax cost more than the dot products): 1. every head's scores, 16 keys at a time
   (one transpose-sum per block and head); 2. per head the max, exp(s - max) and 1 / sum over the whole
   row; 3. the values accumulated key by key, all heads' accumulators in flight at once. Returns -1 when
   the score buffer cannot grow. */
static int decode_one_vec(const float* qp, float* op, const float* k_cache, const float* v_cache,
                          const int64_t* bt, int64_t L, int64_t H, int64_t HKV, int64_t D, float scale) {
    const int64_t G = H / HKV, DV = D / 16, BS = 16;
    const int64_t blk_floats = BS * HKV * D;
    const int64_t nblk = (L + BS - 1) / BS, Lp = nblk * BS;
    float* s = score_space(H * Lp);
    if (!s) return -1;
    float inv[MAXH];
    v16 acc[MAXH * MAXD / 16], q[MAXH * MAXD / 16];
    for (int64_t i = 0; i < H * DV; ++i) { acc[i] = splat(0.f); q[i] = ld(qp + i * 16) * splat(scale); }
    const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t b = 0; b < nblk; ++b) {  /* 1: scores, lanes past L set to -inf */
        const int64_t n = (L - b * BS) < BS ? (L - b * BS) : BS;
        const float* kb = k_cache + bt[b] * blk_floats;
        if (b + 1 < nblk) prefetch_one(k_cache, bt[b + 1], blk_floats);
        const i16 valid = lane < splat((float)n);
        for (int64_t j = 0; j < H; ++j) {
            const int64_t h = j / G;
            const v16* qj = q + j * DV;
            v16 P[16];  /* P[t]: 16 partial products of q_j . k_t */
            for (int64_t t = 0; t < 16; ++t) {
                if (t < n) {
                    const float* kr = kb + (t * HKV + h) * D;
                    v16 x = ld(kr) * qj[0];
                    for (int64_t c = 1; c < DV; ++c) x += ld(kr + c * 16) * qj[c];
                    P[t] = x;
                } else {
                    P[t] = splat(0.f);
                }
            }
            *(v16*)(s + j * Lp + b * BS) = vsel(valid, transpose_sum16(P), splat(-INFINITY));
        }
    }
    for (int64_t j = 0; j < H; ++j) {  /* 2: softmax numerators in place, 1 / sum */
        float* sj = s + j * Lp;
        v16 vm = ld(sj);
        for (int64_t i = BS; i < Lp; i += BS) { const v16 x = ld(sj + i); vm = vsel(x > vm, x, vm); }
        const v16 m = splat(hmax(vm));
        v16 sum = splat(0.f);
        for (int64_t i = 0; i < Lp; i += BS) {
            const v16 p = vsel(lane < splat((float)(L - i)), vexp_neg(ld(sj + i) - m), splat(0.f));
            *(v16*)(sj + i) = p;
            sum += p;
        }
        inv[j] = 1.f / hsum(sum);
    }
    for (int64_t b = 0; b < nblk; ++b) {  /* 3: values */
        const int64_t n = (L - b * BS) < BS ? (L - b * BS) : BS;
        const float* vb = v_cache + bt[b] * blk_floats;
        if (b + 1 < nblk) prefetch_one(v_cache, bt[b + 1], blk_floats);
        for (int64_t t = 0; t < n; ++t)
            for (int64_t j = 0; j < H; ++j) {
                const float* vr = vb + (t * HKV + j / G) * D;
                const v16 pt = splat(s[j * Lp + b * BS + t]);
                for (int64_t c = 0; c < DV; ++c) acc[j * DV + c] += pt * ld(vr + c * 16);
            }
    }
    for (int64_t j = 0; j < H; ++j) {
        const v16 w = splat(inv[j]);
        for (int64_t c = 0; c < DV; ++c) *(v16*)(op + (j * DV + c) * 16) = acc[j * DV + c] * w;
    }
    return 0;
}

/* out[q_tok[r]] = softmax(scale * q[q_tok[r]] . K_r^T) V_r for r < R, where K_r/V_r are the first
   seq_lens[r] slots of request r's blocks (block_table row r). q/out: [T, H, D]; caches:
   [num_blocks, BS, HKV, D]; query head j reads KV head j / (H / HKV). One request per task. Returns 0,
   -1 when a size exceeds the static buffers, -2 when the score buffer cannot grow. */
int paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                           const int64_t* block_table, int64_t bt_stride, const int64_t* seq_lens,
                           const int64_t* q_tok, float* out, int64_t R, int64_t H, int64_t HKV,
                           int64_t D, int64_t BS, float scale, int nthreads) {
    const int64_t G = H / HKV;
    if (H > MAXH || D > MAXD || BS > MAXBS || HKV <= 0 || G * HKV != H) return -1;
    const int vec = BS == 16 && D %% 16 == 0;
    int rc = 0;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r) {
        const float* qp = q + q_tok[r] * H * D;
        float* op = out + q_tok[r] * H * D;
        if (vec) {
            if (decode_one_vec(qp, op, k_cache, v_cache, block_table + r * bt_stride, seq_lens[r], H, HKV, D,
                               scale) != 0)
                rc = -2;
        } else {
            decode_one_generic(qp, op, k_cache, v_cache, block_table + r * bt_stride, seq_lens[r], H, HKV, D,
                               BS, scale);
        }
    }
    return rc;
}

/* ---- small-M linear: out[M, N] = x[M, K] . w[N, K]^T (+ bias), for decode-sized M --------------- */
/* MKL's sgemm reaches ~40%% of the memory bandwidth at M ~ 16 (weight-streaming bound); this kernel
   streams the weights once, 4 rows at a time, against 4 input rows held in L1 (16 accumulators of
   16 lanes, one transpose-sum per 4x4 tile), prefetching the weight stream ahead. */

#define LIN_PF 8192  /* bytes ahead along each weight row */

static inline void lin_tile44(const float* x, const float* w, const float* bias, float* out,
                              int64_t N, int64_t K, int64_t n, int pf) {
    const int64_t K16 = K / 16 * 16;
    v16 a[16];
    for (int i = 0; i < 16; ++i) a[i] = splat(0.f);
    const float* w0 = w + n * K; const float* w1 = w0 + K; const float* w2 = w1 + K; const float* w3 = w2 + K;
    const float* x0 = x; const float* x1 = x + K; const float* x2 = x + 2 * K; const float* x3 = x + 3 * K;
    for (int64_t k = 0; k < K16; k += 16) {
        if (pf) {
            __builtin_prefetch((const char*)(w0 + k) + LIN_PF, 0, 1);
            __builtin_prefetch((const char*)(w1 + k) + LIN_PF, 0, 1);
            __builtin_prefetch((const char*)(w2 + k) + LIN_PF, 0, 1);
            __builtin_prefetch((const char*)(w3 + k) + LIN_PF, 0, 1);
        }
        const v16 W0 = ld(w0 + k), W1 = ld(w1 + k), W2 = ld(w2 + k), W3 = ld(w3 + k);
        const v16 X0 = ld(x0 + k), X1 = ld(x1 + k), X2 = ld(x2 + k), X3 = ld(x3 + k);
        a[0] += W0 * X0; a[1] += W0 * X1; a[2] += W0 * X2; a[3] += W0 * X3;
        a[4] += W1 * X0; a[5] += W1 * X1; a[6] += W1 * X2; a[7] += W1 * X3;
        a[8] += W2 * X0; a[9] += W2 * X1; a[10] += W2 * X2; a[11] += W2 * X3;
        a[12] += W3 * X0; a[13] += W3 * X1; a[14] += W3 * X2; a[15] += W3 * X3;
    }
    const v16 s = transpose_sum16(a);  /* lane 4i + j: weight row n + i . input row j */
    for (int i = 0; i < 4; ++i) {
        const float* wr = w + (n + i) * K;
        for (int j = 0; j < 4; ++j) {
            float v = s[i * 4 + j];
            for (int64_t k = K16; k < K; ++k) v += x[j * K + k] * wr[k];
            out[j * N + n + i] = bias ? v + bias[n + i] : v;
        }
    }
}

static inline void lin_tile41(const float* x, const float* w, const float* bias, float* out,
                              int64_t N, int64_t K, int64_t n, int pf) {
    const int64_t K16 = K / 16 * 16;
    v16 a[4];
    for (int i = 0; i < 4; ++i) a[i] = splat(0.f);
    const float* w0 = w + n * K; const float* w1 = w0 + K; const float* w2 = w1 + K; const float* w3 = w2 + K;
    for (int64_t k = 0; k < K16; k += 16) {
        if (pf) {
            __builtin_prefetch((const char*)(w0 + k) + LIN_PF, 0, 1);
            __builtin_prefetch((const char*)(w1 + k) + LIN_PF, 0, 1);
            __builtin_prefetch((const char*)(w2 + k) + LIN_PF, 0, 1);
            __builtin_prefetch((const char*)(w3 + k) + LIN_PF, 0, 1);
        }
        const v16 X0 = ld(x + k);
        a[0] += ld(w0 + k) * X0; a[1] += ld(w1 + k) * X0; a[2] += ld(w2 + k) * X0; a[3] += ld(w3 + k) * X0;
    }
    for (int i = 0; i < 4; ++i) {
        const float* wr = w + (n + i) * K;
        float v = hsum(a[i]);
        for (int64_t k = K16; k < K; ++k) v += x[k] * wr[k];
        out[n + i] = bias ? v + bias[n + i] : v;
    }
}

int small_m_linear(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t N,
                   int64_t K, int nthreads) {
    const int64_t N4 = N / 4 * 4;
    /* dynamic chunks of 8 tiles: on a busy machine a descheduled thread holds up the others less */
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 8)
    for (int64_t n = 0; n < N4; n += 4) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) lin_tile44(x + m * K, w, bias, out + m * N, N, K, n, m == 0);
        for (; m < M; ++m) lin_tile41(x + m * K, w, bias, out + m * N, N, K, n, m == 0);
    }
    for (int64_t n = N4; n < N; ++n)  /* the last N %% 4 outputs */
        for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * K; const float* wr = w + n * K;
            float v = dot(xr, wr, K);
            out[m * N + n] = bias ? v + bias[n] : v;
        }
    return 0;
}

/* ---- greedy sampling: the first index of each row's maximum (a NaN counts as the maximum, like
   torch.argmax); single-threaded (a few hundred microseconds for a decode batch) --------------- */
void argmax_rows(const float* x, int64_t M, int64_t N, int64_t* out) {
    for (int64_t r = 0; r < M; ++r) {
        const float* row = x + r * N;
        int64_t i = 0, nan_at = -1;
        float m = -INFINITY;
        if (N >= 16) {
            v16 vm = ld(row);
            i16 nan = (i16)(vm != vm);
            for (i = 16; i + 16 <= N; i += 16) {
                const v16 v = ld(row + i);
                vm = vsel(v > vm, v, vm);
                nan |= (i16)(v != v);
            }
            int any_nan = 0;
            for (int j = 0; j < 16; ++j) { any_nan |= nan[j] != 0; m = vm[j] > m ? vm[j] : m; }
            if (any_nan) nan_at = 0;
        }
        for (; i < N; ++i) {
            if (row[i] != row[i]) { if (nan_at < 0) nan_at = 0; }
            else if (row[i] > m) m = row[i];
        }
        int64_t best = 0;
        if (nan_at >= 0) {
            while (row[best] == row[best]) ++best;  /* the first NaN */
        } else {
            while (best < N - 1 && row[best] != m) ++best;  /* the first maximum */
        }
        out[r] = best;
    }
}
""" % {"max_heads": MAX_HEADS, "max_head_dim": MAX_HEAD_DIM, "max_block_size": MAX_BLOCK_SIZE}

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[Path] = None  # the compiled library's file (its name keys the CPU, compiler, source)
_tried = False
_P, _I = ctypes.c_void_p, ctypes.c_int64


def kernels_enabled() -> bool:
    return os.environ.get("SERVETWIN_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


class DecodeKernel:
    """ctypes wrapper of `paged_decode_attention`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_decode_attention
        fn.argtypes = [_P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        H, D = q.shape[1], q.shape[2]
        return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
                and H <= MAX_HEADS and D <= MAX_HEAD_DIM and k_cache.shape[1] <= MAX_BLOCK_SIZE)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, q_tok: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """Writes `out[q_tok[r]]` for every request r. q/out `[T, H, D]`, caches `[N, BS, Hkv, D]`
        (all contiguous float32); block_table `[R, W]`, seq_lens `[R]`, q_tok `[R]` contiguous int64."""
        T, H, D = q.shape
        assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        assert block_table.dtype == seq_lens.dtype == q_tok.dtype == torch.int64 and block_table.is_contiguous()
        R = seq_lens.shape[0]
        rc = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                      block_table.shape[1], seq_lens.data_ptr(), q_tok.data_ptr(), out.data_ptr(), R, H,
                      k_cache.shape[2], D, k_cache.shape[1], float(scale), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("paged_decode_attention: out of memory for the scores")
        if rc != 0:
            raise RuntimeError(f"paged_decode_attention: unsupported sizes (H={H}, D={D}, "
                               f"block_size={k_cache.shape[1]})")


class SmallMLinear:
    """ctypes wrapper of `small_m_linear`: `F.linear` for a few float32 rows on the CPU."""

    TUNE_ROWS = (2, 4, 8, 16, 32, 48)  # row counts timed against F.linear (the last: the largest it may take)

    def __init__(self, lib: ctypes.CDLL, decision_stem: Optional[Path] = None) -> None:
        fn = lib.small_m_linear
        fn.argtypes = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._max_rows: dict[int, int] = {}  # torch thread count -> rows up to which this kernel wins
        self._decision_stem = decision_stem  # where the machine's decisions are kept (None: not kept)

    def max_rows(self) -> int:
        """Rows up to which this kernel is faster than `F.linear` on this CPU at the current thread count
        (0: at none). The answer depends on the CPU and its BLAS: on the Intel Xeon it was written on,
        MKL's small-M sgemm is slow and the kernel won x1.4-1.9 at 4-16 rows; on the AVX2 AMD EPYC VM it
        loses to MKL at every row count (1.2x slower at 2 rows, 4.8x at 16, 8x at 48: one thread,
        SmolLM2's projections). `SERVETWIN_SMALL_M_ROWS=N` sets it.

        Timed once per machine and thread count, then kept beside the compiled library and read by every
        later process. Timed in each process, the near-tie decided differently from one process to the
        next (4 or 8 rows on a quiet AVX-512 EPYC VM, anything under load), so a calibration and the run
        it predicts executed different kernels: `make run`'s measured makespan moved 1.7x between
        processes on one machine."""
        n = torch.get_num_threads()
        if n not in self._max_rows:
            self._max_rows[n] = self._decided(n)
        return self._max_rows[n]

    def _decided(self, threads: int) -> int:
        env = os.environ.get("SERVETWIN_SMALL_M_ROWS")
        if env is not None:
            try:
                return max(0, int(env))
            except ValueError:
                raise ValueError(f"SERVETWIN_SMALL_M_ROWS: must be an integer, got {env!r}") from None
        if self._decision_stem is None:
            return self._tune()
        path = self._decision_stem.with_name(f"{self._decision_stem.name}-small_m_rows-t{threads}-"
                                             f"torch{torch.__version__}.txt")
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            pass
        rows = self._tune()
        try:  # atomic: a concurrent process reads a whole file or none
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                f.write(f"{rows}\n")
            os.replace(f.name, path)
        except OSError as e:
            logger.warning("CPU kernels: cannot keep the small-M linear decision in %s (%s)", path, e)
        return rows

    @torch.inference_mode()
    def _tune(self) -> int:
        import time  # noqa: PLC0415

        import torch.nn.functional as F  # noqa: PLC0415

        def best_of_interleaved(a: Any, b: Any, reps: int = 15) -> tuple[float, float]:
            """Fastest of `reps` calls of each, alternating, so a burst of machine noise hits both."""
            a(), b()
            ta, tb = [], []
            for _ in range(reps):
                for fn, times in ((a, ta), (b, tb)):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
            return min(ta), min(tb)

        gen = torch.Generator().manual_seed(0)
        w = torch.randn(1536, 576, generator=gen)  # an FFN projection of a small model: decode-sized
        wins = []
        for m in self.TUNE_ROWS:
            x = torch.randn(m, 576, generator=gen)
            mine, blas = best_of_interleaved(lambda: self(x, w), lambda: F.linear(x, w))
            if mine < 0.9 * blas:
                wins.append(m)
        return max(wins, default=0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x `[M, K]`, weight `[N, K]`, bias `[N]` or None (contiguous float32) -> `[M, N]`."""
        M, K = x.shape
        N = weight.shape[0]
        assert weight.shape[1] == K and x.is_contiguous() and weight.is_contiguous()
        assert bias is None or (bias.is_contiguous() and bias.shape == (N,))
        out = torch.empty(M, N, dtype=torch.float32)
        self._fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                 M, N, K, torch.get_num_threads())
        return out


class ArgmaxRows:
    """ctypes wrapper of `argmax_rows`: `x.argmax(-1)` for a contiguous float32 `[M, N]` CPU tensor."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.argmax_rows
        fn.argtypes = [_P, _I, _I, _P]
        fn.restype = None
        self._fn = fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] > 0
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._fn(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out


def _cache_dir() -> Path:
    d = os.environ.get("SERVETWIN_KERNEL_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "servetwin" / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def _build(cc: list[str], name: str, source: str) -> Path:
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source, " ".join(_FLAGS), version, _cpu_signature(),
                                     platform.machine()]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(source)
        so = Path(tmp) / "kernels.so"
        res = subprocess.run([*cc, *_FLAGS, "-o", str(so), str(src), "-lm"], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cc)} failed: {res.stderr.strip()[:2000]}")
        os.replace(so, out)  # atomic: concurrent builders each install a complete file
    return out


def compiled_library(name: str, source: str) -> Optional[Path]:
    """`source` compiled (cached under `name` and a hash of everything that shapes the binary): its
    file, or None (disabled, no compiler, build failure; logged)."""
    if not kernels_enabled():
        logger.info("CPU kernels disabled (SERVETWIN_CPU_KERNELS); using the torch ops")
        return None
    cc_env = os.environ.get("CC")
    cc = shlex.split(cc_env) if cc_env else [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not cc:
        logger.warning("CPU kernels: no C compiler found; using the torch ops")
        return None
    try:
        return _build(cc, name, source)
    except Exception as e:  # noqa: BLE001 - any failure means: fall back to torch
        logger.warning("CPU kernels %s unavailable (%s: %s); using the torch ops", name, type(e).__name__, e)
        return None


def _load(path: Optional[Path], name: str) -> Optional[ctypes.CDLL]:
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("CPU kernels %s unavailable (%s: %s); using the torch ops", name, type(e).__name__, e)
        return None


def build_library(name: str, source: str) -> Optional[ctypes.CDLL]:
    """`compiled_library` loaded, or None (disabled, no compiler, build or load failure; logged).
    Callers cache the result."""
    return _load(compiled_library(name, source), name)


def _library() -> Optional[ctypes.CDLL]:
    """The compiled library, or None (disabled, no compiler, build or load failure; logged once)."""
    global _lib, _lib_path, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _lib_path = compiled_library("servetwin_cpu_kernels", _SOURCE)
            _lib = _load(_lib_path, "servetwin_cpu_kernels")
            _tried = True
        return _lib


_decode: Optional[DecodeKernel] = None
_linear: Optional[SmallMLinear] = None
_argmax: Optional[ArgmaxRows] = None


def decode_kernel() -> Optional[DecodeKernel]:
    """The paged decode-attention kernel, or None (then use the torch path)."""
    global _decode
    if _decode is None and (lib := _library()) is not None:
        _decode = DecodeKernel(lib)
    return _decode


def small_m_linear_kernel() -> Optional[SmallMLinear]:
    """The small-M linear kernel, or None (then use `F.linear`)."""
    global _linear
    if _linear is None and (lib := _library()) is not None:
        _linear = SmallMLinear(lib, _lib_path.with_suffix("") if _lib_path is not None else None)
    return _linear


def argmax_rows_kernel() -> Optional[ArgmaxRows]:
    """The row-argmax kernel, or None (then use `Tensor.argmax`)."""
    global _argmax
    if _argmax is None and (lib := _library()) is not None:
        _argmax = ArgmaxRows(lib)
    return _argmax


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` (first maximum, NaN wins) - the kernel for 2-D float32 CPU logits."""
    if (logits.dim() == 2 and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.shape[1] > 0 and (kernel := argmax_rows_kernel()) is not None):
        return kernel(logits.contiguous())
    return logits.argmax(dim=-1)
