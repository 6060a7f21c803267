"""Simulator model presets: published architectures as `servetwin.core.model_spec.ModelSpec`s."""
from __future__ import annotations

from pathlib import Path

from servetwin.core.config_error import ConfigError
from servetwin.core.model_spec import SUPPORTED_MODEL_TYPES, ModelSpec

__all__ = ["ModelSpec", "SUPPORTED_MODEL_TYPES", "PRESETS", "ALIASES", "load_model_spec"]

# Architecture facts from the models' published config.json files.
PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", num_layers=32, hidden_size=4096, num_heads=32,
                              num_kv_heads=8, head_dim=128, intermediate_size=14336,
                              vocab_size=128256, tie_word_embeddings=False,
                              max_position_embeddings=131072),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", num_layers=80, hidden_size=8192, num_heads=64,
                               num_kv_heads=8, head_dim=128, intermediate_size=28672,
                               vocab_size=128256, tie_word_embeddings=False,
                               max_position_embeddings=131072),
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", num_layers=28, hidden_size=1024, num_heads=16,
                            num_kv_heads=8, head_dim=128, intermediate_size=3072,
                            vocab_size=151936, tie_word_embeddings=True, qk_norm=True,
                            max_position_embeddings=40960),
    "qwen3-8b": ModelSpec("qwen3-8b", num_layers=36, hidden_size=4096, num_heads=32,
                          num_kv_heads=8, head_dim=128, intermediate_size=12288,
                          vocab_size=151936, tie_word_embeddings=False, qk_norm=True,
                          max_position_embeddings=40960),
    "qwen3-14b": ModelSpec("qwen3-14b", num_layers=40, hidden_size=5120, num_heads=40,
                           num_kv_heads=8, head_dim=128, intermediate_size=17408,
                           vocab_size=151936, tie_word_embeddings=False, qk_norm=True,
                           max_position_embeddings=40960),
    "qwen3-32b": ModelSpec("qwen3-32b", num_layers=64, hidden_size=5120, num_heads=64,
                           num_kv_heads=8, head_dim=128, intermediate_size=25600,
                           vocab_size=151936, tie_word_embeddings=False, qk_norm=True,
                           max_position_embeddings=40960),
    # v0.3: the 32,768-token vocabulary, full attention (no sliding window since v0.2)
    "mistral-7b": ModelSpec("mistral-7b", num_layers=32, hidden_size=4096, num_heads=32,
                            num_kv_heads=8, head_dim=128, intermediate_size=14336,
                            vocab_size=32768, tie_word_embeddings=False,
                            max_position_embeddings=32768),
    # 810 GB of bf16 weights: run it with engine.tensor_parallel_size: 8 (e.g. on h200)
    "llama-3.1-405b": ModelSpec("llama-3.1-405b", num_layers=126, hidden_size=16384, num_heads=128,
                                num_kv_heads=8, head_dim=128, intermediate_size=53248,
                                vocab_size=128256, tie_word_embeddings=False,
                                max_position_embeddings=131072),
    "smollm2-135m": ModelSpec("smollm2-135m", num_layers=30, hidden_size=576, num_heads=9,
                              num_kv_heads=3, head_dim=64, intermediate_size=1536,
                              vocab_size=49152, tie_word_embeddings=True,
                              max_position_embeddings=8192),
    "tiny-llama": ModelSpec("tiny-llama", num_layers=2, hidden_size=64, num_heads=4,
                            num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=320,
                            tie_word_embeddings=False, dtype="float32", max_position_embeddings=4096),
}

ALIASES: dict[str, str] = {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "qwen/qwen3-0.6b": "qwen3-0.6b",
    "qwen/qwen3-8b": "qwen3-8b",
    "qwen/qwen3-14b": "qwen3-14b",
    "qwen/qwen3-32b": "qwen3-32b",
    "mistralai/mistral-7b-v0.3": "mistral-7b",
    "mistralai/mistral-7b-instruct-v0.3": "mistral-7b",
    "meta-llama/llama-3.1-405b": "llama-3.1-405b",
    "meta-llama/llama-3.1-405b-instruct": "llama-3.1-405b",
    "huggingfacetb/smollm2-135m": "smollm2-135m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
}


def load_model_spec(name_or_path: str | Path | ModelSpec, dtype: str | None = None) -> ModelSpec:
    """A preset name (or HF repo id alias), a model directory, or a config.json path."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path.with_dtype(dtype) if dtype else name_or_path
    key = str(name_or_path).lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        spec = PRESETS[key]
        return spec.with_dtype(dtype) if dtype else spec
    path = Path(name_or_path)
    if path.exists():
        return ModelSpec.from_hf_config(path, dtype=dtype)
    raise ConfigError("model", f"unknown model {str(name_or_path)!r} (presets: {', '.join(PRESETS)}; "
                     "or give a model directory / config.json path)")
