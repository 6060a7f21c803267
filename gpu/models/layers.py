"""Building blocks: RMSNorm (HF numerics: normalise in float32; on the CPU in float32 one native call,
`servetwin.gpu.cpu_layer_kernels`), the SwiGLU MLP (packed gate/up) and `linear`, which sends
decode-sized float32 products on the CPU to the native small-M kernel."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from servetwin.gpu.cpu_kernels import small_m_linear_kernel
from servetwin.gpu.cpu_layer_kernels import layer_kernels_for
from servetwin.gpu.models.tp_shard import TPShard
from servetwin.gpu.parallel_state import TPGroup

# Rows up to which `linear` may use the native kernel (measured on an Intel Xeon, 2 threads, SmolLM2-135M's
# shapes: x1.6-1.9 at 4-13 rows, x1.4 at 16, x1.2 at 24-32, parity at 48, MKL ahead from ~64 and at 1 row);
# on each CPU the kernel's own `max_rows()` (timed against F.linear) decides how far it really goes.
SMALL_M_MAX = 48


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear`; 2-D float32 CPU inputs of 2..SMALL_M_MAX rows (outside autograd) go to the native
    kernel (`servetwin.gpu.cpu_kernels.small_m_linear`: same product, another summation order) when it builds
    and is faster on this CPU at that row count (`SmallMLinear.max_rows`)."""
    if (x.dim() == 2 and 2 <= x.shape[0] <= SMALL_M_MAX and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.is_contiguous()
            and (bias is None or bias.dtype == torch.float32) and not torch.is_grad_enabled()
            and (kernel := small_m_linear_kernel()) is not None and x.shape[0] <= kernel.max_rows()):
        return kernel(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_contiguous() and (lk := layer_kernels_for(x, self.weight)) is not None:
            return lk.rms_norm(x, self.weight, self.eps)  # one call instead of F.rms_norm's ~6 ATen ops
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the fused op computes exactly the lines below in float32 (one call instead of six)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(s, self(s))` with `s = x + residual` (vLLM's fused_add_rms_norm): on the CPU in float32 one
        native call that adds into `x` in place (the caller's own tensor) and normalises."""
        if (x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
                and (lk := layer_kernels_for(x, residual, self.weight)) is not None):
            return x, lk.rms_norm(x, self.weight, self.eps, residual=residual)
        s = residual + x
        return s, self(s)


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up packed in one `gate_up_proj`. Under tensor
    parallelism `intermediate_size` is this rank's columns (gate/up column-parallel, down row-parallel)
    and the output is summed over `tp`."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.tp = tp or TPGroup()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias).split(self.intermediate_size, dim=-1)
        return self.tp.all_reduce(linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias))


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's vocabulary slice (`TPShard.vocab_rows`); a token outside it
    embeds to zeros, and the sum over `tp` gives every token its one row (vLLM's
    `VocabParallelEmbedding`). One rank: a plain embedding lookup."""

    def __init__(self, shard: TPShard, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden_size))
        self.vocab_start = shard.vocab_start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))
