"""The fused layer kernels (gpu/cpu_layer_kernels.py) against the torch ops they replace, at random shapes
(Hypothesis), and the modules' fallback to those ops when the kernels are unavailable."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import servetwin.gpu.cpu_kernels as ck
import servetwin.gpu.cpu_layer_kernels as lkm
from servetwin.gpu.models.config import MoEConfig, RopeConfig
from servetwin.gpu.models.layers import RMSNorm
from servetwin.gpu.models.moe import FusedMoE
from servetwin.gpu.models.rope import RotaryEmbedding
from test_fused_moe import reference as moe_reference

needs_kernels = pytest.mark.skipif(lkm.layer_kernels() is None, reason="the CPU layer kernels did not build here")
FEW = settings(max_examples=12, deadline=None)


def _no_kernels(monkeypatch) -> None:
    monkeypatch.setattr(lkm, "_kernels", None)
    monkeypatch.setattr(lkm, "_tried", True)


@needs_kernels
@FEW
@given(rows=st.integers(1, 40), n=st.sampled_from([1, 7, 16, 33, 128]), seed=st.integers(0, 2**16))
def test_rms_norm_and_fused_add_match_torch(rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    x, res, w = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    lk = lkm.layer_kernels()
    with torch.inference_mode():
        torch.testing.assert_close(lk.rms_norm(x, w, 1e-6), F.rms_norm(x, (n,), w, 1e-6), atol=1e-5, rtol=1e-5)
        s = x + res
        xi = x.clone()
        out = lk.rms_norm(xi, w, 1e-6, residual=res)
        assert torch.equal(xi, s)  # the residual added in place, exactly
        torch.testing.assert_close(out, F.rms_norm(s, (n,), w, 1e-6), atol=1e-5, rtol=1e-5)


@needs_kernels
@FEW
@given(heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (8, 1)]), D=st.sampled_from([2, 8, 32, 34, 64]),
       partial=st.sampled_from([1.0, 0.5]), qk_norm=st.booleans(), T=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_qk_norm_rope_matches_the_torch_ops(heads, D, partial, qk_norm, T, seed):
    """In place on a packed qkv (v untouched): q/k RMSNorm (Qwen3) then the neox rotation of the first
    rotary_dim lanes, as `q_norm`/`k_norm` + `RotaryEmbedding.forward` compute them."""
    H, HKV = heads
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(RopeConfig("default", 10000.0, partial, {}), D, 256)
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=g)
    pos = torch.randint(0, 256, (T,), generator=g)
    qw, kw = torch.randn(D, generator=g), torch.randn(D, generator=g)
    q, k = qkv[:, :H * D].reshape(T, H, D), qkv[:, H * D:(H + HKV) * D].reshape(T, HKV, D)
    if qk_norm:
        q, k = F.rms_norm(q, (D,), qw, 1e-6), F.rms_norm(k, (D,), kw, 1e-6)
    if rope.rotary_dim % 2:
        return
    ref_q, ref_k = rope(pos, q, k)
    got = qkv.clone()
    with torch.inference_mode():
        lkm.layer_kernels().qk_norm_rope(got, H, HKV, D, qw if qk_norm else None, kw if qk_norm else None, 1e-6,
                                         rope.cos_cache, rope.sin_cache, pos)
    torch.testing.assert_close(got[:, :H * D].view(T, H, D), ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[:, H * D:(H + HKV) * D].view(T, HKV, D), ref_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, (H + HKV) * D:], qkv[:, (H + HKV) * D:])
    with pytest.raises(IndexError):  # a position past the cache: refused, nothing read out of bounds
        lkm.layer_kernels().qk_norm_rope(got, H, HKV, D, None, None, 1e-6, rope.cos_cache, rope.sin_cache,
                                         torch.full((T,), 256))


@needs_kernels
@FEW
@given(E=st.integers(1, 12), top_k=st.integers(1, 4), I=st.sampled_from([5, 16, 24, 64, 80]),
       Hd=st.sampled_from([8, 17, 32, 128]), T=st.integers(0, 70), gpt_oss=st.booleans(), renorm=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fused_moe_kernel_matches_per_token_reference(E, top_k, I, Hd, T, gpt_oss, renorm, seed):
    """Every tile size (1-4 rows per expert tile, 64- and 16-column chunks, a scalar column tail), router
    and expert biases with gpt-oss's clamped SwiGLU, renormalised or not, empty batches: as close to the
    float64 reference as the torch ops (another summation order, not another result)."""
    top_k = min(top_k, E)
    cfg = MoEConfig(num_experts=E, top_k=top_k, intermediate_size=I, renormalize=renorm, router_bias=gpt_oss,
                    expert_bias=gpt_oss, swiglu_limit=1.5 if gpt_oss else None)
    torch.manual_seed(seed)
    m = FusedMoE(Hd, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(T, Hd)
    with torch.inference_mode():
        got = m(x)
    assert got.shape == (T, Hd)
    if T == 0:
        return
    torch_ops = m(x).detach()  # autograd on: the torch ops
    ref = moe_reference(m, x).double()
    err, torch_err = (got.double() - ref).abs().max().item(), (torch_ops.double() - ref).abs().max().item()
    assert err <= max(3 * torch_err, 2e-6 * ref.abs().max().item() * (Hd + I) ** 0.5), (err, torch_err)


@needs_kernels
def test_modules_fall_back_to_the_torch_ops(monkeypatch):
    """Without the kernels (no compiler, SERVETWIN_CPU_KERNELS=0) RMSNorm, its fused add and FusedMoE run
    the torch ops - the same numbers up to rounding; with autograd on they never use the kernels."""
    torch.manual_seed(0)
    norm, x, r = RMSNorm(64, 1e-6), torch.randn(5, 64), torch.randn(5, 64)
    m = FusedMoE(32, MoEConfig(num_experts=6, top_k=2, intermediate_size=16, renormalize=True))
    with torch.no_grad():
        for p in [*norm.parameters(), *m.parameters()]:
            p.normal_(0, 0.5)
    xm = torch.randn(9, 32)
    with torch.inference_mode():
        native = norm(x), norm.add_forward(x.clone(), r), m(xm)
        _no_kernels(monkeypatch)
        torch_ops = norm(x), norm.add_forward(x.clone(), r), m(xm)
    torch.testing.assert_close(native[0], torch_ops[0])
    for a, b in zip(native[1], torch_ops[1]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(native[2], torch_ops[2], atol=2e-5, rtol=1e-5)
    monkeypatch.undo()
    m(xm).sum().backward()  # autograd on: the torch ops, whose gradients exist
    assert m.w13.grad is not None and m.gate.weight.grad is not None


def test_only_cpu_float32_inference_tensors_build_or_use_the_kernels(monkeypatch):
    """A bfloat16 (or CUDA) model, or autograd on: None before any build is tried (no compile during a
    CUDA-graph capture, no C compiler needed on a GPU machine)."""
    def no_build(*a):
        raise AssertionError("build_library called")
    monkeypatch.setattr(lkm, "build_library", no_build)
    monkeypatch.setattr(lkm, "_tried", False)
    monkeypatch.setattr(lkm, "_kernels", None)
    with torch.inference_mode():
        assert lkm.layer_kernels_for(torch.ones(2, dtype=torch.bfloat16), torch.ones(2)) is None
    assert lkm.layer_kernels_for(torch.ones(2)) is None  # autograd on


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("SERVETWIN_CPU_KERNELS", "0")
    monkeypatch.setattr(lkm, "_tried", False)
    monkeypatch.setattr(lkm, "_kernels", None)
    assert lkm.layer_kernels() is None
    assert ck.build_library("anything", "int f(void) { return 0; }") is None


@needs_kernels
def test_large_batches_take_the_parallel_branches():
    """Prefill-sized batches on 2 threads: the kernels' OpenMP branches (routing, the weighted sums, row
    norms, q/k rows) give what the torch ops give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(1)
        m = FusedMoE(128, MoEConfig(num_experts=16, top_k=4, intermediate_size=64, renormalize=False))
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.2)
        x = torch.randn(600, 128)
        w = torch.randn(128)
        rope = RotaryEmbedding(RopeConfig("default", 10000.0, 1.0, {}), 32, 1024)
        qkv, pos = torch.randn(600, 8 * 32), torch.arange(600)
        ref_q, ref_k = rope(pos, qkv[:, :128].reshape(600, 4, 32), qkv[:, 128:192].reshape(600, 2, 32))
        with torch.inference_mode():
            got = m(x), lkm.layer_kernels().rms_norm(x, w, 1e-6)
            lkm.layer_kernels().qk_norm_rope(qkv, 4, 2, 32, None, None, 0.0, rope.cos_cache, rope.sin_cache, pos)
        torch.testing.assert_close(got[0], m(x).detach(), atol=5e-5, rtol=1e-4)
        torch.testing.assert_close(got[1], F.rms_norm(x, (128,), w, 1e-6), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(qkv[:, :128].view(600, 4, 32), ref_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(qkv[:, 128:192].view(600, 2, 32), ref_k, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)
