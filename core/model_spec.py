"""`ModelSpec`: the shape of a decoder-only transformer, dense or mixture-of-experts.

Families: Llama / Qwen2 / Qwen3 / Mistral (dense, Mistral optionally with a sliding window), Mixtral,
Qwen3-MoE and gpt-oss (MoE; gpt-oss alternates 128-token sliding-window and full-attention layers,
has attention sinks, biases, a clamped SwiGLU and MXFP4 experts). Built from a Hugging Face
`config.json` (or a model directory holding one); the simulator adds presets
(`servetwin.sim.model_spec`), the torch backend reads it off the model it loads. Parameter counts are
computed from the shape, never stored:

    embed  = V*d                                   (token embedding)
    attn   = d*(H*dh) + 2*d*(Hkv*dh) + (H*dh)*d     (q, k, v, o projections)
           + [H*dh + 2*Hkv*dh if qkv_bias] + [d if o_bias] + [2*dh if qk_norm] + [H if sinks]
    mlp    = 3*d*dff                                (SwiGLU: gate, up, down; + 2*dff + d if mlp_bias)
    moe    = d*E [+ E if router_bias]               (router)
           + E * (3*d*dff_e [+ 2*dff_e + d if expert_bias]) + shared expert (3*d*dff_s)
    layer  = attn + (mlp or moe) + 2*d (two RMSNorms)
    total  = embed + sum(layer) + d (final norm) + [V*d if the LM head is not tied]

Active parameters (what one token multiplies by) replace E experts by the top-k and leave out the
embedding table (a lookup, not a matmul); `num_active_parameters(include_embedding=True)` adds it
back, the convention Mistral and Qwen use for their published "active" figures (gpt-oss's leaves it out).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_sizing import KVCacheSpec, dtype_bytes
from servetwin.core.limits import load_json_file

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "gpt_oss")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES

# Attention type of a layer, with Hugging Face's `layer_types` names.
FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION = ("full_attention", "sliding_attention",
                                                        "chunked_attention")
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION)

# Storage bits per weight, scales included: MXFP4 = 4-bit E2M1 + one E8M0 scale per 32 (OCP MX spec),
# NVFP4 = 4-bit E2M1 + one FP8 E4M3 scale per 16 (NVIDIA's format; the per-tensor FP32 scale is
# negligible). Plain dtypes take their byte width.
QUANT_WEIGHT_BITS = {"mxfp4": 4.25, "nvfp4": 4.5}


def weight_bits(dtype: str) -> float:
    """Bits one stored weight takes, scales included (`ConfigError` on an unknown format)."""
    return QUANT_WEIGHT_BITS.get(str(dtype)) or 8.0 * dtype_bytes(dtype)


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str = "bfloat16"
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    # -- attention by layer ------------------------------------------------------------------------
    layer_types: tuple[str, ...] | None = None  # one of LAYER_TYPES per layer; None: all full
    sliding_window: int | None = None  # W: a sliding layer attends to the last W positions
    attention_chunk_size: int | None = None  # C: a chunked layer attends within its C-token chunk
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax
    o_bias: bool = False  # a bias on the output projection (gpt-oss's attention_bias covers q/k/v/o)
    # -- mixture of experts (num_experts == 0: dense) -------------------------------------------------
    num_experts: int = 0  # E routed experts per MoE layer
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP (intermediate_size)
    router_renormalize: bool = True  # top-k weights renormalised to sum 1 (softmax over the selected)
    router_bias: bool = False
    expert_bias: bool = False
    mlp_bias: bool = False
    swiglu_limit: float | None = None  # gpt-oss: gate clamped above, up clamped to +-limit, (up + 1)
    expert_dtype: str | None = None  # storage of the expert weights ("mxfp4", "nvfp4", "fp8"); None: dtype

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{f}: must be an integer >= 1, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads: {self.num_kv_heads} must divide num_heads "
                             f"{self.num_heads}")
        dtype_bytes(self.dtype)  # raises on an unknown dtype
        self._check_attention()
        self._check_moe()

    def _check_attention(self) -> None:
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_layers:
            raise ConfigError("model.layer_types", f"has {len(self.layer_types)} entries for "
                              f"{self.num_layers} layers")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ConfigError(f"model.layer_types[{i}]", f"unknown attention type {t!r} "
                                  f"(allowed: {', '.join(LAYER_TYPES)})")
        for kind, field_, least in ((SLIDING_ATTENTION, "sliding_window", 2),
                                    (CHUNKED_ATTENTION, "attention_chunk_size", 1)):
            v = getattr(self, field_)
            if kind in self.layer_types and (isinstance(v, bool) or not isinstance(v, int) or v < least):
                raise ConfigError(f"model.{field_}", f"layers of type {kind!r} need an integer "
                                  f">= {least}, got {v!r}")

    def _check_moe(self) -> None:
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("model.num_experts_per_tok", f"must be in [1, num_experts="
                              f"{self.num_experts}], got {self.num_experts_per_tok!r}")
        if self.moe_intermediate_size < 1:
            raise ConfigError("model.moe_intermediate_size", "an MoE model needs an expert width >= 1")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError("model.dense_layers", f"layer indices {bad} are outside "
                              f"[0, {self.num_layers})")
        if self.expert_dtype is not None:
            weight_bits(self.expert_dtype)

    # -- shapes --------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    # -- layer structure -----------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_types(self) -> tuple[str, ...]:
        """The attention type of every layer (all full attention when `layer_types` is not given)."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is a mixture of experts."""
        if not self.is_moe:
            return ()
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    # -- parameter counts ------------------------------------------------------------------------
    @property
    def attention_matmul_params(self) -> int:
        """Weights of one layer's attention matmuls (q, k, v, o)."""
        return 2 * self.hidden_size * (self.q_dim + self.kv_dim)

    @property
    def dense_mlp_matmul_params(self) -> int:
        """Weights of one dense SwiGLU MLP (gate, up, down)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_matmul_params(self) -> int:
        """Weights of one routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def shared_expert_matmul_params(self) -> int:
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts + (self.num_experts if self.router_bias else 0)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one dense layer's matrix multiplies (q, k, v, o, gate, up, down).

        Undefined for an MoE model, whose layers differ in what a token multiplies by: a cost model
        must price its experts (`expert_matmul_params`, top-k of `num_experts`), never a dense MLP.
        """
        if self.is_moe:
            raise ConfigError("model", f"{self.name} is a mixture-of-experts model: its layers have no "
                              "single dense matmul size (price attention, router and experts apart)")
        return self.attention_matmul_params + self.dense_mlp_matmul_params

    @property
    def attention_params(self) -> int:
        """One layer's attention weights, biases, q/k norms and sinks included."""
        extra = 0
        if self.qkv_bias:
            extra += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            extra += self.hidden_size
        if self.qk_norm:
            extra += 2 * self.head_dim
        if self.attention_sinks:
            extra += self.num_heads
        return self.attention_matmul_params + extra

    @property
    def dense_mlp_params(self) -> int:
        bias = 2 * self.intermediate_size + self.hidden_size if self.mlp_bias else 0
        return self.dense_mlp_matmul_params + bias

    @property
    def expert_params(self) -> int:
        bias = 2 * self.moe_intermediate_size + self.hidden_size if self.expert_bias else 0
        return self.expert_matmul_params + bias

    def moe_block_params(self, experts: int) -> int:
        """An MoE MLP with `experts` routed experts counted (all of them, or the top-k)."""
        return self.router_params + experts * self.expert_params + self.shared_expert_matmul_params

    @property
    def layer_params(self) -> int:
        """A dense layer's parameters (for an MoE model: a layer with a dense MLP)."""
        return self.attention_params + self.dense_mlp_params + 2 * self.hidden_size

    def _layers_params(self, experts: int) -> int:
        n_moe = self.num_moe_layers
        dense = (self.num_layers - n_moe) * self.dense_mlp_params
        moe = n_moe * self.moe_block_params(experts)
        return self.num_layers * (self.attention_params + 2 * self.hidden_size) + dense + moe

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Weights the LM head multiplies by (shared with the embedding when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        untied_head = 0 if self.tie_word_embeddings else self.lm_head_params
        return (self.embedding_params + self._layers_params(self.num_experts) + self.hidden_size
                + untied_head)

    def num_active_parameters(self, include_embedding: bool = False) -> int:
        """Parameters one token multiplies by: top-k experts; the LM head; the embedding if asked."""
        embed = self.embedding_params if include_embedding else 0
        return (self._layers_params(self.num_experts_per_tok) + self.hidden_size
                + self.lm_head_params + embed)

    @property
    def num_expert_parameters(self) -> int:
        """Routed-expert weights of the whole model (the part stored as `expert_dtype`)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def weight_bytes(self) -> int:
        """Weights at their storage precision (experts at `expert_dtype`, the rest at `dtype`)."""
        experts = self.num_expert_parameters
        expert_bits = weight_bits(self.expert_dtype or self.dtype)
        return int((self.num_parameters - experts) * self.dtype_bytes + experts * expert_bits / 8)

    @property
    def unquantized_params(self) -> int:
        """Weights vLLM's fp8 quantisation leaves in the model dtype: its quantised linear methods cover the
        layers' projections and experts, not the embedding, an untied LM head, the MoE routers (replicated
        linears built without a quant config) or the norms."""
        untied_head = 0 if self.tie_word_embeddings else self.lm_head_params
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.embedding_params + untied_head + self.num_moe_layers * self.router_params + norms

    @property
    def fp8_weight_bytes(self) -> int:
        """Weights under vLLM's fp8 quantisation: 1 byte each, `unquantized_params` in the model dtype."""
        kept = self.unquantized_params
        return self.num_parameters - kept + kept * self.dtype_bytes

    # -- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_token(self, bytes_per_element: int | None = None) -> int:
        """K and V of every layer for one token (sliding-window and chunked layers included: a
        token inside their window costs as much; the hybrid pool frees what leaves it)."""
        b = self.dtype_bytes if bytes_per_element is None else bytes_per_element
        return 2 * self.num_layers * self.kv_dim * b

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_parameters"] = self.num_parameters
        if self.is_moe:
            d["num_active_parameters"] = self.num_active_parameters()
        return d

    def kv_spec(self, block_size: int = 16, dtype: str | None = None) -> KVCacheSpec:
        """The core `KVCacheSpec` (one uniform full-attention group; `dtype` defaults to the model's)."""
        return KVCacheSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                           head_size=self.head_dim, dtype=dtype or self.dtype,
                           block_size=block_size)

    def with_dtype(self, dtype: str) -> "ModelSpec":
        return replace(self, dtype=dtype)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path, name: str | None = None,
                       dtype: str | None = None) -> "ModelSpec":
        """From a `config.json` dict, a path to one, or a model directory holding one."""
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.exists():
                raise ValueError(f"model: no config.json at {path}")
            # size, UTF-8, nesting and syntax checked before parsing; errors name `model` and the file
            config = load_json_file(path, "model")
            if not isinstance(config, Mapping):
                raise ConfigError("model", f"{path} is not a model config (a JSON object with model_type, "
                                  "hidden_size, ...)")
            name = name or path.parent.name
        cfg = dict(config)
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            cfg = dict(cfg["text_config"])
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model.model_type: {model_type!r} is not a supported decoder "
                             f"(allowed: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                    "intermediate_size", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"model.{key}: required field is missing from config.json")
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                    "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = cfg.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise ConfigError(f"model.{key}", f"must be an integer >= 1 in config.json, got {shown}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        cfg_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        return cls(
            name=name or cfg.get("_name_or_path") or model_type,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(dtype or cfg_dtype).replace("torch.", ""),
            qkv_bias=bias,
            o_bias=bias and model_type == "gpt_oss",
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            **_hf_attention_fields(cfg, model_type),
            **_hf_moe_fields(cfg, model_type),
        )


