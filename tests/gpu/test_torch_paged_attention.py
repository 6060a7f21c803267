"""torch-paged attention against a dense per-request reference (shuffled blocks, GQA, mixed batch),
in every mode, with and without the native CPU decode kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from servetwin.gpu.attention import CommonAttentionMetadata, TorchPagedAttention, write_kv
from servetwin.gpu.cpu_kernels import decode_kernel
from servetwin.gpu.attention.torch_paged import bucket_by_padding
from servetwin.gpu.input_batch import build_block_table

needs_kernel = pytest.mark.skipif(decode_kernel() is None, reason="the CPU decode kernel did not build here")
# (mode, cpu_kernel): the pure-torch groups in each mode, and "split" with the native decode kernel
MODES = [("batched", None), ("split", False), pytest.param("split", True, marks=needs_kernel), ("loop", None)]

B, HKV, H, D = 4, 2, 6, 8


def dense_reference(q, k_full, v_full, q_lens, seq_lens, scale, h=H, hkv=HKV):
    """Per request: its keys 0..seq_len-1, the i-th of q_len queries sees ctx + i + 1 keys (float64)."""
    outs, t = [], 0
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        qi = q[t:t + ql].double().transpose(0, 1)  # [H, ql, D]
        ki = k_full[r][:sl].double().repeat_interleave(h // hkv, 1).transpose(0, 1)
        vi = v_full[r][:sl].double().repeat_interleave(h // hkv, 1).transpose(0, 1)
        s = qi @ ki.transpose(-1, -2) * scale
        ctx = sl - ql
        mask = torch.arange(sl)[None, :] <= (ctx + torch.arange(ql))[:, None]
        s = s.masked_fill(~mask, float("-inf"))
        outs.append((s.softmax(-1) @ vi).transpose(0, 1))
        t += ql
    return torch.cat(outs).float()


def make_paged_case(q_lens, seq_lens, seed=0, shared_prefix_blocks=0, block_size=B, hkv=HKV, h=H, d=D):
    """Random K/V per request in shuffled physical blocks, the cached prefix (tokens before this
    step's queries) already written. With `shared_prefix_blocks=n`, every request after the first
    reuses the first request's first n physical blocks and their contents (a prefix-cache hit)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-sl // block_size) for sl in seq_lens]
    num_blocks = sum(nbs) + 1
    perm = torch.randperm(num_blocks - 1, generator=g).tolist()  # physical blocks, shuffled
    k_cache = torch.zeros(num_blocks, block_size, hkv, d)
    v_cache = torch.zeros(num_blocks, block_size, hkv, d)
    block_ids, k_full, v_full = [], [], []
    shared = shared_prefix_blocks * block_size
    for r, (sl, nb) in enumerate(zip(seq_lens, nbs)):
        kf, vf = torch.randn(sl, hkv, d, generator=g), torch.randn(sl, hkv, d, generator=g)
        ids = [perm.pop() for _ in range(nb)]
        if r and shared_prefix_blocks:
            assert sl - q_lens[r] >= shared and seq_lens[0] - q_lens[0] >= shared
            ids[:shared_prefix_blocks] = block_ids[0][:shared_prefix_blocks]
            kf[:shared], vf[:shared] = k_full[0][:shared], v_full[0][:shared]
        block_ids.append(ids)
        k_full.append(kf)
        v_full.append(vf)
    for ids, kf, vf, ql, sl in zip(block_ids, k_full, v_full, q_lens, seq_lens):
        for pos in range(sl - ql):
            k_cache[ids[pos // block_size], pos % block_size] = kf[pos]
            v_cache[ids[pos // block_size], pos % block_size] = vf[pos]
    q = torch.randn(sum(q_lens), h, d, generator=g)
    k_new = torch.cat([kf[sl - ql:] for kf, ql, sl in zip(k_full, q_lens, seq_lens)])
    v_new = torch.cat([vf[sl - ql:] for vf, ql, sl in zip(v_full, q_lens, seq_lens)])
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    sl_np = np.array(seq_lens, dtype=np.int32)
    bt = build_block_table(block_ids, -(-sl_np // block_size), pad_block_id=num_blocks - 1)
    positions = np.concatenate([np.arange(sl - ql, sl) for ql, sl in zip(q_lens, seq_lens)])
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = bt[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    common = CommonAttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_size=block_size, query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(sl_np), block_table=torch.from_numpy(bt),
        slot_mapping=torch.from_numpy(slots), query_start_loc_cpu=qsl, seq_lens_cpu=sl_np)
    return common, q, k_new, v_new, k_cache, v_cache, k_full, v_full, slots


def run_backend(mode, cpu_kernel, case, h=H, hkv=HKV, d=D):
    common, q, k_new, v_new, k_cache, v_cache = case[:6]
    backend = TorchPagedAttention(mode, h // hkv, cpu_kernel=cpu_kernel, mask_dtype=q.dtype)  # additive masks
    meta = backend.build_metadata(common)
    if cpu_kernel:
        assert meta.decode_batch is not None, "the decode rows should go to the kernel"
    return backend.forward(q, k_new, v_new, k_cache.clone(), v_cache.clone(), meta, d ** -0.5)


@pytest.mark.parametrize("mode,cpu_kernel", MODES)
def test_matches_dense_reference_with_shuffled_blocks(mode, cpu_kernel):
    # prefill from 0, chunk after a cached prefix, two decodes, a one-token prefill, a chunk ending mid-block
    q_lens = [7, 5, 1, 1, 1, 6]
    seq_lens = [7, 13, 9, 1, 17, 10]
    case = make_paged_case(q_lens, seq_lens)
    common, q, k_new, v_new, k_cache, v_cache, k_full, v_full, slots = case
    backend = TorchPagedAttention(mode, H // HKV, cpu_kernel=cpu_kernel)
    meta = backend.build_metadata(common)
    scale = D ** -0.5
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, scale)
    ref = dense_reference(q, k_full, v_full, q_lens, seq_lens, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the new keys landed in their slots
    flat = k_cache.view(-1, HKV, D)
    torch.testing.assert_close(flat[torch.from_numpy(slots)], k_new)


@pytest.mark.parametrize("mode,cpu_kernel", MODES)
@pytest.mark.parametrize("hkv,h,d", [(3, 9, 64), (2, 6, 8), (1, 4, 20)])
def test_mixed_batch_with_prefix_hits_and_chunks(mode, cpu_kernel, hkv, h, d):
    """Block size 16 and SmolLM2's head layout (and odd ones): a prompt from 0, chunks after a cached
    prefix (one of them shares the first request's prefix blocks), decodes of many lengths (block
    boundaries, one key, several buckets) - every mode equals the float64 reference and loop mode."""
    q_lens = [40, 24, 17] + [1] * 13
    seq_lens = [40, 88, 81] + [1, 16, 17, 32, 33, 47, 64, 100, 129, 255, 256, 300, 777]
    case = make_paged_case(q_lens, seq_lens, seed=3, block_size=16, hkv=hkv, h=h, d=d)
    out = run_backend(mode, cpu_kernel, case, h, hkv, d)
    ref = dense_reference(case[1], case[6], case[7], q_lens, seq_lens, d ** -0.5, h, hkv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, run_backend("loop", None, case, h, hkv, d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,cpu_kernel", MODES)
def test_shared_prefix_blocks(mode, cpu_kernel):
    """Requests 1.. read request 0's first two physical blocks (a prefix-cache hit): decodes and a
    chunk over shared blocks."""
    q_lens = [1, 1, 9, 1]
    seq_lens = [40, 45, 50, 33]
    case = make_paged_case(q_lens, seq_lens, seed=5, shared_prefix_blocks=2, block_size=16)
    out = run_backend(mode, cpu_kernel, case)
    ref = dense_reference(case[1], case[6], case[7], q_lens, seq_lens, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_decode_kernel_equals_torch_decode_path_closely():
    """All-decode batch (the benchmark's steady state): kernel vs the torch buckets, tight tolerance."""
    rng = np.random.default_rng(0)
    seq_lens = rng.integers(1, 600, 24).tolist()
    case = make_paged_case([1] * 24, seq_lens, seed=7, block_size=16, hkv=3, h=9, d=64)
    a = run_backend("split", True, case, 9, 3, 64)
    b = run_backend("split", False, case, 9, 3, 64)
    assert (a - b).abs().max().item() < 2e-6


def test_bucket_by_padding_caps_gathered_keys():
    q = np.ones(6, dtype=np.int64)
    s = np.array([100, 100, 100, 100, 100, 100])
    order = np.arange(6)
    assert [len(g) for g in bucket_by_padding(order, q, s)] == [6]
    assert [len(g) for g in bucket_by_padding(order, q, s, max_keys=250)] == [2, 2, 2]
    assert [len(g) for g in bucket_by_padding(order, q, s, max_keys=50)] == [1] * 6  # at least one each


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
    rest = k_cache.view(-1, HKV, D).clone()
    rest[[9, 2]] = 0
    assert not rest.any()  # nothing else written (a float sum equality would depend on reduction order)
