"""A routed mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss), experts run grouped by expert.

Router: `softmax(x @ gate.T + bias)` over all experts in float32, the top-k, renormalised to sum 1 when
the model says so (Mixtral and gpt-oss: equal to a softmax over the k selected logits; Qwen3-MoE: iff
`norm_topk_prob`). Dispatch: the T*k (token, expert) pairs are sorted by expert, each expert that
received tokens runs one SwiGLU over its gathered rows (a Python loop over experts, never over tokens;
or, when padding every expert to the busiest one's row count costs little, as in decode steps, all
experts in two batched GEMMs), the rows are put back in (token, slot) order and each token sums its k
weighted rows. On the CPU in float32 (outside autograd) the whole layer is one native call instead
(`servetwin.gpu.cpu_layer_kernels.fused_moe`: the same steps, exactly each expert's rows, no padding);
the torch ops above are its fallback and the CUDA path.

Weights are stored input-major, `x @ w`: `w13` [E, H, 2I] (gate columns, then up columns), `w2` [E, I, H],
gpt-oss's biases `w13_bias` [E, 2I] / `w2_bias` [E, H]; the loader converts each checkpoint layout into
these (a contiguous `bmm` operand: the transposed view of vLLM's [E, 2I, H] cost ~30% more per `bmm`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from servetwin.gpu.cpu_layer_kernels import layer_kernels_for
from servetwin.gpu.models.config import MoEConfig
from servetwin.gpu.models.layers import linear
from servetwin.gpu.parallel_state import TPGroup


# padded batched GEMMs while the padded rows stay within this factor of the real ones, else a loop over
# experts (tiny-qwen3-moe, 1 thread, CPU time of one MoE layer: 4 tokens, ~3x padding: 270-300 us padded vs
# 380-440 looped; 16 tokens: 280-300 vs 540-560); with many experts and few tokens the loop reads only the
# experts that got tokens
PAD_SLACK = 3.0


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: MoEConfig, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        # tensor parallelism shards every expert's width (vLLM's FusedMoE without expert parallelism):
        # w13 column-, w2 row-parallel, the router replicated, the layer's output summed over `tp`
        self.tp = tp or TPGroup()
        self.cfg = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size // self.tp.world_size)
        E, I = cfg.num_experts, self.cfg.intermediate_size
        self.gate = nn.Linear(hidden_size, E, bias=cfg.router_bias)  # the router
        self.w13 = nn.Parameter(torch.empty(E, hidden_size, 2 * I))
        self.w2 = nn.Parameter(torch.empty(E, I, hidden_size))
        self.w13_bias = nn.Parameter(torch.empty(E, 2 * I)) if cfg.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(E, hidden_size)) if cfg.expert_bias else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(weights [T, k] in x's dtype, expert ids [T, k])`."""
        logits = linear(x, self.gate.weight, self.gate.bias)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        limit = self.cfg.swiglu_limit
        if limit is None:
            return F.silu(gate) * up
        # gpt-oss: gate clamped from above, up to [-limit, limit], sigmoid gain alpha, (up + 1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.cfg.swiglu_alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self._local_forward(x))

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = (self.gate.weight, self.gate.bias, self.w13, self.w13_bias, self.w2, self.w2_bias)
        lk = layer_kernels_for(x, *weights)
        if lk is not None and all(w is None or w.is_contiguous() for w in weights):
            # on the CPU in float32 the whole layer in one native call: exact rows per expert, no padding
            c = self.cfg
            return lk.fused_moe(x.contiguous(), self.gate.weight, self.gate.bias, self.w13, self.w13_bias,
                                self.w2, self.w2_bias, c.top_k, c.renormalize, c.swiglu_limit, c.swiglu_alpha)
        T, k, E = x.shape[0], self.cfg.top_k, self.cfg.num_experts
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=E)
        xs = x.index_select(0, order // k)  # each pair's token row, grouped by expert
        width = int(counts.max())
        if E * width <= PAD_SLACK * T * k:
            rows = self._experts_padded(xs, flat.index_select(0, order), counts, width)
        else:
            rows = self._experts_looped(xs, counts.tolist())
        # back to (token, slot) order, then a weighted sum over each token's k slots (no index_add_: it
        # was the slowest op of a decode step on the CPU)
        per_slot = torch.empty_like(rows).index_copy_(0, order, rows).view(T, k, -1)
        return torch.bmm(weights.unsqueeze(1), per_slot).squeeze(1)

    def _experts_looped(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One SwiGLU per expert that received rows, over its contiguous slice of `xs`."""
        rows = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = _matmul(xs[start:start + n], self.w13[e], None if self.w13_bias is None else self.w13_bias[e])
                rows[start:start + n] = _matmul(self.act(h), self.w2[e],
                                                None if self.w2_bias is None else self.w2_bias[e])
                start += n
        return rows

    def _experts_padded(self, xs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                        width: int) -> torch.Tensor:
        """Every expert's rows padded to `width` slots, all experts in two batched GEMMs (`bmm`) instead
        of two small GEMMs per expert: decode steps, where each expert gets a few rows and per-call
        overhead dominates. `experts[j]`: the expert of grouped row j."""
        E, H = self.cfg.num_experts, xs.shape[1]
        starts = torch.cumsum(counts, 0) - counts
        slot = experts * width + torch.arange(xs.shape[0], device=xs.device) - starts.index_select(0, experts)
        padded = xs.new_zeros(E * width, H).index_copy_(0, slot, xs).view(E, width, H)
        h = torch.bmm(padded, self.w13)
        if self.w13_bias is not None:
            h = h + self.w13_bias[:, None, :]
        out = torch.bmm(self.act(h), self.w2)
        if self.w2_bias is not None:
            out = out + self.w2_bias[:, None, :]
        return out.view(E * width, H).index_select(0, slot)


def _matmul(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`x @ w (+ bias)` for an input-major `w` (torch's BLAS, not the native small-M kernel, which is
    written for `F.linear`'s layout)."""
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
