"""Convert a GGUF checkpoint (dequantised by transformers + gguf) into an HF safetensors directory.

`save_pretrained` refuses GGUF-loaded models, so the state dict is written with safetensors directly
(the tied `lm_head.weight` dropped), next to config.json, generation_config.json and the tokenizer.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    try:
        import accelerate  # noqa: F401, PLC0415
        import gguf  # noqa: F401, PLC0415
    except ImportError as e:
        raise ImportError(f"loading a GGUF file needs the 'gguf' and 'accelerate' packages "
                          f"(pip install gguf accelerate): {e}") from e
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    logger.info("converting %s to safetensors in %s (dequantising, once)", gguf_path, out_dir)
    src_dir, fname = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname, local_files_only=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
