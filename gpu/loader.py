"""Load an HF checkpoint (config.json + safetensors, sharded or not) into our `DecoderLM`.

`load_model(info, dtype, device)` builds the module on the meta device, materialises it on `device`
and copies every tensor in, packing q/k/v into `qkv_proj` and gate/up into `gate_up_proj`. A tied
`lm_head.weight` in the checkpoint is ignored; any other missing or unexpected tensor is an error.

A directory holding `config.json` and `servetwin_random_weights.json` (`{"seed": N}`) instead of
weights is a random-weight model of that shape: its tensors are drawn directly on `device` (seeded,
O(1) activations), so a timing run of a full-size model (e.g. Llama-3.1-8B's shape on a GPU) needs
neither a checkpoint nor the disk or network to hold one.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Iterator, Optional

import torch

from servetwin.gpu.models.decoder import DecoderLM
from servetwin.gpu.models.registry import ModelInfo, ModelNotFoundError, resolve_model

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PACKED = {  # HF sub-name -> (our sub-name, shard index)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {path}")
    return files


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open  # noqa: PLC0415
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _our_name(hf_name: str) -> tuple[str, Optional[int]]:
    """Map an HF tensor name to ours; the int is the shard index inside a packed tensor."""
    if hf_name.startswith("model.embed_tokens.") or hf_name.startswith("model.norm."):
        return hf_name[len("model."):], None
    if hf_name.startswith("lm_head."):
        return hf_name, None
    m = _LAYER.match(hf_name)
    if m is None:
        return hf_name, None
    layer, rest = m.groups()
    module, _, leaf = rest.rpartition(".")
    if module in _PACKED:
        ours, shard = _PACKED[module]
        return f"layers.{layer}.{ours}.{leaf}", shard
    return f"layers.{layer}.{rest}", None


@torch.no_grad()
def load_weights(model: DecoderLM, path: Path) -> None:
    params = dict(model.named_parameters())
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shard_offsets = {"qkv_proj": [0, q, q + kv], "gate_up_proj": [0, cfg.intermediate_size]}
    loaded: set[tuple[str, Optional[int]]] = set()
    for hf_name, tensor in iter_checkpoint(path):
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, shard = _our_name(hf_name)
        if name not in params:
            raise ValueError(f"checkpoint: unexpected tensor {hf_name!r} in {path}")
        p = params[name]
        if shard is None:
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint: {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            p.copy_(tensor)
        else:
            kind = name.split(".")[-2]
            start = shard_offsets[kind][shard]
            p.narrow(0, start, tensor.shape[0]).copy_(tensor)
        loaded.add((name, shard))
    expected = set()
    for name in params:
        kind = name.split(".")[-2] if "." in name else ""
        if kind in shard_offsets:
            expected.update((name, s) for s in range(len(shard_offsets[kind])))
        else:
            expected.add((name, None))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint: {len(missing)} tensors missing in {path}: {missing[:8]}")


RANDOM_WEIGHTS_MARKER = "servetwin_random_weights.json"


@torch.no_grad()
def randomize_weights(model: DecoderLM, seed: int) -> None:
    """Seeded random weights drawn on the model's device: norms ~1, matrices scaled by 1/sqrt(fan-in)."""
    for i, (name, p) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=p.device).manual_seed(seed * 100_003 + i)
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.1, generator=gen)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.1, generator=gen)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


def load_model(info: ModelInfo | str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", max_positions: Optional[int] = None) -> DecoderLM:
    """Our `DecoderLM` with the checkpoint's weights, in `dtype` on `device`, in eval mode."""
    if isinstance(info, str):
        info = resolve_model(info)
    device = torch.device(device)
    max_positions = max_positions or info.decoder_config.max_position_embeddings
    with torch.device("meta"):
        model = DecoderLM(info.decoder_config, max_positions, info.hf_config)
    marker = info.path / RANDOM_WEIGHTS_MARKER
    if marker.exists():  # drawn in the target dtype on the device: no fp32 copy of a full-size model
        model = model.to(dtype).to_empty(device=device)
        randomize_weights(model, int(json.loads(marker.read_text()).get("seed", 0)))
    else:
        model = model.to_empty(device=device)
        model.rotary.reset_cache()
        load_weights(model, info.path)
    model = model.to(dtype)  # buffers: only floating params/buffers change; rope caches are re-made below
    model.rotary.reset_cache()
    logger.info("loaded %s (%s) from %s: %.1fM params, %s on %s", info.name, info.decoder_config.model_type,
                info.path, sum(p.numel() for p in model.parameters()) / 1e6, dtype, device)
    return model.eval()
