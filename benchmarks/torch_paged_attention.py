"""Time the torch-paged attention modes against each other, interleaved: "batched" (padded groups),
"split" (one SDPA per prefill chunk; the decodes in one call of the native CPU kernel of
`gpu/cpu_kernels.py` on a float32 CPU, else in padded buckets) and "loop" (one SDPA per request).

    python benchmarks/torch_paged_attention.py [--device cuda] [--dtype bfloat16] [--threads N]

Head layout of SmolLM2-135M (9 heads, 3 KV heads, head dim 64), block size 16, random block tables.
Each time includes the per-step planning (`build_metadata`). Set SERVETWIN_CPU_KERNELS=0 to time
"split" without the kernel.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from servetwin.gpu.attention import CommonAttentionMetadata, TorchPagedAttention
from servetwin.gpu.input_batch import build_block_table

H, HKV, D, B = 9, 3, 64, 16
MODES = ("batched", "split", "loop")


def make_case(q_lens, seq_lens, device, dtype, seed=0):
    rng = np.random.default_rng(seed)
    nb = [-(-s // B) for s in seq_lens]
    num_blocks = sum(nb) + 1
    perm = rng.permutation(num_blocks - 1)
    ids, k = [], 0
    for n in nb:
        ids.append(perm[k:k + n].tolist())
        k += n
    sl = np.array(seq_lens, dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    bt = build_block_table(ids, np.array(nb), num_blocks - 1)
    pos = np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = bt[req, pos // B].astype(np.int64) * B + pos % B
    common = CommonAttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_size=B, query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(sl).to(device), block_table=torch.from_numpy(bt).to(device),
        slot_mapping=torch.from_numpy(slots).to(device), query_start_loc_cpu=qsl, seq_lens_cpu=sl)
    T = int(qsl[-1])
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    caches = (mk(num_blocks, B, HKV, D), mk(num_blocks, B, HKV, D))
    return common, (mk(T, H, D), mk(T, HKV, D), mk(T, HKV, D)), caches


def bench(modes, case, device, reps):
    """Median and minimum time per call of each mode, the modes interleaved in a rotating order (robust to
    a noisy shared machine and to one mode's allocations slowing the next)."""
    common, (q, k, v), (kc, vc) = case
    backends = {m: TorchPagedAttention(m, H // HKV) for m in modes}

    def once(be):
        meta = be.build_metadata(common)  # planning is part of the per-step cost (once per step, not per layer)
        out = be.forward(q, k, v, kc, vc, meta, D ** -0.5)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out
    times = {m: [] for m in modes}
    outs = {m: once(be) for m, be in backends.items()}
    order = list(backends)
    for rep in range(reps):
        for m in order[rep % len(order):] + order[:rep % len(order)]:  # rotated: no mode always runs after another
            t = time.perf_counter()
            once(backends[m])
            times[m].append(time.perf_counter() - t)
    return {m: (float(np.median(t)), float(np.min(t))) for m, t in times.items()}, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rng = np.random.default_rng(1)
    cases = {
        "decode x16 (kv 300-800)": ([1] * 16, rng.integers(300, 800, 16).tolist()),
        "decode x32 (kv 100-1000)": ([1] * 32, rng.integers(100, 1000, 32).tolist()),
        "decode x128 (kv 100-1000)": ([1] * 128, rng.integers(100, 1000, 128).tolist()),
        "mixed: 2 chunks of 256 + 30 decodes": ([256, 256] + [1] * 30,
                                               [256, 768] + rng.integers(100, 1000, 30).tolist()),
        "prefill x8 (64-512)": (q := rng.integers(64, 512, 8).tolist(), q),
        "prefill x16 (32-512) + 0 decodes": (q := rng.integers(32, 512, 16).tolist(), q),
        "2 chunks after a prefix + 14 decodes": ([200, 64] + [1] * 14,
                                                 [456, 320] + rng.integers(300, 800, 14).tolist()),
    }
    for name, (ql, sl) in cases.items():
        case = make_case(ql, sl, device, dtype)
        times, outs = bench(MODES, case, device, args.reps)
        err = max((outs[m].float() - outs["loop"].float()).abs().max().item() for m in MODES)
        cols = "   ".join(f"{m} {times[m][0] * 1e3:7.2f} ({times[m][1] * 1e3:7.2f}) ms" for m in MODES)
        print(f"{name:38s} {cols}   loop/split x{times['loop'][0] / times['split'][0]:5.2f}   "
              f"max|diff| vs loop {err:.1e}")


if __name__ == "__main__":
    main()
