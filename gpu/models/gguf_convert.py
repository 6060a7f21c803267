"""Convert a GGUF checkpoint (dequantised by transformers + gguf) into an HF safetensors directory.

The tensors come from transformers' GGUF reader (`load_gguf_checkpoint`, names mapped against a
meta-device model, so `accelerate` is not needed); if that internal function is unavailable,
`from_pretrained(..., gguf_file=...)` is used (needs `accelerate`). `save_pretrained` refuses
GGUF-loaded models, so the state dict is written with safetensors directly (a tied
`lm_head.weight` dropped), next to config.json, generation_config.json and the tokenizer.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _gguf_state_dict(gguf_path: Path, config: Any) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415
    except ImportError:
        load_gguf_checkpoint = None
    if load_gguf_checkpoint is not None:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton,
                                      torch_dtype=torch.float32)
        return parsed["tensors"]
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32, local_files_only=True)
    return model.state_dict()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    try:
        import gguf  # noqa: F401, PLC0415
    except ImportError as e:
        raise ImportError(f"loading a GGUF file needs the 'gguf' package (pip install gguf): {e}") from e
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: PLC0415

    logger.info("converting %s to safetensors in %s (dequantising, once)", gguf_path, out_dir)
    src_dir, fname = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src_dir, gguf_file=fname, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in _gguf_state_dict(gguf_path, config).items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=fname, local_files_only=True).save_pretrained(out_dir)
