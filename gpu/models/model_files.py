"""Where a model's files live, and what its config.json says before anything is loaded (no torch,
no transformers: cheap enough for config-time checks).

Built and converted models live in `$SERVETWIN_CACHE/models/<name>` (default
`~/.cache/servetwin/models/<name>`); a `.gguf` is converted once into a folder keyed by its path, size
and modification time.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.limits import load_json_file

TINY_MODEL_NAMES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral-sw", "tiny-mixtral", "tiny-qwen3-moe",
                    "tiny-gpt-oss", "tiny-llama-wide")  # the builders: gpu.models.tiny.TINY_MODELS
SMOLLM2_NAME = "smollm2-135m"
BUILTIN_MODELS = (*TINY_MODEL_NAMES, SMOLLM2_NAME)


def cache_root() -> Path:
    env = os.environ.get("SERVETWIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "servetwin"


def models_dir() -> Path:
    return cache_root() / "models"


def gguf_cache_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return models_dir() / f"gguf-{gguf_path.stem}-{key}"


def config_on_disk(name_or_path: str) -> Optional[Path]:
    """The config.json the loader (`gpu.models.registry.resolve_model`) would read for this model, when
    it is already on disk (a built-in model built or converted before, an HF folder, a converted
    .gguf); None when only building or converting would tell."""
    if name_or_path in BUILTIN_MODELS:
        path = models_dir() / name_or_path / "config.json"
        return path if path.is_file() else None
    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return p / "config.json"
    ggufs = [p] if p.is_file() and p.suffix == ".gguf" else sorted(p.glob("*.gguf")) if p.is_dir() else []
    if len(ggufs) == 1:
        path = gguf_cache_dir(ggufs[0]) / "config.json"
        return path if path.is_file() else None
    return None


def max_position_embeddings(config_path: Path) -> Optional[int]:
    """The config's `max_position_embeddings`; None when the file does not say (absent, the model
    type's default applies: transformers knows it) or is no readable JSON mapping (the loader reports
    that one itself)."""
    try:
        cfg = load_json_file(config_path, "model")  # size-checked first (a 3 GiB config.json is no config)
    except (OSError, ValueError):
        return None
    value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def attention_heads(config_path: Path) -> Optional[tuple[int, int]]:
    """(attention heads, KV heads) from the config (KV heads default to the heads, as in HF); None when
    it does not say (a nested `text_config`, an unreadable file: the loader decides)."""
    try:
        cfg = load_json_file(config_path, "model")
    except (OSError, ValueError):
        return None
    heads = cfg.get("num_attention_heads") if isinstance(cfg, dict) else None
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        return None
    kv = cfg.get("num_key_value_heads") or heads
    return (heads, kv) if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 else None


def check_max_model_len(max_model_len: Optional[int], limit: int) -> None:
    """A `max_model_len` longer than the model's positions is an error naming the field."""
    if max_model_len is not None and max_model_len > limit:
        raise ConfigError("max_model_len", f"{max_model_len} exceeds the model's max_position_embeddings ({limit})")
