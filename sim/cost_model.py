"""Predict one engine step's duration from the batch composition.

A step is a list of rows, one per scheduled request: `q` = tokens scheduled this step, `s` = tokens
already computed before the step (prefix-cache hits and earlier chunks included), `samples` = the
chunk reaches the request's last known token (so the LM head and sampler run for it).

Notation (per tensor-parallel rank): L layers, d hidden, V vocab, dh head dim, dff FFN width,
Hq = ceil(H/tp) query heads, Hk = ceil(H_kv/tp) KV heads, bw = bytes per weight (1 with fp8
weights), ba = bytes per activation element, bk = bytes per KV element (1 with kv_cache_dtype fp8),
P = dense peak for the layers' GEMM dtype (the fp8 peak for fp8 weights on a device with fp8 tensor
cores, where they reach `gemm_fp8_relative` times the fraction e_g; else bf16), Pa = the bf16 peak
(attention and the LM head, which fp8 quantisation leaves in bf16), W = memory bandwidth, Wl =
interconnect bandwidth, lat = collective latency, M = matmul weights of one layer (q, k, v, o, gate, up, down).
Rows split by shape into prefill rows (q > 1) and decode rows (q = 1). T = scheduled tokens; T' = T
padded up to the next CUDA-graph capture size when graphs are on and T fits the largest one: a
decode-only step (every q = 1) replays a full graph, any other step runs vLLM V1's piecewise graphs,
which pad the step's tokens the same way (`pad_for_cudagraph` in its model runner; attention, outside
the graphs, runs on the real tokens); R = rows that sample.

Efficiencies (`servetwin.sim.coefficients.Efficiency`, per kernel class, data with provenance):
a compute fraction e and a bandwidth fraction u of the datasheet, and where the shape matters a
half-saturation size h: a GEMM over M tokens reaches e*M/(M+h) of the peak (small token counts
cannot fill the tensor cores: tile and wave quantisation), so its compute time is
2*M*K*N / (P*e*M/(M+h)) = 2*K*N*(M + h) / (P*e) - as if every GEMM ran h extra rows. Prefill
attention's efficiency depends on the keys each query attends to (chunk length and cached prefix
together): x = pairs / sum q, e*x/(x+h), i.e. h extra keys per query. Each term is a roofline of the
kernels it stands for (they run one after another, so their times add):

    linear       = max(2*L*M*(T' + h_g)/tp / (P*e_g),  L*params_layer*bw/tp / (W*u_g))   weights read once
    elementwise  = L*T*ba*(10d + 3*dff/tp + 2*(Hq + 2Hk)*dh) / (W*u_g)  norms, rope, SiLU*up, residuals
                   + with fp8 GEMMs (W8A8), L*T*5*(2d + Hq*dh + dff/tp) / (W*u_g): each GEMM input is
                   quantised per step with a dynamic per-tensor scale (a max pass and a quantising
                   pass over the bf16 input, a 1-byte write)
    attn_prefill = max(L*4*Hq*dh*(pairs + h_a*sum q) / (Pa*e_a),                 causal chunk after prefix
                       L*2*Hk*dh*bk*(sum (s+q) - S_pre + sum q) / (W*u_a))       KV read + KV write
                   pairs = sum q*s + (sum q^2 + sum q)/2
    attn_decode  = max(L*4*Hq*dh*sum(s+1) / (Pa*e_d),
                       L*2*Hk*dh*bk*(sum (s+1) - S_dec + n_dec) / (W*u_d))       paged KV reads
                   beside a chunk (a prefill row in the step) with r = `attn_mixed_decode_rows` > 0, the
                   compute side is L*4*Hq*dh*r*(sum(s+1) + h_a*n_dec) / (Pa*e_a): one varlen call, each
                   decode row padded to r query rows per query head (FlashAttention-2: 64)
    attn_shared  = L*2*Hk*dh*bk*(S_dec + S_pre) / (W*u_d)                         shared prefix blocks
    lm_head      = max(2*d*V*(R + h_g)/tp / (Pa*e_g),  (V*d*ba + R*V*4)/tp / (W*u_g))  sampling rows only
    sampler      = SAMPLER_PASSES*R*V*4 / (W*u_g)                   fp32 passes over the logits
    comm         = 2L*(lat + 2(tp-1)/tp * T'*d*ba / (Wl*u_c))       two ring all-reduces per layer
                   + [R > 0] * (lat + (tp-1)/tp * R*V*ba / (Wl*u_c))  logits all-gather (0 when tp = 1)
                   with `fuse_allreduce_rms` (vLLM's compilation pass, off by default) and tp > 1, a step whose
                   all-reduce input T'*d*ba fits vLLM's limit for the GPU and tp runs each residual add +
                   RMSNorm inside the all-reduce kernel: `elementwise` loses L*T*ba*4d (FUSED_NORM_SAVED_D);
                   the all-reduce itself is priced as above (its one-shot latency is not modelled apart)
    layer        = L when CUDA graphs are off (every kernel launched from the host), else 0
    layer_piecewise = L for a step outside a full CUDA graph while graphs are on (vLLM V1's
                   piecewise graphs: attention is launched per layer), else 0
    step = 1, req = number of rows, token = T, tp_step = [tp > 1], ipc_step = [ipc],
    ipc_req = [ipc] * rows
    moe          = router + routed experts of every MoE layer at T' tokens (`servetwin.sim.moe_cost`)
    moe_layer    = number of MoE layers (the MoE block's kernel floor)

An MoE model's M (in `linear`, `elementwise`) holds the attention projections, its dense layers' MLPs and
any shared expert; its routed experts are `moe`, never a dense MLP. Sliding-window and chunked layers
(`model.layer_types`) pay the attention terms with at most W keys per query (`_window_attention`); the
full layers keep the formulas above. With async scheduling a step lasts max(prepare, forward + sample):
the engine prepares the next step while the GPU runs this one.

    t_step = sum_k c_k * basis_k          (c_k >= 0, from `HardwareSpec.coefficients`)

The CPU terms (`step`, `req`, `token`) are the engine's own time per step (schedule, prepare inputs,
sample bookkeeping, process outputs), which vLLM V1 without async scheduling does not overlap with
the GPU. S = `shared_kv` tokens: KV of blocks that several scheduled requests hold (prefix-cache
hits), counted once per extra holder (`SchedulerOutput.shared_kv_tokens`). Every row still reads
them, but after the first read they may come from a cache (CPU caches, a GPU's L2), so their bytes
have a term of their own; they are taken from the decode rows' reads first (S_dec = min(S, sum
(s+1))), the rest from the prefill rows' cached prefixes (S_pre <= sum s).

With every efficiency at 1 (h = 0) and every roofline coefficient 1 this is the ideal datasheet
roofline plus fixed overheads; `servetwin.sim.calibration.fit_coefficients` fits the c_k by
non-negative least squares from measured steps (the efficiencies stay fixed: they are the physics,
the c_k the residual correction). Sums over rows (never means) keep skewed batches right.

Monotonicity: more requests, longer cached contexts and longer chunks never lower the prediction
of an eager step, and larger decode batches never lower it under CUDA graphs. Exceptions, both
by design: (1) turning a decode row (q = 1) into a 2-token chunk moves its KV read into the
prefill phase, where a compute-bound prefill hides it; (2) adding a chunk to a padded decode
batch makes it run outside the full graph and unpadded, so the padding's GEMM work disappears
(while the `layer_piecewise` launch term appears). (3) A measured GEMM curve
(`Efficiency.gemm_m_curve`, from a CPU calibration) is followed as measured, dips included.

With a measured curve, `linear`'s compute side is 2*L*M*T' / (P * f(T'))/tp, f the curve's fraction of
the peak at T' tokens (interpolated; the LM head keeps the smooth form).
"""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.outputs import StepTiming
from servetwin.sim.coefficients import BASIS_TERMS, CostCoefficients
from servetwin.core.kv_cache.kv_sizing import dtype_bytes
from servetwin.sim.hardware import HardwareSpec, load_hardware
from servetwin.core.model_spec import SLIDING_ATTENTION
from servetwin.sim.model_spec import ModelSpec, load_model_spec
from servetwin.sim.moe_cost import MoECost

