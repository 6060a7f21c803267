"""The cost model's data: `Efficiency` (physical efficiencies per kernel class) and `CostCoefficients`
(the non-negative weights of the basis terms). Data, not code: presets and hardware YAML files carry
both, with a provenance record per value (`HardwareSpec.provenance["coefficients"]`).

`Efficiency` says how close each kernel class gets to the datasheet: a compute fraction of the dense
peak, a bandwidth fraction of the datasheet memory bandwidth, and - where the physics says the shape
matters - a half-saturation size (the shape at which the kernel reaches half its compute fraction).
All fields at their defaults (1.0 and 0) give the ideal datasheet roofline, which is what every
hardware file written before efficiencies existed gets (its `CostCoefficients` were fitted on that).

| field                     | kernel class              | meaning                                              |
|---------------------------|---------------------------|------------------------------------------------------|
| `gemm_compute`            | dense GEMMs, LM head      | fraction of dense peak a large GEMM reaches (MAMF)    |
| `gemm_half_m`             | dense GEMMs, LM head      | token count M at which a GEMM reaches half of it     |
| `gemm_bandwidth`          | weight streaming, elementwise | fraction of datasheet bandwidth                  |
| `gemm_fp8_relative`       | fp8 (W8A8) GEMMs          | their fraction of the fp8 peak / `gemm_compute`     |
| `attn_prefill_compute`    | prefill attention         | fraction of peak at long keys-per-query              |
| `attn_prefill_half_kv`    | prefill attention         | keys per query at which it reaches half of it        |
| `attn_prefill_bandwidth`  | prefill attention KV I/O  | fraction of datasheet bandwidth                      |
| `attn_decode_compute`     | decode attention          | fraction of peak                                     |
| `attn_decode_bandwidth`   | decode attention KV reads | fraction of datasheet bandwidth (paged, per-request) |
| `attn_mixed_decode_rows`  | decode rows beside a chunk | query rows each pays per query head (0: none)       |
| `comm_bandwidth`          | TP all-reduce/all-gather  | NCCL bus bandwidth / link bandwidth                  |
| `gemm_m_curve`            | dense GEMMs of the layers | measured [M, fraction of peak] points (optional)     |
| `moe_kernels`             | MoE grouped GEMMs         | per expert storage format: the kernel vLLM runs there |

`moe_kernels` maps an expert storage format (`bf16`, `fp8`, `mxfp4`, `nvfp4`) to the `MoEKernel` vLLM runs
for it on this GPU: its name (the kernel family, e.g. Marlin W4A16 for MXFP4 on Hopper), the tensor-core
rate it computes at (`peak`: `bf16` for weight-only kernels that dequantise to bf16, `fp8` for MXFP4 x
MXFP8 or block-scaled fp8, `fp4` for NVFP4 x NVFP4), its compute fraction of that peak, its
half-saturation rows per expert (each touched expert's rows are padded to the kernel's M tile, so it
runs as if it had `half_rows` more), its bandwidth fraction when streaming expert weights, and the
alignments its weight layout pads to (`align_hidden` for the hidden size, `align_intermediate` for each
TP rank's share of the expert width: vLLM's `mxfp4_round_up_hidden_size_and_intermediate_size`, e.g.
Marlin 256 / 128, FlashInfer TRT-LLM 256 / 256); the padded weights are read and multiplied. A format
without an entry cannot be priced on that GPU: the cost model refuses it naming the field.

`gemm_m_curve`, when given, replaces `gemm_compute * M / (M + gemm_half_m)` for the layers' GEMMs: the
fraction of the dense peak they reach at M tokens, interpolated linearly between the points (the first
and last point's value outside them). It is what `servetwin calibrate` measures on a CPU, where a BLAS
library's GEMM time is not a smooth function of M (on the 2-vCPU AMD EPYC test machine, one thread,
fp32: SmolLM2's 30 layers take 22 ms at M = 1, 125 ms at M = 8, 101 ms at M = 10, 142 ms at M = 16 -
kernels switch with M); a half-saturation size cannot describe that, a measured curve can. The LM head
keeps the smooth form (its N is the vocabulary, another shape).

`attn_mixed_decode_rows`: a step that carries a prefill chunk runs all its rows through one varlen
attention call. FlashAttention-2's paged varlen kernel (vLLM's fork, csrc/flash_attn/flash_api.cpp and
flash_fwd_launch_template.h: paged KV forces the split-KV kernel, kBlockM = 64) then gives each decode
row a whole 64-row query tile per query head; only a decode-only call (max_seqlen_q == 1) packs a KV
head's query heads into the tile (`seqlenq_ngroups_swapped`). So beside a chunk a decode row costs
64 * Hq query rows of attention compute, not one, and on an A100 that is compute-bound. FlashAttention-3
(Hopper) packs GQA heads for paged KV in every call (`get_pack_gqa`), so the H100/H200 sets keep 0.

`CostCoefficients`: the predicted step time is `sum(c_k * basis_k for k in BASIS_TERMS)`; `basis_k` is
computed by `servetwin.sim.cost_model.CostModel.basis` and the coefficient of term `k` is the field
`c_<k>`. Roofline terms are seconds already (efficiencies applied), so their coefficient is a
dimensionless correction (1.0 = the physics as stated); the rest are seconds per unit.

| term              | basis value (per step)                                  | coefficient unit        |
|-------------------|---------------------------------------------------------|-------------------------|
| `step`            | 1                                                       | s per step (engine CPU) |
| `req`             | scheduled requests                                      | s per request           |
| `token`           | scheduled tokens (host-side input preparation)          | s per token             |
| `layer`           | L when CUDA graphs are off (eager launches), else 0     | s per layer             |
| `layer_piecewise` | L for a step outside a full CUDA graph while graphs are on | s per layer          |
| `linear`          | roofline seconds of the dense GEMMs                     | correction              |
| `elementwise`     | bandwidth seconds of norms, rope, activation, residuals | correction              |
| `attn_prefill`    | roofline seconds of attention for q > 1 rows            | correction              |
| `attn_decode`     | roofline seconds of attention for q = 1 rows            | correction              |
| `attn_shared`     | bandwidth seconds of KV reads of shared blocks          | correction              |
| `lm_head`         | roofline seconds of the LM head + logits                | correction              |
| `sampler`         | bandwidth seconds of the sampler's passes over logits   | correction              |
| `comm`            | tensor-parallel collective seconds                      | correction              |
| `moe`             | roofline seconds of the router and the expert GEMMs     | correction              |
| `moe_layer`       | MoE layers (router, top-k, align, 2 grouped GEMMs, combine kernels' floor) | s per layer |
| `tp_step`         | 1 when tp > 1 (driver -> worker broadcast, sync)        | s per step              |
| `ipc_step`        | 1 with a multi-process front end, else 0                | s per step              |
| `ipc_req`         | scheduled requests with a multi-process front end       | s per request           |

Terms added after the first calibrations (`layer_piecewise`, `elementwise`, `sampler`, `tp_step`, `moe_layer`)
default to 0 so that older files predict what they always did.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Optional

from servetwin.core.config_error import ConfigError
from servetwin.sim.validate import check_keys, check_mapping, int_at_least, non_negative, positive

BASIS_TERMS: tuple[str, ...] = ("step", "req", "token", "layer", "layer_piecewise", "linear", "elementwise",
                                "attn_prefill", "attn_decode", "attn_shared", "lm_head", "sampler", "comm",
                                "tp_step", "ipc_step", "ipc_req", "moe", "moe_layer")
# terms only a GPU step has (a CPU calibration leaves them out of its fit)
GPU_ONLY_TERMS: tuple[str, ...] = ("layer_piecewise", "elementwise", "sampler", "tp_step", "moe_layer")
MOE_PEAKS = ("bf16", "fp8", "fp4")  # the tensor-core rate an expert kernel computes at


@dataclass(slots=True, frozen=True)
class MoEKernel:
    """The grouped-GEMM kernel vLLM runs for one expert storage format on one GPU (see the table)."""
    kernel: str  # the kernel family, e.g. "marlin_w4a16", "triton_fused_moe", "flashinfer_trtllm_mxfp4_mxfp8"
    peak: str  # "bf16" | "fp8" | "fp4"
    compute: float  # fraction of that peak a well-filled grouped GEMM reaches
    half_rows: float  # rows per expert at which it reaches half of it (the M tile's padding)
    bandwidth: float  # fraction of the datasheet bandwidth streaming the touched experts' weights
    align_hidden: int = 1  # the kernel's weights pad the hidden size to a multiple of this
    align_intermediate: int = 1  # ... and each TP rank's share of the expert width to a multiple of this

    @classmethod
    def from_dict(cls, cfg: Any, path: str) -> "MoEKernel":
        if isinstance(cfg, MoEKernel):
            return cfg
        cfg = check_mapping(cfg, path)
        names = [f.name for f in fields(cls)]
        check_keys(cfg, names, path, required=names[:5])
        if not isinstance(cfg["kernel"], str) or not cfg["kernel"]:
            raise ConfigError(f"{path}.kernel", f"must be a non-empty string, got {cfg['kernel']!r}")
        if cfg["peak"] not in MOE_PEAKS:
            raise ConfigError(f"{path}.peak", f"must be one of {', '.join(MOE_PEAKS)}, got {cfg['peak']!r}")
        return cls(cfg["kernel"], cfg["peak"], _fraction(cfg["compute"], f"{path}.compute"),
                   non_negative(cfg["half_rows"], f"{path}.half_rows"),
                   _fraction(cfg["bandwidth"], f"{path}.bandwidth"),
                   int_at_least(cfg.get("align_hidden", 1), 1, f"{path}.align_hidden"),
                   int_at_least(cfg.get("align_intermediate", 1), 1, f"{path}.align_intermediate"))


@dataclass(slots=True)
class Efficiency:
    gemm_compute: float = 1.0
    gemm_half_m: float = 0.0
    gemm_bandwidth: float = 1.0
    gemm_fp8_relative: float = 1.0
    attn_prefill_compute: float = 1.0
    attn_prefill_half_kv: float = 0.0
    attn_prefill_bandwidth: float = 1.0
    attn_decode_compute: float = 1.0
    attn_decode_bandwidth: float = 1.0
    attn_mixed_decode_rows: float = 0.0
    comm_bandwidth: float = 1.0
    gemm_m_curve: tuple[tuple[float, float], ...] = ()  # (M, fraction of peak), M ascending
    moe_kernels: Mapping[str, MoEKernel] = field(default_factory=dict)  # expert storage format -> kernel

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "moe_kernels":
                self.moe_kernels = {str(k): MoEKernel.from_dict(c, f"efficiency.moe_kernels.{k}")
                                    for k, c in check_mapping(v, "efficiency.moe_kernels").items()}
            elif f.name == "gemm_m_curve":
                self.gemm_m_curve = _m_curve(v, f"efficiency.{f.name}")
            elif f.name.endswith(("_half_m", "_half_kv", "_rows")):
                setattr(self, f.name, non_negative(v, f"efficiency.{f.name}"))
            else:
                setattr(self, f.name, _fraction(v, f"efficiency.{f.name}"))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gemm_m_curve"] = [[m, e] for m, e in self.gemm_m_curve]  # lists: YAML has no tuples
        if not self.gemm_m_curve:
            del out["gemm_m_curve"]
        out["moe_kernels"] = {k: asdict(v) for k, v in self.moe_kernels.items()}
        if not self.moe_kernels:
            del out["moe_kernels"]
        return out

    @classmethod
    def from_dict(cls, cfg: Any, path: str = "efficiency", base: "Efficiency | None" = None) -> "Efficiency":
        cfg = check_mapping(cfg, path)
        check_keys(cfg, [f.name for f in fields(cls)], path)
        values = base.to_dict() if base is not None else cls().to_dict()
        values.update(cfg)
        try:
            return cls(**values)
        except ConfigError as e:  # __post_init__ names the field under "efficiency"
            raise ConfigError(path + e.path.removeprefix("efficiency"), e.message) from None


def _fraction(value: Any, path: str) -> float:
    x = positive(value, path)
    if x > 1.0:
        raise ConfigError(path, f"a fraction of the datasheet, must be <= 1, got {value!r}")
    return x


def _m_curve(value: Any, path: str) -> tuple[tuple[float, float], ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(path, f"must be a list of [M, fraction] pairs, got {value!r}")
    points = []
    for i, point in enumerate(value):
        if isinstance(point, (str, bytes)) or not hasattr(point, "__len__") or len(point) != 2:
            raise ConfigError(f"{path}[{i}]", f"must be a pair [M, fraction], got {point!r}")
        m = positive(point[0], f"{path}[{i}][0]")
        e = _fraction(point[1], f"{path}[{i}][1]")
        if points and m <= points[-1][0]:
            raise ConfigError(f"{path}[{i}][0]", f"M must increase along the curve, got {point[0]!r} after "
                                                 f"{points[-1][0]!r}")
        points.append((float(m), float(e)))
    return tuple(points)


@dataclass(slots=True)
class CostCoefficients:
    c_step: float = 0.0
    c_req: float = 0.0
    c_token: float = 0.0
    c_layer: float = 0.0
    c_layer_piecewise: float = 0.0
    c_linear: float = 1.0
    c_elementwise: float = 0.0
    c_attn_prefill: float = 1.0
    c_attn_decode: float = 1.0
    c_attn_shared: Optional[float] = None  # None: the same as c_attn_decode
    c_lm_head: float = 1.0
    c_sampler: float = 0.0
    c_comm: float = 1.0
    c_tp_step: float = 0.0
    c_ipc_step: float = 0.0
    c_ipc_req: float = 0.0
    c_moe: float = 1.0
    c_moe_layer: float = 0.0

    def __post_init__(self) -> None:
        if self.c_attn_shared is None:
            self.c_attn_shared = self.c_attn_decode
        for f in fields(self):
            setattr(self, f.name, non_negative(getattr(self, f.name), f"coefficients.{f.name}"))

    def for_term(self, term: str) -> float:
        return getattr(self, f"c_{term}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_terms(cls, values: Mapping[str, float]) -> "CostCoefficients":
        """From `{term: coefficient}` (the output of a fit); terms not given are 0."""
        unknown = set(values) - set(BASIS_TERMS)
        if unknown:
            raise ConfigError(f"coefficients.{sorted(unknown)[0]}", "unknown basis term "
                             f"(allowed: {', '.join(BASIS_TERMS)})")
        return cls(**{f"c_{t}": float(values.get(t, 0.0)) for t in BASIS_TERMS})

    @classmethod
    def from_dict(cls, cfg: Any, path: str = "coefficients",
                  base: "CostCoefficients | None" = None) -> "CostCoefficients":
        """From `{c_step: ..., ...}`; fields not given keep `base`'s value (or the defaults)."""
        cfg = check_mapping(cfg, path)
        names = [f.name for f in fields(cls)]
        check_keys(cfg, names, path)
        values = base.to_dict() if base is not None else cls().to_dict()
        for key, value in cfg.items():
            values[key] = non_negative(value, f"{path}.{key}")
        if "c_attn_decode" in cfg and "c_attn_shared" not in cfg:
            # written before shared reads had a term of their own: they cost what any KV read costs
            values["c_attn_shared"] = values["c_attn_decode"]
        return cls(**values)
