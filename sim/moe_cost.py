"""The cost of a step's mixture-of-experts layers: router, touched experts, grouped GEMMs (per TP rank).

A step of T tokens (T' padded under a CUDA graph: padded rows are routed too) through one MoE layer of
E routed experts, top-k, expert width f (gate, up, down: 3*d*f weights per expert, f/tp per rank since
vLLM shards each expert's intermediate dimension across the tensor-parallel ranks, EP 1):

    router   = max(2*d*E*(T + h_g) / (Pa*e_g),  d*E*ba / (W*u_g))       replicated on every rank, bf16
    n(T)     = E_r * (1 - (1 - k/E_r)^T)                                  experts touched (expected)
    experts  = max(2*3*d'*f'*(T*k + h_x*n(T)) / (P_x*e_x),               grouped GEMM, M tiles padded
                   (n(T)*B_e' + T*k*(2d + 3f/tp)*ba) / (W*u_x))          touched weights + row I/O
    d' = d rounded up to the kernel's `align_hidden`, f' = ceil(f/tp) rounded up to its
    `align_intermediate` (the layout vLLM gives the kernel's weights), B_e' = one expert's weights on
    this rank at that padded shape and the storage precision
    moe      = L_moe * (router + experts)

`n(T)` is the exact expectation when every token picks k distinct experts uniformly and independently
(an expert is missed by one token with probability 1 - k/E). Real routing is skewed: some experts are
hot, so fewer are touched. `E_r = max(k, E*(1 - routing_skew))` is the documented knob: with skew s, the
step's tokens route among a (1 - s) share of the experts. 0 (uniform) is the default: the published runs
feed random token ids, whose routing no one has measured. Each touched expert's rows (T*k/n on average)
are padded to the kernel's M tile, so its grouped GEMM reaches e_x*m/(m + h_x) of the peak P_x (the
rate `MoEKernel.peak` names), i.e. as if each touched expert ran h_x more rows. B_e = one expert's
weights at their storage precision (`expert_dtype`, scales and expert biases included).

The kernel is looked up by the experts' storage format in the GPU's `Efficiency.moe_kernels`; a
format the GPU has no kernel for, or a kernel whose peak the GPU lacks (fp4 on Hopper), is a
`ConfigError` naming the field - never a dense fallback. Shared experts and the dense layers of an MoE
model are dense SwiGLUs: the cost model prices them with the attention projections (`dense_matmul_params`).
"""
from __future__ import annotations

from dataclasses import dataclass

from servetwin.core.config_error import ConfigError
from servetwin.core.model_spec import ModelSpec, weight_bits
from servetwin.sim.coefficients import MoEKernel
from servetwin.sim.hardware import HardwareSpec

DTYPE_FORMATS = {"bfloat16": "bf16", "bf16": "bf16", "float16": "bf16", "fp8": "fp8",
                 "float8_e4m3fn": "fp8", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}


def expected_touched_experts(tokens: float, num_experts: int, top_k: int, routing_skew: float = 0.0) -> float:
    """Experts one MoE layer touches for `tokens` tokens, each routed to `top_k` distinct experts."""
    e_r = max(float(top_k), num_experts * (1.0 - routing_skew))
    return e_r * (1.0 - (1.0 - top_k / e_r) ** tokens)


def expert_format(model: ModelSpec, quantization: str | None) -> str:
    """The experts' storage format: `model.expert_dtype`, else fp8 with `quantization: fp8`, else the dtype."""
    name = model.expert_dtype or ("fp8" if quantization == "fp8" else model.dtype)
    fmt = DTYPE_FORMATS.get(name)
    if fmt is None:
        raise ConfigError("model.expert_dtype", f"no MoE kernel is known for experts stored as {name!r} "
                          f"(known: {', '.join(sorted(set(DTYPE_FORMATS.values())))})")
    return fmt


