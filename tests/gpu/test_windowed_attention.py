"""torch-paged attention with a per-layer `AttentionWindow` (sliding window, chunked local attention)
and attention sinks, against a dense float64 reference; the blocks wholly before a request's window are
NaN-poisoned (as if freed and reused), so any read of one would show."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from servetwin.gpu.attention import TorchPagedAttention
from servetwin.gpu.models.config import AttentionWindow
from test_torch_paged_attention import HKV, H, D, make_paged_case

MODES = [("batched", None), ("split", None), ("loop", None)]
# prompt from 0 longer than the window, chunks after a prefix crossing window / chunk edges, decodes
Q_LENS = [23, 9, 5, 1, 1, 1, 1]
SEQ_LENS = [23, 31, 50, 1, 11, 40, 77]


def windowed_reference(q, k_full, v_full, q_lens, seq_lens, scale, window, sinks=None):
    outs, t = [], 0
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        qi = q[t:t + ql].double().transpose(0, 1)
        ki = k_full[r][:sl].double().repeat_interleave(H // HKV, 1).transpose(0, 1)
        vi = v_full[r][:sl].double().repeat_interleave(H // HKV, 1).transpose(0, 1)
        s = qi @ ki.transpose(-1, -2) * scale
        qpos = (sl - ql + torch.arange(ql))[:, None]
        kpos = torch.arange(sl)[None, :]
        mask = (kpos <= qpos) & (kpos >= torch.from_numpy(window.first_key(qpos.numpy())))
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(H, ql, 1)], dim=-1)
        p = s.softmax(-1)[..., :sl]
        outs.append((p @ vi).transpose(0, 1))
        t += ql
    return torch.cat(outs).float()


def poison_behind_window(case, q_lens, seq_lens, window, block_size):
    common, _, _, _, k_cache, v_cache = case[:6]
    bt = common.block_table.numpy()
    n = 0
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for b in range(int(window.first_key(np.array(sl - ql))) // block_size):
            k_cache[bt[r, b]] = float("nan")
            v_cache[bt[r, b]] = float("nan")
            n += 1
    return n


@pytest.mark.parametrize("mode,cpu_kernel", MODES)
@pytest.mark.parametrize("window", [AttentionWindow(sliding_window=7), AttentionWindow(sliding_window=16),
                                    AttentionWindow(chunk_size=8), AttentionWindow(chunk_size=12)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_matches_dense_reference_and_skips_old_blocks(mode, cpu_kernel, window, with_sinks):
    block_size = 4
    case = make_paged_case(Q_LENS, SEQ_LENS, seed=11, block_size=block_size)
    common, q, k_new, v_new, k_cache, v_cache, k_full, v_full, _ = case
    assert poison_behind_window(case, Q_LENS, SEQ_LENS, window, block_size) > 0
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(2)) if with_sinks else None
    backend = TorchPagedAttention(mode, H // HKV, cpu_kernel=cpu_kernel, mask_dtype=q.dtype)
    meta = backend.build_metadata(common, window=window)
    assert meta.decode_batch is None  # the native kernel attends every key: full attention only
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, D ** -0.5, sinks=sinks)
    ref = windowed_reference(q, k_full, v_full, Q_LENS, SEQ_LENS, D ** -0.5, window, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["batched", "split", "loop"])
def test_sinks_with_full_attention(mode):
    case = make_paged_case(Q_LENS, SEQ_LENS, seed=4, block_size=4)
    common, q, k_new, v_new, k_cache, v_cache, k_full, v_full, _ = case
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(3))
    backend = TorchPagedAttention(mode, H // HKV, mask_dtype=q.dtype)
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, backend.build_metadata(common), D ** -0.5, sinks=sinks)
    ref = windowed_reference(q, k_full, v_full, Q_LENS, SEQ_LENS, D ** -0.5, AttentionWindow(), sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
