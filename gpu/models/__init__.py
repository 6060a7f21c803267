"""Our decoder modules (Llama / Qwen2 / Qwen3) and model resolution (built-in names, HF dirs, GGUF).

The names below are imported on first use (PEP 562): `servetwin.gpu.models.model_files` must load
without torch (the torch plugin's config-time checks read model configs through it)."""
from typing import Any

__all__ = ["BUILTIN_MODELS", "ModelInfo", "ModelSpec", "load_tokenizer", "model_spec", "resolve_model"]


def __getattr__(name: str) -> Any:
    if name == "ModelSpec":
        from servetwin.core.model_spec import ModelSpec  # noqa: PLC0415

        return ModelSpec
    if name in __all__:
        from servetwin.gpu.models import registry  # noqa: PLC0415

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