LOGITS_BYTES = 4  # logits are materialised in fp32 for sampling
SAMPLER_PASSES = 4  # fp32 passes over the logits: temperature, softmax, sample, logprob bookkeeping
ELEMENTWISE_D = 10  # d-sized reads+writes per token per layer: 2 RMSNorms, 2 residual adds, rope
FP8_QUANT_BYTES = 5  # per GEMM-input element, dynamic per-tensor fp8: max pass (2) + read (2) + write (1)
# vLLM's fused all-reduce + residual add + RMSNorm (`fuse_allreduce_rms`, FlashInfer's TRT-LLM all-reduce
# fusion): each of the layer's two fused_add_rms_norm passes (read x and residual, write both: 4d) is
# folded into the all-reduce kernel, which already holds the reduced x and adds only the residual's
# read and write (2d): 2d saved per norm, 4d of ELEMENTWISE_D's 10d per layer.
FUSED_NORM_SAVED_D = 4
# vLLM's largest all-reduce input (bytes) the fused kernel takes, by world size; larger steps fall back
# to the unfused all-reduce + norm (vllm/compilation allreduce_rms_fusion.py FI_ALLREDUCE_FUSION_MAX_SIZE_MB,
# SM 9.0 = Hopper and SM 10.0 = Blackwell; InferenceMAX overrides it with VLLM_FLASHINFER_ALLREDUCE_FUSION_THRESHOLDS_MB)
ALLREDUCE_FUSION_MAX_MB = {"hopper": {2: 64, 4: 2, 8: 0.5}, "blackwell": {2: 64, 4: 32, 8: 1}}


def curve_fraction(curve: Sequence[tuple[float, float]], m: float) -> float:
    """A measured GEMM curve's fraction of the peak at M tokens (`Efficiency.gemm_m_curve`): linear
    between its points, the first / last point's value outside them."""
    if m <= curve[0][0]:
        return curve[0][1]
    for (m0, e0), (m1, e1) in zip(curve, curve[1:]):
        if m <= m1:
            return e0 + (e1 - e0) * (m - m0) / (m1 - m0)
    return curve[-1][1]