def _hf_attention_fields(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """Per-layer attention types from a config.json: gpt-oss lists them in `layer_types`; Mistral and
    Mixtral slide every layer when `sliding_window` is set; Qwen's `use_sliding_window` (off in every
    released checkpoint) is refused rather than ignored."""
    num_layers = int(cfg["num_hidden_layers"])
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
        raise ConfigError("model.use_sliding_window", "Qwen's per-layer sliding window "
                          "(max_window_layers) is not supported; set it to false")
    window = cfg.get("sliding_window")
    if model_type == "gpt_oss":
        types = tuple(cfg.get("layer_types") or
                      [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)])
        return {"layer_types": types, "sliding_window": window, "attention_sinks": True}
    if model_type in ("mistral", "mixtral") and window:
        return {"layer_types": (SLIDING_ATTENTION,) * num_layers, "sliding_window": int(window)}
    return {}


def _hf_moe_fields(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """Experts, top-k, expert width, dense layers, router normalisation and expert storage."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
    if not experts or not top_k:
        raise ConfigError("model.num_local_experts", f"a {model_type} config needs num_local_experts "
                          "(or num_experts) and num_experts_per_tok")
    fields: dict[str, Any] = {"num_experts": int(experts), "num_experts_per_tok": int(top_k)}
    if model_type == "qwen3_moe":
        step = int(cfg.get("decoder_sparse_step") or 1)
        only_mlp = set(cfg.get("mlp_only_layers") or ())
        fields.update(moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                      router_renormalize=bool(cfg.get("norm_topk_prob", False)),
                      dense_layers=tuple(i for i in range(int(cfg["num_hidden_layers"]))
                                         if i in only_mlp or (i + 1) % step))
    else:  # Mixtral and gpt-oss: every layer MoE, experts as wide as intermediate_size
        fields["moe_intermediate_size"] = int(cfg["intermediate_size"])
    if model_type == "gpt_oss":
        quant = (cfg.get("quantization_config") or {}).get("quant_method")
        fields.update(router_bias=True, expert_bias=True,
                      swiglu_limit=float(cfg.get("swiglu_limit") or 7.0),
                      expert_dtype="mxfp4" if quant == "mxfp4" else None)
    return fields
