"""`DecoderConfig`: the numbers our decoder modules need, read from an HF `PretrainedConfig`.

Per-layer attention (full / sliding window / chunked local, attention sinks) and the mixture-of-experts
fields are read by `ModelSpec.from_hf_config` (core) from the same config, so the torch backend and the
simulator see one parse of them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from servetwin.core.model_spec import (CHUNKED_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION,
                                       SUPPORTED_MODEL_TYPES, ModelSpec)

GPT_OSS_SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid gain (HF `swiglu_alpha`)


@dataclass(slots=True)
class RopeConfig:
    rope_type: str = "default"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ... as in HF


@dataclass(slots=True, frozen=True)
class AttentionWindow:
    """Which earlier keys one layer's queries see, besides causality (vLLM's attention spec types):
    full attention (both None), a sliding window of the last `sliding_window` positions (the query's
    own included, HF's `kv > q - W`), or chunked local attention within the `chunk_size`-token chunk
    that holds the query (HF's `kv // C == q // C`)."""
    sliding_window: Optional[int] = None
    chunk_size: Optional[int] = None

    @property
    def is_full(self) -> bool:
        return self.sliding_window is None and self.chunk_size is None

    def first_key(self, pos: np.ndarray) -> np.ndarray:
        """The lowest key position a query at each of `pos` sees."""
        if self.sliding_window is not None:
            return np.maximum(pos - self.sliding_window + 1, 0)
        if self.chunk_size is not None:
            return pos // self.chunk_size * self.chunk_size
        return np.zeros_like(pos)


FULL_WINDOW = AttentionWindow()


@dataclass(slots=True)
class MoEConfig:
    """A routed-expert MLP: softmax router over `num_experts` (+ bias), top-k, optional renormalisation
    of the k weights, SwiGLU experts (gpt-oss: biases and its clamped variant)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: Optional[float] = None  # gpt-oss: clamp, sigmoid gain `swiglu_alpha`, (up + 1)
    swiglu_alpha: float = GPT_OSS_SWIGLU_ALPHA


@dataclass(slots=True)
class DecoderConfig:
    """A Llama-like decoder: RMSNorm, RoPE, GQA, SwiGLU; Qwen2 adds qkv bias, Qwen3 q/k norm; Mistral
    and gpt-oss sliding-window layers; Mixtral, Qwen3-MoE and gpt-oss routed experts."""
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
    layer_windows: tuple[AttentionWindow, ...] = ()  # one per layer; () = all full attention
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax
    moe: Optional[MoEConfig] = None
    dense_layers: tuple[int, ...] = ()  # MoE models: layers that keep a dense MLP (intermediate_size)

    def window(self, layer: int) -> AttentionWindow:
        return self.layer_windows[layer] if self.layer_windows else FULL_WINDOW

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.dense_layers

    @property
    def all_full_attention(self) -> bool:
        return all(w.is_full for w in self.layer_windows)

    # -- the layer description the KV cache planner reads (`core.kv_cache.kv_cache_planning.model_kv_plan`)
    @property
    def layer_types(self) -> Optional[tuple[str, ...]]:
        if not self.layer_windows:
            return None
        return tuple(FULL_ATTENTION if w.is_full else SLIDING_ATTENTION if w.sliding_window is not None
                     else CHUNKED_ATTENTION for w in self.layer_windows)

    @property
    def sliding_window(self) -> Optional[int]:
        return next((w.sliding_window for w in self.layer_windows if w.sliding_window is not None), None)

    @property
    def attention_chunk_size(self) -> Optional[int]:
        return next((w.chunk_size for w in self.layer_windows if w.chunk_size is not None), None)

    @classmethod
    def from_hf(cls, hf: Any) -> "DecoderConfig":
        model_type = getattr(hf, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not supported by the torch backend "
                             f"(allowed: {', '.join(SUPPORTED_MODEL_TYPES)})")
        hidden_act = getattr(hf, "hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"hidden_act: {hidden_act!r} is not supported (only silu)")
        spec = ModelSpec.from_hf_config(hf.to_dict(), name=model_type)
        if spec.shared_expert_intermediate_size:
            raise NotImplementedError(f"{model_type}: shared experts are not supported by the torch backend")
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
            qk_norm=spec.qk_norm,
            hidden_act=hidden_act,
            layer_windows=layer_windows(spec),
            attention_sinks=spec.attention_sinks,
            moe=moe_config(spec, hf),
            dense_layers=tuple(spec.dense_layers),
        )


def layer_windows(spec: ModelSpec) -> tuple[AttentionWindow, ...]:
    """Each layer's `AttentionWindow` from the spec's `layer_types` (() when every layer is full)."""
    if spec.layer_types is None or all(t == FULL_ATTENTION for t in spec.layer_types):
        return ()
    by_type = {FULL_ATTENTION: FULL_WINDOW, SLIDING_ATTENTION: AttentionWindow(sliding_window=spec.sliding_window),
               CHUNKED_ATTENTION: AttentionWindow(chunk_size=spec.attention_chunk_size)}
    return tuple(by_type[t] for t in spec.layer_types)


def moe_config(spec: ModelSpec, hf: Any) -> Optional[MoEConfig]:
    if not spec.is_moe:
        return None
    return MoEConfig(num_experts=spec.num_experts, top_k=spec.num_experts_per_tok,
                     intermediate_size=spec.moe_intermediate_size, renormalize=spec.router_renormalize,
                     router_bias=spec.router_bias, expert_bias=spec.expert_bias, swiglu_limit=spec.swiglu_limit,
                     swiglu_alpha=float(getattr(hf, "swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)))


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
