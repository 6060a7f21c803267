"""Simulator model presets: published architectures as `servetwin.core.model_spec.ModelSpec`s.

The mixture-of-experts presets are built from the fields of their published config.json files (the
same reader as a model directory), so their MoE, sliding-window and quantisation fields are read the
one way: gpt-oss-120b / 20b (openai, MXFP4 experts, 128-token sliding window on every other layer,
attention sinks), Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen, bf16), Mixtral-8x7B-v0.1 (Mistral AI, bf16).
"""
from __future__ import annotations

from pathlib import Path

from servetwin.core.config_error import ConfigError
from servetwin.core.model_spec import SUPPORTED_MODEL_TYPES, ModelSpec

_GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "tie_word_embeddings": False,
            "attention_bias": True, "experts_per_token": 4, "num_experts_per_tok": 4, "sliding_window": 128,
            "swiglu_limit": 7.0, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "mxfp4"}}
_QWEN3_MOE = {"model_type": "qwen3_moe", "num_attention_heads": 0, "num_key_value_heads": 4, "head_dim": 128,
              "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False,
              "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


def _from_config(name: str, base: dict, **fields) -> ModelSpec:
    return ModelSpec.from_hf_config({**base, **fields}, name=name)


def _alternating(n: int) -> list[str]:
    """gpt-oss's layer_types: sliding, full, sliding, ... (18 + 18 for the 120b)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]

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
    "gpt-oss-120b": _from_config("gpt-oss-120b", _GPT_OSS, num_hidden_layers=36, num_local_experts=128,
                                 layer_types=_alternating(36)),
    "gpt-oss-20b": _from_config("gpt-oss-20b", _GPT_OSS, num_hidden_layers=24, num_local_experts=32,
                                layer_types=_alternating(24)),
    "qwen3-30b-a3b": _from_config("qwen3-30b-a3b", _QWEN3_MOE, num_hidden_layers=48, hidden_size=2048,
                                  num_attention_heads=32, intermediate_size=6144, moe_intermediate_size=768),
    "qwen3-235b-a22b": _from_config("qwen3-235b-a22b", _QWEN3_MOE, num_hidden_layers=94, hidden_size=4096,
                                    num_attention_heads=64, intermediate_size=12288, moe_intermediate_size=1536),
    # v0.1: 32,000-token vocabulary, sliding_window null (full attention)
    "mixtral-8x7b": _from_config("mixtral-8x7b", {}, model_type="mixtral", num_hidden_layers=32, hidden_size=4096,
                                 intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                                 num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                                 tie_word_embeddings=False, max_position_embeddings=32768,
                                 sliding_window=None, torch_dtype="bfloat16"),
    "tiny-llama": ModelSpec("tiny-llama", num_layers=2, hidden_size=64, num_heads=4,
                            num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=320,
                            tie_word_embeddings=False, dtype="float32", max_position_embeddings=4096),
    # the torch backend's built-in tiny-llama at hidden size 1024 (gpu/models/tiny.py; the CPU's TP compare)
    "tiny-llama-wide": ModelSpec("tiny-llama-wide", num_layers=2, hidden_size=1024, num_heads=16,
                                 num_kv_heads=4, head_dim=64, intermediate_size=4096, vocab_size=320,
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
    "openai/gpt-oss-120b": "gpt-oss-120b",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen/qwen3-30b-a3b-instruct-2507": "qwen3-30b-a3b",
    "qwen/qwen3-235b-a22b": "qwen3-235b-a22b",
    "qwen/qwen3-235b-a22b-instruct-2507": "qwen3-235b-a22b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
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
