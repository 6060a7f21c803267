"""The native CPU kernels (gpu/cpu_kernels.py) against the torch ops they replace, and the fallback
when they are unavailable (the decode-attention kernel is also covered by test_torch_paged_attention)."""
from __future__ import annotations

import random

import pytest
import torch

import servetwin.gpu.cpu_kernels as ck
import servetwin.gpu.cpu_layer_kernels as lkm
from servetwin.core.sched.output import CachedRequestData, NewRequestData
from servetwin.gpu.executor import TorchExecutor
from servetwin.gpu.models.layers import SMALL_M_MAX, linear
from backend_helpers import GREEDY, step

needs_kernels = pytest.mark.skipif(ck.small_m_linear_kernel() is None, reason="the CPU kernels did not build here")


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 13, 16, 17, 32, 48])
@pytest.mark.parametrize("N,K", [(960, 576), (6, 20), (7, 33), (3, 16), (1, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_linear_matches_float64(M, N, K, with_bias):
    """Every tile shape (4x4 tiles, leftover rows, the last N % 4 outputs, a K % 16 tail): as close to
    the float64 product as MKL's sgemm (another summation order, not another result)."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    out = ck.small_m_linear_kernel()(x, w, b)
    mkl = torch.nn.functional.linear(x, w, b)
    err, mkl_err = (out.double() - ref).abs().max().item(), (mkl.double() - ref).abs().max().item()
    assert out.shape == (M, N) and out.dtype == torch.float32
    assert err <= max(2 * mkl_err, 1e-6 * K ** 0.5), (err, mkl_err)


class _Spy:
    """The real kernel, recording the row counts it is called with; `max_rows` as given."""

    def __init__(self, max_rows: int) -> None:
        self.real, self.rows, self.calls = ck.small_m_linear_kernel(), max_rows, []

    def max_rows(self) -> int:
        return self.rows

    def __call__(self, x, w, b=None):
        self.calls.append(x.shape[0])
        return self.real(x, w, b)


@needs_kernels
@pytest.mark.parametrize("max_rows", [SMALL_M_MAX, 8, 0])
def test_linear_uses_the_kernel_only_for_small_float32_batches_where_it_wins(monkeypatch, max_rows):
    spy = _Spy(max_rows)
    monkeypatch.setattr(ck, "_linear", spy)
    w = torch.randn(40, 32)
    with torch.inference_mode():
        for m in (1, 2, 8, 9, SMALL_M_MAX, SMALL_M_MAX + 1):
            x = torch.randn(m, 32)
            torch.testing.assert_close(linear(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
        linear(torch.randn(4, 32, dtype=torch.float64), w.double())  # not float32
        linear(torch.randn(2, 3, 32), w)  # not 2-D
    x = torch.randn(4, 32, requires_grad=True)
    linear(x, w).sum().backward()  # autograd: F.linear
    assert spy.calls == [m for m in (2, 8, 9, SMALL_M_MAX) if m <= max_rows] and x.grad is not None


@needs_kernels
def test_the_kernel_times_itself_against_f_linear_once_per_thread_count():
    kernel = ck.small_m_linear_kernel()
    rows = kernel.max_rows()
    assert rows in (0,) + kernel.TUNE_ROWS and kernel.TUNE_ROWS[-1] == SMALL_M_MAX
    assert kernel.max_rows() == rows  # the decision is kept: a step never pays for it again


@needs_kernels
def test_the_decision_is_timed_once_per_machine_and_read_by_later_processes(tmp_path, monkeypatch):
    """A near-tie timed in every process flipped between processes (a calibration and the run it predicts
    then executed different kernels): the first decision is kept in a file every later instance reads."""
    lib = ck._library()
    tuned = []
    monkeypatch.setattr(ck.SmallMLinear, "_tune", lambda self: tuned.append(1) or 8)
    first = ck.SmallMLinear(lib, tmp_path / "lib")
    assert first.max_rows() == 8 and len(tuned) == 1
    (kept,) = tmp_path.glob("lib-small_m_rows-t*.txt")
    assert kept.read_text().strip() == "8"
    kept.write_text("16\n")  # what another process decided
    assert ck.SmallMLinear(lib, tmp_path / "lib").max_rows() == 16 and len(tuned) == 1
    monkeypatch.setenv("SERVETWIN_SMALL_M_ROWS", "0")
    assert ck.SmallMLinear(lib, tmp_path / "lib").max_rows() == 0
    monkeypatch.setenv("SERVETWIN_SMALL_M_ROWS", "many")
    with pytest.raises(ValueError, match="SERVETWIN_SMALL_M_ROWS: must be an integer"):
        ck.SmallMLinear(lib, tmp_path / "lib").max_rows()


@needs_kernels
@pytest.mark.parametrize("N", [1, 3, 15, 16, 17, 31, 33, 100, 4099])
def test_greedy_argmax_equals_torch_argmax(N):
    """First index of the maximum, ties and NaN (torch.argmax: a NaN is the maximum) included."""
    g = torch.Generator().manual_seed(N)
    for trial in range(12):
        x = torch.randn(6, N, generator=g)
        if trial % 3 == 0:
            x[:, ::max(1, N // 4)] = x.max()  # ties
        if N > 2 and trial % 4 == 1:
            x[1, N // 2] = float("nan")
            x[1, N - 1] = float("nan")
        if trial % 5 == 2:
            x[2] = float("-inf")
        if trial % 6 == 3:
            x[3, -1] = float("inf")
        assert torch.equal(ck.greedy_argmax(x), x.argmax(-1)), (N, trial)


def _run_steps(ex: TorchExecutor) -> tuple[list, dict]:
    rng = random.Random(11)
    prompts = {f"r{i}": [rng.randrange(3, 320) for _ in range(n)] for i, n in enumerate((37, 5, 20, 64))}
    blocks = {rid: [6 * i + j for j in range(6)] for i, rid in enumerate(prompts)}
    out = ex.execute_model(step(0, new=[NewRequestData(rid, p, GREEDY, (blocks[rid],), 0) for rid, p in prompts.items()],
                                num_scheduled={rid: len(p) for rid, p in prompts.items()}))
    toks = [out.sampled_token_ids]
    logits = [dict(ex.last_logits)]
    for s in range(1, 6):
        ids = list(prompts)
        computed = [ex.state.requests[r].num_computed_tokens for r in ids]
        out = ex.execute_model(step(s, cached=CachedRequestData(ids, [None] * 4, computed, [s] * 4),
                                    num_scheduled={r: 1 for r in ids}))
        toks.append(out.sampled_token_ids)
        logits.append(dict(ex.last_logits))
    return toks, logits


@needs_kernels
@pytest.mark.parametrize("model,tol", [("tiny-llama", 1e-5), ("tiny-qwen3-moe", 5e-5)])
def test_executor_without_kernels_falls_back_to_torch(monkeypatch, model, tol):
    """No compiler / SERVETWIN_CPU_KERNELS=0: every accessor returns None and the executor runs on
    torch ops alone (tiny-qwen3-moe: q/k norm, RoPE, the MoE layers); its logits equal the kernels' up
    to float rounding (4 layers of other summation orders and, in the MoE, another exp: 1.3e-5 seen)."""
    def ex():
        return TorchExecutor(model, device="cpu", num_gpu_blocks=32, max_model_len=256, keep_logits=True)
    with_kernels = _run_steps(ex())
    for name in ("_decode", "_linear", "_argmax", "_lib"):
        monkeypatch.setattr(ck, name, None)
    monkeypatch.setattr(ck, "_tried", True)
    monkeypatch.setattr(lkm, "_kernels", None)
    monkeypatch.setattr(lkm, "_tried", True)
    assert ck.decode_kernel() is ck.small_m_linear_kernel() is ck.argmax_rows_kernel() is lkm.layer_kernels() is None
    fallback_ex = ex()
    assert fallback_ex.attn_backend._kernel is None
    without = _run_steps(fallback_ex)
    assert with_kernels[0] == without[0]
    for a, b in zip(with_kernels[1], without[1]):
        for rid in a:
            torch.testing.assert_close(a[rid], b[rid], atol=tol, rtol=tol)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("SERVETWIN_CPU_KERNELS", "0")
    monkeypatch.setattr(ck, "_tried", False)
    monkeypatch.setattr(ck, "_lib", None)
    assert ck._library() is None
