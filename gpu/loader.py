"""Load an HF checkpoint (config.json + safetensors, sharded or not) into our `DecoderLM`.

`load_model(info, dtype, device)` builds the module on the meta device, materialises it on `device`
and copies every tensor in, packing q/k/v into `qkv_proj` and gate/up into `gate_up_proj`. A tied
`lm_head.weight` in the checkpoint is ignored; any other missing or unexpected tensor is an error.

With a tensor-parallel model (`load_model(..., tp=TPGroup(rank, size))`) each checkpoint tensor is cut
to the rank's slice on the way in (`_rank_slice`, the rules of `servetwin.gpu.models.tp_shard`): every
rank reads the checkpoint and keeps its part, as vLLM's `weight_loader`s do.

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
from typing import Hashable, Iterator, Optional

import torch

from servetwin.gpu.models.decoder import DecoderLM
from servetwin.gpu.models.registry import ModelInfo, ModelNotFoundError, resolve_model
from servetwin.gpu.models.tp_shard import TPShard
from servetwin.gpu.parallel_state import TPGroup

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


_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# one expert's HF matrix -> (our fused tensor, half of w13: 0 gate, 1 up; None: the whole w2[e])
_EXPERT_PROJ = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
                "down_proj": ("w2", None), "w2": ("w2", None)}
_ROUTER = {"mlp.router": "mlp.gate", "block_sparse_moe.gate": "mlp.gate"}  # gpt-oss's, legacy Mixtral's
_FUSED_EXPERTS = {"mlp.experts.gate_up_proj": "mlp.w13", "mlp.experts.down_proj": "mlp.w2",
                  "mlp.experts.gate_up_proj_bias": "mlp.w13_bias", "mlp.experts.down_proj_bias": "mlp.w2_bias"}
Shard = Optional[Hashable]  # None: the whole tensor; an int: a packed part; (expert, part): an expert's


def _our_name(hf_name: str) -> tuple[str, Shard]:
    """Map an HF tensor name to ours; the shard says which part of our (packed) tensor it fills."""
    if hf_name.startswith("model.embed_tokens.") or hf_name.startswith("model.norm."):
        return hf_name[len("model."):], None
    if hf_name.startswith("lm_head."):
        return hf_name, None
    m = _LAYER.match(hf_name)
    if m is None:
        return hf_name, None
    layer, rest = m.groups()
    if (e := _EXPERT.match(rest)) is not None and e.group(2) in _EXPERT_PROJ:
        ours, part = _EXPERT_PROJ[e.group(2)]
        return f"layers.{layer}.mlp.{ours}", (int(e.group(1)), part)
    if rest in _FUSED_EXPERTS:
        return f"layers.{layer}.{_FUSED_EXPERTS[rest]}", None
    module, _, leaf = rest.rpartition(".")
    if module in _ROUTER:
        return f"layers.{layer}.{_ROUTER[module]}.{leaf}", None
    if module in _PACKED:
        ours, shard = _PACKED[module]
        return f"layers.{layer}.{ours}.{leaf}", shard
    return f"layers.{layer}.{rest}", None


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss stores gate and up interleaved (gate at even, up at odd indices): -> [gate; up]."""
    idx = torch.arange(t.shape[dim])
    return torch.cat([t.index_select(dim, idx[0::2]), t.index_select(dim, idx[1::2])], dim=dim)