def default_cuda_graph_sizes(max_size: int = 512) -> list[int]:
    """vLLM's default capture sizes: 1, 2, 4, then every 8 up to 256, then every 16 up to max (its
    `max_cudagraph_capture_size`: by default min(2 * max_num_seqs, 512, max_num_batched_tokens))."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


@dataclass(slots=True, frozen=True)
class RowShape:
    q: int  # tokens scheduled this step
    s: int  # tokens computed before the step
    samples: bool = True


@dataclass(slots=True)
class StepSummary:
    """Per-step sums over rows; prefill = rows with q > 1, decode = rows with q == 1. (speed: not frozen - a
    frozen dataclass's `__init__` sets each of the eleven fields through `object.__setattr__`, ~6x the time
    of a plain one, and the executor builds one per normal step; nothing changes one once built.)"""
    num_reqs: int = 0
    num_tokens: int = 0
    num_sampling: int = 0
    prefill_reqs: int = 0
    prefill_sum_q: int = 0
    prefill_sum_q2: int = 0
    prefill_sum_q_s: int = 0
    prefill_sum_kv: int = 0  # sum of (s + q)
    decode_reqs: int = 0
    decode_sum_kv: int = 0  # sum of (s + 1)
    shared_kv: int = 0  # KV tokens of blocks several rows hold, once per extra holder

    @property
    def uniform_decode(self) -> bool:
        return self.num_reqs > 0 and self.prefill_reqs == 0

    @classmethod
    def from_rows(cls, rows: Iterable[Any]) -> "StepSummary":
        """Rows are `RowShape`s, `(q, s, samples)` tuples or `servetwin.core.engine.runner_state.ScheduledRow`s."""
        qs: list[int] = []
        ss: list[int] = []
        num_sampling = 0
        for row in rows:
            q, s, samples = _row_values(row)
            qs.append(q)
            ss.append(s)
            num_sampling += bool(samples)
        return cls.from_lists(qs, ss, num_sampling)

    @classmethod
    def from_lists(cls, qs: Sequence[int], ss: Sequence[int], num_sampling: int,
                   implicit_decodes: int = 0, implicit_sum_s: int = 0, shared_kv: int = 0) -> "StepSummary":
        """From per-row scheduled tokens `qs`, computed-before tokens `ss` and the sampling count, plus
        `implicit_decodes` sampling decode rows given only by their sum of `s` (`SchedulerOutput.implicit_decodes`)
        and the step's `shared_kv` tokens."""
        p_reqs = p_q = p_q2 = p_qs = p_kv = 0
        d_reqs, d_s = implicit_decodes, implicit_sum_s
        num_sampling += implicit_decodes
        for q, s in zip(qs, ss):
            if q < 1 or s < 0:
                raise ValueError(f"step row: need q >= 1 and s >= 0, got q={q}, s={s}")
            if q == 1:
                d_reqs += 1
                d_s += s
            else:
                p_reqs += 1
                p_q += q
                p_q2 += q * q
                p_qs += q * s
                p_kv += s + q
        # positional, in field order (once per simulated step: a compiled build calls the constructor
        # natively, where `cls(**...)` parsed eleven keywords)
        return StepSummary(len(qs) + implicit_decodes, p_q + d_reqs, num_sampling, p_reqs, p_q, p_q2, p_qs, p_kv,
                           d_reqs, d_s + d_reqs, shared_kv)


def _row_values(row: Any) -> tuple[int, int, bool]:
    if isinstance(row, tuple):
        return int(row[0]), int(row[1]), bool(row[2]) if len(row) > 2 else True
    if isinstance(row, RowShape):
        return row.q, row.s, row.samples
    if hasattr(row, "num_scheduled"):  # servetwin.core.engine.runner_state.ScheduledRow
        return row.num_scheduled, row.num_computed_before, row.samples
    q, s, *rest = row
    return int(q), int(s), bool(rest[0]) if rest else True


def allreduce_fusion_max_bytes(hw: HardwareSpec, tp: int) -> float:
    """vLLM's size limit of the fused all-reduce + RMSNorm on this GPU at this TP (0: never fused).
    FlashInfer's kernel needs Hopper or Blackwell: a device without fp8 tensor cores is an error."""
    if not hw.has_fp8:
        raise ConfigError("fuse_allreduce_rms", f"FlashInfer's fused all-reduce needs a Hopper or Blackwell GPU; "
                                                f"hardware {hw.name!r} has no fp8 tensor cores")
    arch = "blackwell" if hw.peak_flops_fp4 > 0 else "hopper"
    return ALLREDUCE_FUSION_MAX_MB[arch].get(tp, 0.0) * 2**20


WEIGHT_QUANTIZATIONS = (None, "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float16", "float32")


