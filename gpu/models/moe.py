"""A routed mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss), experts run grouped by expert.

Router: `softmax(x @ gate.T + bias)` over all experts in float32, the top-k, renormalised to sum 1 when
the model says so (Mixtral and gpt-oss: equal to a softmax over the k selected logits; Qwen3-MoE: iff
`norm_topk_prob`). Dispatch: the T*k (token, expert) pairs are sorted by expert, each expert that
received tokens runs one SwiGLU over its gathered rows (a Python loop over experts, never over tokens),
and the weighted rows are summed back per token with one `index_add_`.

Weights: `w13` [E, 2I, H] (gate rows, then up rows: vLLM's layout), `w2` [E, H, I], gpt-oss's biases
`w13_bias` [E, 2I] / `w2_bias` [E, H]; the loader converts each checkpoint layout into these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servetwin.gpu.models.config import MoEConfig
from servetwin.gpu.models.layers import linear


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E, I = cfg.num_experts, cfg.intermediate_size
        self.gate = nn.Linear(hidden_size, E, bias=cfg.router_bias)  # the router
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, hidden_size))
        self.w2 = nn.Parameter(torch.empty(E, hidden_size, I))
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
        T, k = x.shape[0], self.cfg.top_k
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // k
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        rows = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = tokens[start:start + n]
            h = linear(x.index_select(0, sel), self.w13[e], None if self.w13_bias is None else self.w13_bias[e])
            rows[start:start + n] = linear(self.act(h), self.w2[e], None if self.w2_bias is None else self.w2_bias[e])
            start += n
        rows.mul_(weights.reshape(-1).index_select(0, order)[:, None])
        return torch.zeros_like(x).index_add_(0, tokens, rows)
