"""`DecoderConfig`: the numbers our decoder modules need, read from an HF `PretrainedConfig`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(slots=True)
class RopeConfig:
    rope_type: str = "default"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ... as in HF


@dataclass(slots=True)
class DecoderConfig:
    """A Llama-like decoder: RMSNorm, RoPE, GQA, SwiGLU; Qwen2 adds qkv bias, Qwen3 q/k norm."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_hf(cls, hf: Any) -> "DecoderConfig":
        model_type = getattr(hf, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not supported by the torch backend "
                             f"(allowed: {', '.join(SUPPORTED_MODEL_TYPES)})")
        layer_types = getattr(hf, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(hf, "use_sliding_window", False):
            raise NotImplementedError(f"{model_type}: sliding-window attention layers are not supported")
        hidden_act = getattr(hf, "hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act: {hidden_act!r} is not supported (only silu)")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        if model_type == "qwen2":  # Qwen2: q/k/v carry a bias, o_proj never does
            qkv_bias, o_bias = True, False
        else:
            qkv_bias, o_bias = attention_bias, attention_bias
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
            rope=rope_config_from_hf(hf),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=hidden_act,
        )


def rope_config_from_hf(hf: Any) -> RopeConfig:
    """transformers 5 keeps rope params in `config.rope_parameters`; 4.x in `rope_theta`/`rope_scaling`."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_theta" not in params and hasattr(hf, "rope_theta"):
        params["rope_theta"] = hf.rope_theta
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    theta = float(params.pop("rope_theta", 10000.0))
    prf = float(params.pop("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0)
    return RopeConfig(rope_type=rope_type, rope_theta=theta, partial_rotary_factor=prf, params=params)
