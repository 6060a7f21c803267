"""`FusedMoE`'s dispatch paths (the native CPU kernel; the torch ops: padded batched GEMMs, loop over
experts) against a per-token reference: each token's top-k experts, their SwiGLU (gpt-oss: clamped, with
biases), routing weights."""
from __future__ import annotations

import pytest
import torch

import servetwin.gpu.cpu_layer_kernels as lkm
from servetwin.gpu.models import moe as moe_mod
from servetwin.gpu.models.config import MoEConfig
from servetwin.gpu.models.moe import FusedMoE


def reference(m: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    logits = x @ m.gate.weight.T + (0 if m.gate.bias is None else m.gate.bias)
    probs = logits.double().softmax(-1)
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        w, ids = probs[t].topk(m.cfg.top_k)
        if m.cfg.renormalize:
            w = w / w.sum()
        for wi, e in zip(w, ids.tolist()):
            h = x[t].double() @ m.w13[e].double() + (0 if m.w13_bias is None else m.w13_bias[e].double())
            y = m.act(h[None])[0] @ m.w2[e].double() + (0 if m.w2_bias is None else m.w2_bias[e].double())
            out[t] += wi * y
    return out.float()


@pytest.mark.parametrize("cfg", [MoEConfig(num_experts=8, top_k=2, intermediate_size=24, renormalize=True),
                                 MoEConfig(num_experts=6, top_k=3, intermediate_size=16, renormalize=False),
                                 MoEConfig(num_experts=8, top_k=2, intermediate_size=24, renormalize=True,
                                           router_bias=True, expert_bias=True, swiglu_limit=1.5)])
@pytest.mark.parametrize("slack", [0.0, 1e9, None])  # 0: always the expert loop; huge: always padded; None: kernel
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_dispatch_paths_match_per_token_reference(cfg, slack, tokens, monkeypatch):
    torch.manual_seed(tokens)
    m = FusedMoE(32, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(tokens, 32)
    if slack is None:
        if lkm.layer_kernels() is None:
            pytest.skip("the CPU layer kernels did not build here")
    else:  # the torch ops (also the CUDA path): the native kernel off
        monkeypatch.setattr(lkm, "_kernels", None)
        monkeypatch.setattr(lkm, "_tried", True)
        monkeypatch.setattr(moe_mod, "PAD_SLACK", slack)
    with torch.inference_mode():
        torch.testing.assert_close(m(x), reference(m, x), atol=2e-5, rtol=1e-5)