def _gpt_oss_experts(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """gpt-oss's fused expert tensors in HF's bf16 layout -> ours: gate_up [E, H, 2I] interleaved ->
    w13 [E, 2I, H] (gate rows, then up rows); down [E, I, H] -> w2 [E, H, I]; gate_up bias de-interleaved."""
    if name.endswith("mlp.w13"):
        return _deinterleave(tensor.transpose(1, 2), 1)
    if name.endswith("mlp.w2"):
        return tensor.transpose(1, 2)
    if name.endswith("mlp.w13_bias"):
        return _deinterleave(tensor, 1)
    return tensor


# OCP Microscaling (MX) v1.0: FP4 E2M1 code points (sign in bit 3), an E8M0 power-of-two scale per 32
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`blocks` uint8 [E, R, G, 16] (two FP4 values a byte, low nibble first), `scales` uint8 [E, R, G]
    (exponent + 127) -> float32 [E, R, G * 32]. gpt-oss's checkpoints store experts this way with rows
    = output features (gate_up: 2I interleaved rows over H; down: H rows over I)."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None])
    return vals.flatten(-2)


def _pair_mxfp4(hf_name: str, tensor: torch.Tensor,
                pending: dict[str, torch.Tensor]) -> Optional[tuple[str, torch.Tensor]]:
    """Collect an MXFP4 `*_blocks` / `*_scales` pair; once both are seen, the dequantised tensor under
    the bf16 name in our row layout (`..._proj` -> w13 interleaved rows or w2), else None."""
    base, kind = hf_name.rsplit("_", 1)
    pending[f"{base}_{kind}"] = tensor
    if f"{base}_blocks" not in pending or f"{base}_scales" not in pending:
        return None
    deq = dequantize_mxfp4(pending.pop(f"{base}_blocks"), pending.pop(f"{base}_scales"))
    return base, deq


@torch.no_grad()
def load_weights(model: DecoderLM, path: Path) -> None:
    """Every checkpoint tensor into our modules; gpt-oss's MXFP4 experts are dequantised here (the model
    then holds them in its own dtype: no MXFP4 kernel)."""
    params = dict(model.named_parameters())
    cfg, tp = model.config, model.shard
    q, kv = tp.local_heads * cfg.head_dim, tp.local_kv_heads * cfg.head_dim
    shard_offsets = {"qkv_proj": [0, q, q + kv], "gate_up_proj": [0, cfg.intermediate_size // tp.size]}
    moe_width = None if cfg.moe is None else cfg.moe.intermediate_size // tp.size
    expert_parts = {"w13": [0, 1], "w2": [None]}
    loaded: set[tuple[str, Shard]] = set()
    pending: dict[str, torch.Tensor] = {}
    for hf_name, tensor in iter_checkpoint(path):
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        mxfp4 = hf_name.endswith("_blocks") or hf_name.endswith("_scales")
        if mxfp4:
            done = _pair_mxfp4(hf_name, tensor, pending)
            if done is None:
                continue
            hf_name, tensor = done
        name, shard = _our_name(hf_name)
        if name not in params:
            raise ValueError(f"checkpoint: unexpected tensor {hf_name!r} in {path}")
        p = params[name]
        if name.endswith((".mlp.w13", ".mlp.w2")):  # stored input-major: fill it through [E, out, in]
            p = p.transpose(-1, -2)
        if cfg.model_type == "gpt_oss" and shard is None:  # MXFP4 rows are already output features
            tensor = (_deinterleave(tensor, 1) if name.endswith("mlp.w13") else tensor) if mxfp4 \
                else _gpt_oss_experts(name, tensor)
        if tp.size > 1:
            tensor = _rank_slice(name, shard, tensor, tp, cfg.intermediate_size,
                                 None if cfg.moe is None else cfg.moe.intermediate_size)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and tensor.shape[0] < p.shape[0]:
            p[tensor.shape[0]:].zero_()  # vocabulary padding rows of the last rank
            p = p[:tensor.shape[0]]
        if isinstance(shard, tuple):  # one expert's matrix
            e, part = shard
            dst = p[e] if part is None else p[e].narrow(0, part * moe_width, moe_width)
            _copy(dst, tensor, hf_name)
        elif shard is None:
            _copy(p, tensor, hf_name)
        else:
            kind = name.split(".")[-2]
            start = shard_offsets[kind][shard]
            p.narrow(0, start, tensor.shape[0]).copy_(tensor)
        loaded.add((name, shard))
    if pending:
        raise ValueError(f"checkpoint: MXFP4 tensors without their blocks/scales pair in {path}: {sorted(pending)}")
    missing = []
    for name in params:
        leaf, kind = name.split(".")[-1], (name.split(".")[-2] if "." in name else "")
        if (name, None) in loaded:
            continue
        if kind in shard_offsets:
            parts = [(name, s) for s in range(len(shard_offsets[kind]))]
        elif leaf in expert_parts:
            parts = [(name, (e, j)) for e in range(cfg.moe.num_experts) for j in expert_parts[leaf]]
        else:
            parts = [(name, None)]
        missing += [f"{n}[{s}]" if s is not None else n for n, s in parts if (n, s) not in loaded]
    if missing:
        raise ValueError(f"checkpoint: {len(missing)} tensors missing in {path}: {sorted(missing)[:8]}")


_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")  # input columns split
_RANK0_BIAS = (".o_proj.bias", ".down_proj.bias", ".mlp.w2_bias")  # added once, by rank 0


def _halves(t: torch.Tensor, dim: int, width: int, tp: TPShard) -> torch.Tensor:
    """This rank's columns of both halves [gate; up] of a packed `2 * width` dim."""
    start, n = tp.split(width)
    return torch.cat([t.narrow(dim, start, n), t.narrow(dim, width + start, n)], dim=dim)


def _rank_slice(name: str, shard: Shard, t: torch.Tensor, tp: TPShard, mlp_width: int,
                moe_width: Optional[int]) -> torch.Tensor:
    """The part of checkpoint tensor `t` (already in our layout; `shard` as `_our_name` gives it) that
    rank `tp.rank` holds (`servetwin.gpu.models.tp_shard`); replicated tensors come back whole."""
    kind = name.split(".")[-2] if "." in name else ""
    if kind == "qkv_proj":
        return t.narrow(0, *(tp.q_rows() if shard == 0 else tp.kv_rows()))
    if kind == "gate_up_proj":
        return t.narrow(0, *tp.split(mlp_width))
    if name.endswith(_RANK0_BIAS):
        return t if tp.rank == 0 else torch.zeros_like(t)
    if name.endswith(".o_proj.weight"):
        return t.narrow(1, *tp.q_rows())
    if name.endswith(".down_proj.weight"):
        return t.narrow(1, *tp.split(mlp_width))
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return t.narrow(0, *tp.vocab_rows())
    if name.endswith(".sinks"):
        return t.narrow(0, tp.rank * tp.local_heads, tp.local_heads)
    if isinstance(shard, tuple):  # one expert's HF matrix: w13 parts [I, H], w2 [H, I]
        return t.narrow(0 if shard[1] is not None else 1, *tp.split(moe_width))
    if name.endswith(".mlp.w13"):  # fused [E, 2I, H] (gate rows, then up rows)
        return _halves(t, 1, moe_width, tp)
    if name.endswith(".mlp.w13_bias"):
        return _halves(t, 1, moe_width, tp)
    if name.endswith(".mlp.w2"):  # fused [E, H, I]
        return t.narrow(2, *tp.split(moe_width))
    return t


def _copy(dst: torch.Tensor, src: torch.Tensor, hf_name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint: {hf_name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


RANDOM_WEIGHTS_MARKER = "servetwin_random_weights.json"


@torch.no_grad()
def randomize_weights(model: DecoderLM, seed: int) -> None:
    """Seeded random weights drawn on the model's device: norms ~1, matrices scaled by 1/sqrt(fan-in).
    A tensor-parallel rank draws its own slice (another seed per rank: a timing model, not TP=1's
    weights cut up), scaled by the full fan-in of the row-parallel matrices."""
    tp = model.shard
    for i, (name, p) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=p.device).manual_seed(seed * 100_003 + i + tp.rank * 7_919)
        fan_in = p.shape[-2] if name.endswith((".mlp.w13", ".mlp.w2")) else p.shape[-1]  # experts: input-major
        if name.endswith(_ROW_PARALLEL + (".mlp.w2",)):
            fan_in *= tp.size
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.1, generator=gen)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.1, generator=gen)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, fan_in ** -0.5, generator=gen)


def load_model(info: ModelInfo | str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", max_positions: Optional[int] = None,
               tp: Optional[TPGroup] = None) -> DecoderLM:
    """Our `DecoderLM` with the checkpoint's weights, in `dtype` on `device`, in eval mode (`tp`: one
    tensor-parallel rank's shard of it)."""
    if isinstance(info, str):
        info = resolve_model(info)
    device = torch.device(device)
    max_positions = max_positions or info.decoder_config.max_position_embeddings
    with torch.device("meta"):
        model = DecoderLM(info.decoder_config, max_positions, info.hf_config, tp)
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