class CostModel:
    def __init__(self, model: ModelSpec | str, hw: HardwareSpec | str, tp: int = 1,
                 cuda_graphs: Optional[bool] = None, graph_sizes: Optional[Sequence[int]] = None,
                 ipc: bool = False, coefficients: Optional[CostCoefficients] = None,
                 quantization: Optional[str] = None, kv_cache_dtype: str = "auto",
                 async_scheduling: bool = False, routing_skew: float = 0.0,
                 fuse_allreduce_rms: bool = False, piecewise_graphs: bool = True,
                 moe_backend: str = "auto") -> None:
        self.model = load_model_spec(model)
        self.hw = load_hardware(hw)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp: must be an integer >= 1, got {tp!r}")
        if self.model.num_heads % tp:
            raise ValueError(f"tp: {tp} must divide the number of attention heads "
                             f"({self.model.num_heads})")
        if tp > 1 and self.hw.interconnect_bandwidth <= 0:
            raise ValueError(f"tp: {tp} needs an interconnect, but hardware {self.hw.name!r} has "
                             "interconnect_bandwidth 0")
        if quantization not in WEIGHT_QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {WEIGHT_QUANTIZATIONS[1:]} or None, got {quantization!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        if cuda_graphs is None:
            cuda_graphs = self.hw.device_type == "cuda"
        if cuda_graphs and self.hw.device_type != "cuda":
            raise ValueError(f"cuda_graphs: hardware {self.hw.name!r} is not a CUDA device")
        sizes = sorted(set(graph_sizes)) if graph_sizes is not None else default_cuda_graph_sizes()
        if cuda_graphs and (not sizes or sizes[0] < 1):
            raise ValueError(f"graph_sizes: must be positive integers, got {graph_sizes!r}")
        self.tp = tp
        self.cuda_graphs = bool(cuda_graphs)
        self.graph_sizes: list[int] = sizes if self.cuda_graphs else []
        # vLLM V1 runs a step that is not a uniform decode in piecewise graphs, padded like a decode
        # batch; servetwin's torch backend runs it eagerly (a profile calibrated on it says so)
        self.piecewise_graphs = bool(piecewise_graphs)
        self.ipc = bool(ipc)
        self.quantization = quantization
        self.kv_cache_dtype = kv_cache_dtype
        self.async_scheduling = bool(async_scheduling)
        self.routing_skew = routing_skew
        self.fuse_allreduce_rms = bool(fuse_allreduce_rms)
        self.moe_backend = moe_backend
        self.coefficients = coefficients if coefficients is not None else self.hw.coefficients
        self._precompute()

    def _precompute(self) -> None:
        """The formula's per-shape constants: model, hardware, tp and dtypes are fixed from here on,
        so `predict` is a handful of multiply-adds (it runs once per simulated step)."""
        m, hw, e, tp = self.model, self.hw, self.hw.efficiency, self.tp
        ba = m.dtype_bytes  # activations stay in the model dtype (fp8 runs W8A8 with bf16 outputs)
        bw = 1 if self.quantization == "fp8" else ba
        bk = 1 if self.kv_cache_dtype == "fp8" else (
            ba if self.kv_cache_dtype == "auto" else dtype_bytes(self.kv_cache_dtype))
        self.weight_bytes_per_param, self.kv_bytes_per_element = bw, bk
        L, d, V, dh = m.num_layers, m.hidden_size, m.vocab_size, m.head_dim
        hq, hk = -(-m.num_heads // tp), -(-m.num_kv_heads // tp)
        # the dense GEMMs: attention projections, dense MLPs, shared experts (the routed experts: `moe`)
        n_moe = m.num_moe_layers
        n_dense = L - n_moe
        dense_mm = (L * m.attention_matmul_params + n_dense * m.dense_mlp_matmul_params
                    + n_moe * m.shared_expert_matmul_params)
        dense_params = (L * (m.attention_params + 2 * d) + n_dense * m.dense_mlp_params
                        + n_moe * m.shared_expert_matmul_params)
        mlp_width = n_dense * m.intermediate_size + n_moe * (
            m.num_experts_per_tok * m.moe_intermediate_size + m.shared_expert_intermediate_size)
        self.moe = (MoECost.build(m, hw, tp, self.quantization, self.routing_skew, self.moe_backend)
                    if n_moe else None)
        w8a8 = self.quantization == "fp8" and hw.has_fp8  # else W8A16: bf16 GEMMs on 1-byte weights
        peak_gemm = hw.peak_flops("fp8" if w8a8 else m.dtype) * (e.gemm_fp8_relative if w8a8 else 1.0)
        quant = FP8_QUANT_BYTES * (L * (2 * d + hq * dh) + mlp_width / tp) if w8a8 else 0.0
        peak_dtype = hw.peak_flops(m.dtype)  # attention and the LM head run in the model dtype
        W = hw.memory_bandwidth
        wg, wa, wd = W * e.gemm_bandwidth, W * e.attn_prefill_bandwidth, W * e.attn_decode_bandwidth
        attn_rates = (
            4.0 * hq * dh / (peak_dtype * e.attn_prefill_compute),  # prefill attention s per pair
            2.0 * hk * dh * bk / wa,  # prefill attention s per KV token read or written
            4.0 * hq * dh / (peak_dtype * e.attn_decode_compute),
            2.0 * hk * dh * bk / wd,  # decode attention s per KV token read
            # decode rows beside a chunk: padded query rows at the varlen kernel's rate
            4.0 * hq * dh * e.attn_mixed_decode_rows / (peak_dtype * e.attn_prefill_compute))
        # attention by layer type: full layers see the whole context, sliding / chunked ones a window
        window_layers = [t for t in m.attention_types if t != "full_attention"]
        Lw = len(window_layers)
        Lf = L - Lw
        self.attention_window = 0.0
        if len(set(window_layers)) > 1:
            raise ConfigError("model.layer_types", "sliding-window and chunked layers in one model are not "
                              "priced (one window per model)")
        if Lw:  # a chunked layer's query sees (its position mod C) + 1 keys: (C + 1) / 2 on average
            self.attention_window = (
                float(m.sliding_window)  # type: ignore[arg-type]  # (set for sliding layers)
                if window_layers[0] == SLIDING_ATTENTION else (m.attention_chunk_size + 1) / 2.0)
        lat = ar = ag = 0.0
        if tp > 1:
            frac = (tp - 1) / tp
            link = hw.interconnect_bandwidth * e.comm_bandwidth
            lat, ar, ag = hw.interconnect_latency_s, 2.0 * frac * d * ba / link, frac * V * ba / link
        # the fused all-reduce + RMSNorm: bytes saved per token, and the most tokens it takes (T*d*ba <= max)
        self._fused_norm, self._fusion_max_tokens = 0.0, -1
        if self.fuse_allreduce_rms and tp > 1:
            self._fused_norm = ba * L * FUSED_NORM_SAVED_D * d / wg
            self._fusion_max_tokens = int(allreduce_fusion_max_bytes(hw, tp) // (d * ba))
        self._const_terms = (
            float(L), e.gemm_half_m, e.attn_prefill_half_kv, tp,
            2.0 * dense_mm / tp / (peak_gemm * e.gemm_compute),  # linear s per token
            dense_params * bw / tp / wg,  # linear: weights once
            (ba * (L * (ELEMENTWISE_D * d + 2 * (hq + 2 * hk) * dh) + 3 * mlp_width / tp) + quant) / wg,
            *(Lf * r for r in attn_rates),
            # the LM head stays bf16 under fp8 quantisation (vLLM quantises the layers' linear ops only)
            2.0 * d * V / tp / (peak_dtype * e.gemm_compute),  # LM head s per row
            V * d * ba / tp / wg, V * LOGITS_BYTES / tp / wg,  # LM head weights, logits per row
            SAMPLER_PASSES * V * LOGITS_BYTES / wg,  # sampler per row
            lat, ar, ag)
        # the window layers' constants: the full layers' per-layer rates times Lw
        self._window_const = tuple(Lw * r for r in attn_rates) if Lw else ()
        self._moe_layers = float(n_moe)
        self._moe_seconds: dict[int, float] = {}
        self._decode_parts: dict[int, tuple] = {}  # batch size -> `_new_decode_parts` (decode_duration)
        self._decode_padded: dict[int, int] = {}  # batch size -> a pure decode batch's padded tokens (predict)
        # a measured GEMM curve (`Efficiency.gemm_m_curve`): the rows the linear term charges at T tokens,
        # T * gemm_compute / fraction(T), tabulated once up to the curve's last point (then its slope)
        self._gemm_rows: Optional[list[float]] = None
        self._gemm_tail = 1.0
        if e.gemm_m_curve:
            curve = e.gemm_m_curve
            self._gemm_rows = [t * e.gemm_compute / curve_fraction(curve, t) for t in range(int(curve[-1][0]) + 1)]
            self._gemm_tail = e.gemm_compute / e.gemm_m_curve[-1][1]

    @property
    def weight_bytes_per_rank(self) -> int:
        """Weights one tensor-parallel rank holds (what the KV pool sizing subtracts): the experts as their
        kernel stores them (padded, `servetwin.sim.moe_cost`), the layers' other weights at
        `weight_bytes_per_param`, and what fp8 leaves unquantised (`ModelSpec.unquantized_params`: embedding,
        LM head, routers, norms) in the model dtype. The Llama-3.1-70B w8a8 and Qwen3-30B-A3B FP8 start-up
        logs agree within 0.3% (tests/experiments/test_exp_vllm_server_log.py); 1 byte for every weight was
        2-3% under them."""
        m = self.model
        kept = m.unquantized_params
        experts = m.num_expert_parameters if self.moe is not None else 0
        rest = (m.num_parameters - kept - experts) * self.weight_bytes_per_param + kept * m.dtype_bytes
        if self.moe is None:
            return rest // self.tp
        return int(rest / self.tp + m.num_experts * self.moe.expert_bytes)

    # -- shape helpers -------------------------------------------------------------------------
    def padded_tokens(self, step: StepSummary) -> tuple[int, bool]:
        """(tokens the forward runs on, whether it replays a full CUDA graph): a step up to the
        largest capture size is padded to the next one - a uniform decode replays a full graph, any
        other step the piecewise graphs (when `piecewise_graphs`; else it runs eagerly, unpadded)."""
        n = step.num_tokens
        if self.cuda_graphs and n <= self.graph_sizes[-1] and (step.uniform_decode or self.piecewise_graphs):
            return self.graph_sizes[bisect.bisect_left(self.graph_sizes, n)], step.uniform_decode
        return n, False

    @staticmethod
    def summarize(step: StepSummary | Iterable[Any]) -> StepSummary:
        return step if isinstance(step, StepSummary) else StepSummary.from_rows(step)

    # -- the model -----------------------------------------------------------------------------
    def _terms(self, st: StepSummary) -> tuple[tuple[float, ...], int]:
        """(basis values in `BASIS_TERMS` order, padded tokens): one implementation, used by `basis`
        and `predict`."""
        ipc = 1.0 if self.ipc else 0.0
        (L, h_g, h_a, tp, lin_flop, lin_bytes, ew, ap_flop, ap_byte, ad_flop, ad_byte, ad_mixed_flop,
         lm_flop, lm_w, lm_row, samp, lat, ar, ag) = self._const_terms
        if st.num_reqs == 0:
            return (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                    1.0 if tp > 1 else 0.0, ipc, 0.0, 0.0, 0.0), 0
        t_pad, graph = self.padded_tokens(st)
        rows = self._gemm_rows
        if rows is None:
            linear = max(lin_flop * (t_pad + h_g), lin_bytes)
        else:
            linear = max(lin_flop * (rows[t_pad] if t_pad < len(rows) else t_pad * self._gemm_tail), lin_bytes)
        elementwise = ew * st.num_tokens
        if t_pad <= self._fusion_max_tokens:  # the norms run inside the fused all-reduce
            elementwise -= self._fused_norm * st.num_tokens
        pairs = st.prefill_sum_q_s + (st.prefill_sum_q2 + st.prefill_sum_q) / 2.0
        shared_dec = min(st.shared_kv, st.decode_sum_kv)
        shared_pre = min(st.shared_kv - shared_dec, st.prefill_sum_kv - st.prefill_sum_q)
        if st.prefill_reqs:
            attn_prefill = max(ap_flop * (pairs + h_a * st.prefill_sum_q),
                               ap_byte * (st.prefill_sum_kv - shared_pre + st.prefill_sum_q))
        else:
            attn_prefill = 0.0
        decode_bytes = ad_byte * (st.decode_sum_kv - shared_dec + st.decode_reqs)
        if st.prefill_reqs and ad_mixed_flop:
            attn_decode = max(ad_mixed_flop * (st.decode_sum_kv + h_a * st.decode_reqs), decode_bytes)
        else:
            attn_decode = max(ad_flop * st.decode_sum_kv, decode_bytes)
        attn_shared = ad_byte * (shared_dec + shared_pre)
        if self._window_const:
            wp, wd = self._window_attention(st, pairs)
            attn_prefill += wp
            attn_decode += wd
        r = st.num_sampling
        if r:
            lm_head = max(lm_flop * (r + h_g), lm_w + lm_row * r)
            sampler = samp * r
        else:
            lm_head = sampler = 0.0
        comm = 0.0
        if tp > 1:
            comm = 2.0 * L * (lat + ar * t_pad)
            if r:
                comm += lat + ag * r
        if self.cuda_graphs:
            layer, piecewise = 0.0, (0.0 if graph else L)
        else:
            layer, piecewise = L, 0.0
        reqs = float(st.num_reqs)
        moe = 0.0
        if self.moe is not None:  # a function of the padded token count alone: memoised
            if t_pad not in self._moe_seconds:
                self._moe_seconds[t_pad] = self.moe.seconds(t_pad)
            moe = self._moe_seconds[t_pad]
        return (1.0, reqs, float(st.num_tokens), layer, piecewise, linear, elementwise, attn_prefill,
                attn_decode, attn_shared, lm_head, sampler, comm, 1.0 if tp > 1 else 0.0, ipc,
                reqs if self.ipc else 0.0, moe, self._moe_layers), t_pad

    def _window_attention(self, st: StepSummary, pairs: float) -> tuple[float, float]:
        """(prefill, decode) attention seconds of the sliding-window / chunked layers: a query reads at
        most W keys (`attention_window`). From the step's sums, rows are taken as all inside or all past
        the window (min of the two), exact when every row is on one side of it and an upper bound else."""
        ap_flop, ap_byte, ad_flop, ad_byte, ad_mixed_flop = self._window_const
        w, h_a = self.attention_window, self._const_terms[2]
        prefill = decode = 0.0
        if st.prefill_reqs:
            q = st.prefill_sum_q
            keys = min(pairs, w * q)
            read = min(st.prefill_sum_kv - q, w * st.prefill_reqs)
            prefill = max(ap_flop * (keys + h_a * q), ap_byte * (read + 2 * q))
        if st.decode_reqs:
            keys = min(st.decode_sum_kv, w * st.decode_reqs)
            flop = (ad_mixed_flop * (keys + h_a * st.decode_reqs) if st.prefill_reqs and ad_mixed_flop
                    else ad_flop * keys)
            decode = max(flop, ad_byte * (keys + st.decode_reqs))
        return prefill, decode

    def basis(self, step: StepSummary | Iterable[Any]) -> dict[str, float]:
        """Basis terms of the step (see the module docstring); keys are `BASIS_TERMS`."""
        return dict(zip(BASIS_TERMS, self._terms(self.summarize(step))[0]))

    def decode_duration(self, num_reqs: int, decode_sum_kv: int, shared_kv: int = 0) -> float:
        """`predict(StepSummary(...)).duration_s` of a pure decode batch - `num_reqs` rows of one token,
        each sampling, their (s + 1) summing to `decode_sum_kv`, `shared_kv` shared tokens - for the
        simulator's fused decode steps: the parts that do not depend on the KV lengths are kept per batch
        size (`_decode_parts`), the decode attention terms are `_terms`' expressions for a step without
        prefill rows, and the sums are `_parts`' and `_duration`'s in their order, so the float is the
        same (tests/sim/test_sim_fused_step.py)."""
        return self._decode_step(self._decode_parts_of(num_reqs), num_reqs, decode_sum_kv, shared_kv)

    def decode_durations(self, num_reqs: int, first_sum_kv: int, shared_kv: int, n: int) -> list[float]:
        """`decode_duration(num_reqs, first_sum_kv + i * num_reqs, shared_kv)` for i in 0..n-1, element for
        element (n consecutive fused decode steps of the same rows: each step adds one token per row).
        (speed: a step window prices dozens of steps at once. Once the KV sum exceeds the shared tokens
        and the sliding window's keys - from the first step on, in most windows - the min of each is the
        same value at every step: their terms are computed once, and each step is the rest of
        `_decode_step`'s expressions in its order, max as a comparison, in one loop - the same floats,
        tests/sim/test_sim_decode_durations.py)"""
        if n <= 0:
            return []
        parts = self._decode_parts_of(num_reqs)
        _, prepare, head, c_decode, c_shared, tail, moe, sample, ad_flop, ad_byte, w_flop, w_byte, w_keys = parts
        out: list[float] = []
        sum_kv, stop = first_sum_kv, first_sum_kv + n * num_reqs
        while sum_kv < stop and (sum_kv <= shared_kv or (w_keys is not None and sum_kv <= w_keys)):
            out.append(self._decode_step(parts, num_reqs, sum_kv, shared_kv))
            sum_kv += num_reqs
        if sum_kv >= stop:
            return out
        shared_term = c_shared * (ad_byte * shared_kv)  # (shared_dec = shared_kv: below every sum from here)
        not_shared = num_reqs - shared_kv
        window = w_keys is not None
        w_term = 0.0
        if w_keys is not None:  # (keys = w_keys: below every sum from here)
            x, y = w_flop * w_keys, w_byte * (w_keys + num_reqs)
            w_term = y if y > x else x
        with_moe = moe is not None
        moe_term = moe if moe is not None else 0.0
        async_scheduling = self.async_scheduling
        append = out.append
        for sum_kv in range(sum_kv, stop, num_reqs):
            x, y = ad_flop * sum_kv, ad_byte * (sum_kv + not_shared)  # (ints: exact in any order)
            attn_decode = y if y > x else x  # (max(x, y): x unless y is larger)
            if window:
                attn_decode += w_term
            forward = head + c_decode * attn_decode + shared_term + tail
            if with_moe:
                forward += moe_term
            if async_scheduling:
                busy = forward + sample
                append(busy if busy > prepare else prepare)  # (max(prepare, busy))
            else:
                append(prepare + forward + sample)
        return out

    def _decode_parts_of(self, num_reqs: int) -> tuple:
        parts = self._decode_parts.get(num_reqs)
        if parts is None or parts[0] is not self.coefficients:
            parts = self._new_decode_parts(num_reqs)
        return parts

    def _decode_step(self, parts: tuple, num_reqs: int, sum_kv: int, shared_kv: int) -> float:
        """`decode_duration` from its batch size's `_decode_parts`."""
        prepare, sample = parts[1], parts[7]
        forward = self._decode_forward(parts, num_reqs, sum_kv, shared_kv)
        return max(prepare, forward + sample) if self.async_scheduling else prepare + forward + sample

    def _decode_forward(self, parts: tuple, num_reqs: int, sum_kv: int, shared_kv: int) -> float:
        """The forward seconds of a pure decode batch from its batch size's `_decode_parts`: `_parts`' sum, the
        decode attention terms `_terms`' expressions for a step without prefill rows."""
        _, _, head, c_decode, c_shared, tail, moe, _, ad_flop, ad_byte, w_flop, w_byte, w_keys = parts
        shared_dec = shared_kv if shared_kv < sum_kv else sum_kv  # (min: the same value)
        attn_decode = max(ad_flop * sum_kv, ad_byte * (sum_kv - shared_dec + num_reqs))
        if w_keys is not None:  # (_window_attention's decode part, no prefill rows)
            keys = min(sum_kv, w_keys)
            attn_decode += max(w_flop * keys, w_byte * (keys + num_reqs))
        forward = head + c_decode * attn_decode + c_shared * (ad_byte * shared_dec) + tail
        if moe is not None:
            forward += moe
        return forward

    def _new_decode_parts(self, num_reqs: int) -> tuple:
        """`decode_duration`'s per-batch-size values: `_parts`' sums up to the decode attention terms (its
        left-to-right order: `head` is the forward sum before them, `tail` the term after), the factors of
        the two terms that vary, the MoE addend (None without MoE layers), and the attention constants;
        first the coefficients they were computed with (a new `coefficients` object recomputes them)."""
        c = self.coefficients
        st = StepSummary(num_reqs, num_reqs, num_reqs, decode_reqs=num_reqs, decode_sum_kv=num_reqs)
        (step_, req, token, layer, piecewise, linear, elementwise, attn_prefill, _, _, lm_head, sampler, comm,
         tp_step, ipc_step, ipc_req, moe, moe_layer) = self._terms(st)[0]
        prepare = (c.c_step * step_ + c.c_req * req + c.c_token * token + c.c_tp_step * tp_step
                   + c.c_ipc_step * ipc_step + c.c_ipc_req * ipc_req)
        head = (c.c_layer * layer + c.c_layer_piecewise * piecewise + c.c_linear * linear
                + c.c_elementwise * elementwise + c.c_attn_prefill * attn_prefill)
        moe_part = c.c_moe * moe + c.c_moe_layer * moe_layer if moe_layer else None
        sample = c.c_lm_head * lm_head + c.c_sampler * sampler
        w_flop = w_byte = w_keys = None
        if self._window_const:
            w_flop, w_byte = self._window_const[2], self._window_const[3]
            w_keys = self.attention_window * num_reqs
        parts = (c, prepare, head, c.c_attn_decode, c.c_attn_shared, c.c_comm * comm, moe_part, sample,
                 self._const_terms[9], self._const_terms[10], w_flop, w_byte, w_keys)
        self._decode_parts[num_reqs] = parts
        return parts

    def _parts(self, terms: Sequence[float]) -> tuple[float, float, float]:
        """(prepare, forward, sample) seconds of a step's basis values."""
        (step_, req, token, layer, piecewise, linear, elementwise, attn_prefill, attn_decode, attn_shared,
         lm_head, sampler, comm, tp_step, ipc_step, ipc_req, moe, moe_layer) = terms
        c = self.coefficients
        prepare = (c.c_step * step_ + c.c_req * req + c.c_token * token + c.c_tp_step * tp_step
                   + c.c_ipc_step * ipc_step + c.c_ipc_req * ipc_req)
        forward = (c.c_layer * layer + c.c_layer_piecewise * piecewise + c.c_linear * linear
                   + c.c_elementwise * elementwise + c.c_attn_prefill * attn_prefill
                   + c.c_attn_decode * attn_decode + c.c_attn_shared * attn_shared + c.c_comm * comm)
        if moe_layer:
            forward += c.c_moe * moe + c.c_moe_layer * moe_layer
        sample = c.c_lm_head * lm_head + c.c_sampler * sampler
        return prepare, forward, sample

    def _duration(self, prepare: float, forward: float, sample: float) -> float:
        # async scheduling: the engine prepares step n+1 while the GPU runs step n
        return max(prepare, forward + sample) if self.async_scheduling else prepare + forward + sample

    def predict(self, step: StepSummary | Iterable[Any]) -> StepTiming:
        st = step if type(step) is StepSummary else self.summarize(step)
        n = st.num_reqs
        if (n and st.decode_reqs == n and st.num_tokens == n and st.num_sampling == n and not st.prefill_reqs
                and not st.prefill_sum_q and not st.prefill_sum_kv):
            # (speed: a pure decode batch - most normal steps of a cluster run: the rows after an admission, a
            # last token - is priced from its batch size's cached parts, `decode_duration`'s, with the same
            # floats as `predict_by_terms`: tests/sim/test_sim_cost_model.py)
            parts = self._decode_parts_of(n)
            prepare, sample = parts[1], parts[7]
            forward = self._decode_forward(parts, n, st.decode_sum_kv, st.shared_kv)
            padded = self._decode_padded.get(n)
            if padded is None:
                padded = self._decode_padded[n] = self.padded_tokens(st)[0]
            return StepTiming(self._duration(prepare, forward, sample), prepare, forward, sample, padded)
        return self.predict_by_terms(st)

    def predict_by_terms(self, st: StepSummary) -> StepTiming:
        """`predict` from every basis term of the step (`_terms`, `_parts`): the general path, and the reference
        of its decode fast path."""
        terms, padded = self._terms(st)
        prepare, forward, sample = self._parts(terms)
        return StepTiming(duration_s=self._duration(prepare, forward, sample), prepare_s=prepare,
                          forward_s=forward, sample_s=sample, padded_batch_size=padded)

    def predict_from_scheduler_output(self, so: SchedulerOutput,
                                      rows: Optional[Iterable[Any]] = None) -> StepTiming:
        """Predict from a `SchedulerOutput` and its runner rows (`RunnerState.update(so)`).

        Without `rows`, `s` comes from `so.num_computed_before` and every request is assumed to
        sample (the LM head then runs on one row per request, as vLLM's runner computes it).
        """
        if rows is None:
            missing = [rid for rid in so.num_scheduled_tokens if rid not in so.num_computed_before]
            if missing:
                raise ValueError(f"scheduler_output.num_computed_before: no entry for {missing[0]!r}; "
                                 "pass the runner rows instead")
            rows = [RowShape(q, so.num_computed_before[rid], True)
                    for rid, q in so.num_scheduled_tokens.items()]
        return self.predict(dataclasses.replace(StepSummary.from_rows(rows), shared_kv=so.shared_kv_tokens))