def moe_kernel(model: ModelSpec, hw: HardwareSpec, quantization: str | None,
               backend: str = "auto") -> tuple[MoEKernel, float]:
    """(the kernel vLLM runs for these experts on `hw`, the dense peak it computes at).

    `backend` is vLLM's `--moe-backend`: "auto" takes the GPU's entry for the format (`moe_kernels[fmt]`, the
    kernel of the runs the preset was fitted on); a named backend takes the entry `<fmt>_<backend>` or the
    format's own entry when its kernel is that family (`kernel` starts with the name), else it is refused."""
    fmt = expert_format(model, quantization)
    kernels = hw.efficiency.moe_kernels
    kernel = kernels.get(fmt)
    if kernel is None:
        raise ConfigError(f"hardware.efficiency.moe_kernels.{fmt}", f"{hw.name} has no MoE kernel rate for "
                          f"{fmt} experts ({model.name}); known here: "
                          f"{', '.join(kernels) or 'none'}")
    if backend != "auto":
        named = kernels.get(f"{fmt}_{backend}")
        if named is None and not kernel.kernel.startswith(backend):
            raise ConfigError("engine.moe_backend", f"{hw.name} has no {backend} kernel for {fmt} experts "
                              f"({model.name}); its moe_kernels: {', '.join(kernels)}")
        kernel = named or kernel
    peak = {"bf16": hw.peak_flops_bf16, "fp8": hw.peak_flops_fp8, "fp4": hw.peak_flops_fp4}[kernel.peak]
    if peak <= 0:
        raise ConfigError(f"hardware.efficiency.moe_kernels.{fmt}.peak", f"{kernel.kernel} computes at the "
                          f"{kernel.peak} rate, which {hw.name} does not have (peak_flops_{kernel.peak} = 0)")
    return kernel, peak


@dataclass(slots=True, frozen=True)
class MoECost:
    """Per-step constants of a model's MoE layers on one GPU and TP degree; `seconds(T)` prices a step."""
    num_layers: int
    num_experts: int
    top_k: int
    routing_skew: float
    kernel: MoEKernel
    router_flop: float  # s per token-row of the router (all MoE layers)
    router_half: float
    router_bytes: float  # s to read the routers' weights
    expert_flop: float  # s per expert row (all MoE layers)
    expert_bytes: float  # one expert's weights on this rank as the kernel stores them (all MoE layers)
    expert_weight: float  # s per touched expert's weights (all MoE layers)
    expert_row_io: float  # s per expert row's activations in and out (all MoE layers)

    @classmethod
    def build(cls, model: ModelSpec, hw: HardwareSpec, tp: int, quantization: str | None,
              routing_skew: float = 0.0, backend: str = "auto") -> "MoECost":
        if not 0.0 <= routing_skew < 1.0:
            raise ConfigError("routing_skew", f"must be in [0, 1), got {routing_skew!r}")
        kernel, peak = moe_kernel(model, hw, quantization, backend)
        e, W, L = hw.efficiency, hw.memory_bandwidth, model.num_moe_layers
        d, f, E, ba = model.hidden_size, model.moe_intermediate_size, model.num_experts, model.dtype_bytes
        bits = weight_bits(model.expert_dtype or ("fp8" if quantization == "fp8" else model.dtype))
        peak_bf16 = hw.peak_flops(model.dtype)
        # one expert's share on this rank as the kernel stores it: padded hidden x padded width / tp
        f_rank = -(-f // tp)
        d_pad = -(-d // kernel.align_hidden) * kernel.align_hidden
        f_pad = -(-f_rank // kernel.align_intermediate) * kernel.align_intermediate
        expert_rank = model.expert_params * (d_pad * f_pad) / (d * f)  # weights + biases, as stored
        return cls(num_layers=L, num_experts=E, top_k=model.num_experts_per_tok, routing_skew=routing_skew,
                   kernel=kernel,
                   router_flop=L * 2.0 * d * E / (peak_bf16 * e.gemm_compute), router_half=e.gemm_half_m,
                   router_bytes=L * model.router_params * ba / (W * e.gemm_bandwidth),
                   expert_flop=L * 2.0 * 3.0 * d_pad * f_pad / (peak * kernel.compute),
                   expert_bytes=L * expert_rank * bits / 8.0,
                   expert_weight=L * expert_rank * bits / 8.0 / (W * kernel.bandwidth),
                   expert_row_io=L * (2.0 * d + 3.0 * f / tp) * ba / (W * kernel.bandwidth))

    def touched(self, tokens: float) -> float:
        return expected_touched_experts(tokens, self.num_experts, self.top_k, self.routing_skew)

    def seconds(self, tokens: int) -> float:
        """Router + expert GEMMs of every MoE layer for a step of `tokens` (padded) tokens."""
        if tokens <= 0:
            return 0.0
        n = self.touched(tokens)
        rows = tokens * self.top_k
        router = max(self.router_flop * (tokens + self.router_half), self.router_bytes)
        experts = max(self.expert_flop * (rows + self.kernel.half_rows * n),
                      self.expert_weight * n + self.expert_row_io * rows)
        return router + experts
