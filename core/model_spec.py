"""`ModelSpec`: the shape of a dense decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral family).

Built from a Hugging Face `config.json` (or a model directory holding one); the simulator adds
presets (`servetwin.sim.model_spec`), the torch backend reads it off the model it loads. The parameter count is computed from the shape, never stored:

    embed  = V*d                                   (token embedding)
    layer  = d*(H*dh) + 2*d*(Hkv*dh) + (H*dh)*d     (q, k, v, o projections)
           + 3*d*dff                                (SwiGLU MLP: gate, up, down)
           + [H*dh + 2*Hkv*dh if qkv_bias] + [2*dh if qk_norm] + 2*d (two RMSNorms)
    total  = embed + L*layer + d (final norm) + [V*d if the LM head is not tied]
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_sizing import KVCacheSpec, dtype_bytes
from servetwin.core.limits import load_json_file

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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

    # -- parameter counts ------------------------------------------------------------------------
    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrix multiplies (q, k, v, o, gate, up, down)."""
        d = self.hidden_size
        return d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d + 3 * d * self.intermediate_size

    @property
    def layer_params(self) -> int:
        extra = 2 * self.hidden_size
        if self.qkv_bias:
            extra += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            extra += 2 * self.head_dim
        return self.layer_matmul_params + extra

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
        return (self.embedding_params + self.num_layers * self.layer_params + self.hidden_size
                + untied_head)

    @property
    def weight_bytes(self) -> int:
        return self.num_parameters * self.dtype_bytes

    # -- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_token(self, bytes_per_element: int | None = None) -> int:
        """K and V of every layer for one token."""
        b = self.dtype_bytes if bytes_per_element is None else bytes_per_element
        return 2 * self.num_layers * self.kv_dim * b

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_parameters"] = self.num_parameters
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
            raise ValueError(f"model.model_type: {model_type!r} is not a supported dense decoder "
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
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        )
