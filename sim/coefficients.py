"""`CostCoefficients`: the non-negative weights of the cost model's basis terms (data, not code).

The predicted step time is `sum(c_k * basis_k for k in BASIS_TERMS)`; `basis_k` is computed by
`servetwin.sim.cost_model.CostModel.basis` and the coefficient of term `k` is the field `c_<k>`.

| term           | basis value (per step)                             | coefficient unit           |
|----------------|----------------------------------------------------|----------------------------|
| `step`         | 1                                                  | s per step                 |
| `req`          | scheduled requests                                 | s per request              |
| `token`        | scheduled tokens (host-side input preparation)     | s per token                |
| `layer`        | L when the step runs eagerly, 0 under a CUDA graph | s per layer (launches)     |
| `linear`       | roofline seconds of the dense layers               | 1 / efficiency             |
| `attn_prefill` | roofline seconds of attention for q > 1 rows       | 1 / efficiency             |
| `attn_decode`  | roofline seconds of attention for q = 1 rows       | 1 / efficiency             |
| `attn_shared`  | bandwidth seconds of KV reads of shared blocks     | 1 / efficiency             |
| `lm_head`      | roofline seconds of the LM head + logits           | 1 / efficiency             |
| `comm`         | tensor-parallel collective seconds                 | 1 / efficiency             |
| `ipc_step`     | 1 with a multi-process front end, else 0           | s per step                 |
| `ipc_req`      | scheduled requests with a multi-process front end  | s per request              |
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional

from servetwin.core.config_error import ConfigError
from servetwin.sim.validate import check_keys, check_mapping, non_negative

BASIS_TERMS: tuple[str, ...] = ("step", "req", "token", "layer", "linear", "attn_prefill",
                                "attn_decode", "attn_shared", "lm_head", "comm", "ipc_step", "ipc_req")


@dataclass(slots=True)
class CostCoefficients:
    c_step: float = 0.0
    c_req: float = 0.0
    c_token: float = 0.0
    c_layer: float = 0.0
    c_linear: float = 1.0
    c_attn_prefill: float = 1.0
    c_attn_decode: float = 1.0
    c_attn_shared: Optional[float] = None  # None: the same as c_attn_decode
    c_lm_head: float = 1.0
    c_comm: float = 1.0
    c_ipc_step: float = 0.0
    c_ipc_req: float = 0.0

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

