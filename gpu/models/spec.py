"""`ModelSpec`: the architecture numbers a cost model needs (the simulator can reuse them)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    max_position_embeddings: int
    model_type: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False

    @property
    def num_params(self) -> int:
        """Weights, counting a tied embedding once (norms and biases included)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * d if self.qk_norm else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_params"] = self.num_params
        return d


def spec_from_hf_config(hf: Any) -> ModelSpec:
    heads = hf.num_attention_heads
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32"
    return ModelSpec(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        intermediate_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        dtype=str(dtype).replace("torch.", ""),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
        model_type=getattr(hf, "model_type", "llama"),
        qkv_bias=getattr(hf, "model_type", "") == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=getattr(hf, "model_type", "") == "qwen3",
    )
