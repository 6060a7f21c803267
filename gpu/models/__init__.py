"""Our decoder modules (Llama / Qwen2 / Qwen3) and model resolution (built-in names, HF dirs, GGUF)."""
from servetwin.gpu.models.registry import BUILTIN_MODELS, ModelInfo, load_tokenizer, model_spec, resolve_model
from servetwin.core.model_spec import ModelSpec

__all__ = ["BUILTIN_MODELS", "ModelInfo", "ModelSpec", "load_tokenizer", "model_spec", "resolve_model"]
