"""torch-paged attention against a dense per-request reference (shuffled blocks, GQA, mixed batch)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.attention import CommonAttentionMetadata, TorchPagedAttention, write_kv
from gpu.input_batch import build_block_table

B, HKV, H, D = 4, 2, 6, 8


def dense_reference(q, k_full, v_full, q_lens, seq_lens, scale):
    """Per request: its keys 0..seq_len-1, the i-th of q_len queries sees ctx + i + 1 keys (float64)."""
    outs, t = [], 0
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        qi = q[t:t + ql].double().transpose(0, 1)  # [H, ql, D]
        ki = k_full[r][:sl].double().repeat_interleave(H // HKV, 1).transpose(0, 1)
        vi = v_full[r][:sl].double().repeat_interleave(H // HKV, 1).transpose(0, 1)
        s = qi @ ki.transpose(-1, -2) * scale
        ctx = sl - ql
        mask = torch.arange(sl)[None, :] <= (ctx + torch.arange(ql))[:, None]
        s = s.masked_fill(~mask, float("-inf"))
        outs.append((s.softmax(-1) @ vi).transpose(0, 1))
        t += ql
    return torch.cat(outs).float()


@pytest.mark.parametrize("mode", ["batched", "loop"])
def test_matches_dense_reference_with_shuffled_blocks(mode):
    g = torch.Generator().manual_seed(0)
    # prefill from 0, chunk after a cached prefix, two decodes, a one-token prefill, a chunk ending mid-block
    q_lens = [7, 5, 1, 1, 1, 6]
    seq_lens = [7, 13, 9, 1, 17, 10]
    num_blocks = 40
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()  # physical blocks, shuffled
    k_cache = torch.zeros(num_blocks, B, HKV, D)
    v_cache = torch.zeros(num_blocks, B, HKV, D)
    block_ids, k_full, v_full = [], [], []
    for sl in seq_lens:
        nb = -(-sl // B)
        block_ids.append([perm.pop() for _ in range(nb)])
        k_full.append(torch.randn(sl, HKV, D, generator=g))
        v_full.append(torch.randn(sl, HKV, D, generator=g))
    # the cached prefix (tokens before this step's chunk) is already in the cache
    for ids, kf, vf, ql, sl in zip(block_ids, k_full, v_full, q_lens, seq_lens):
        for pos in range(sl - ql):
            k_cache[ids[pos // B], pos % B] = kf[pos]
            v_cache[ids[pos // B], pos % B] = vf[pos]
    q = torch.randn(sum(q_lens), H, D, generator=g)
    k_new = torch.cat([kf[sl - ql:] for kf, ql, sl in zip(k_full, q_lens, seq_lens)])
    v_new = torch.cat([vf[sl - ql:] for vf, ql, sl in zip(v_full, q_lens, seq_lens)])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    sl_np = np.array(seq_lens, dtype=np.int32)
    bt = build_block_table(block_ids, -(-sl_np // B), pad_block_id=num_blocks - 1)
    positions = np.concatenate([np.arange(sl - ql, sl) for ql, sl in zip(q_lens, seq_lens)])
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = bt[req, positions // B].astype(np.int64) * B + positions % B
    common = CommonAttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_size=B, query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(sl_np), block_table=torch.from_numpy(bt),
        slot_mapping=torch.from_numpy(slots), query_start_loc_cpu=qsl, seq_lens_cpu=sl_np)
    backend = TorchPagedAttention(mode, H // HKV)
    meta = backend.build_metadata(common)
    scale = D ** -0.5
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, scale)
    ref = dense_reference(q, k_full, v_full, q_lens, seq_lens, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the new keys landed in their slots
    flat = k_cache.view(-1, HKV, D)
    torch.testing.assert_close(flat[torch.from_numpy(slots)], k_new)


def test_top_left_causal_would_be_wrong():
    """Guard the trap: SDPA's is_causal is top-left aligned and differs for a chunk after a prefix."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 7, 4, generator=g), torch.randn(1, 2, 7, 4, generator=g)
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.arange(7)[None, :] <= (4 + torch.arange(3))[:, None]
    bottom_right = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (top_left - bottom_right).abs().max() > 1e-3


def test_write_kv_uses_slot_mapping():
    k_cache = torch.zeros(3, B, HKV, D)
    v_cache = torch.zeros(3, B, HKV, D)
    k = torch.randn(2, HKV, D)
    write_kv(k, -k, k_cache, v_cache, torch.tensor([9, 2]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(k_cache[0, 2], k[1])
    assert torch.equal(v_cache[2, 1], -k[0])
    assert k_cache.abs().sum() == k.abs().sum()
