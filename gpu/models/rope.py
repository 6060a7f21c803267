"""Rotary position embeddings (neox / `rotate_half` layout, as HF Llama/Qwen weights expect).

Inverse frequencies for `default`, `linear` and `llama3` are computed here; `yarn` is delegated to
transformers' `ROPE_INIT_FUNCTIONS` (it needs the HF config). cos/sin are precomputed in float32 for
every position up to `max_positions` and indexed by the flattened `positions` of a step.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from servetwin.gpu.models.config import RopeConfig


def compute_inv_freq(rope: RopeConfig, head_dim: int,
                     hf_config: Optional[Any] = None) -> tuple[torch.Tensor, float]:
    """Returns `(inv_freq [rotary_dim // 2] float32, attention_scaling)`."""
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = rope.params
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if rope.rope_type == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn" and hf_config is not None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415
        with torch.device("cpu"):  # the model may be built under `torch.device("meta")`
            inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
        return inv.float(), float(scale)
    raise NotImplementedError(f"rope_type: {rope.rope_type!r} is not supported "
                              "(allowed: default, linear, llama3, yarn)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int,
                 hf_config: Optional[Any] = None) -> None:
        super().__init__()
        self.rope, self.hf_config, self.head_dim = rope, hf_config, head_dim
        cos, sin = self._compute_cache(max_positions)
        self.rotary_dim = cos.shape[1]
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self._step_cache: Optional[tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor]] = None

    def _compute_cache(self, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = compute_inv_freq(self.rope, self.head_dim, self.hf_config)
        inv_freq = inv_freq.to(torch.empty(0).device)  # honours a `with torch.device(...)` context
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scaling, emb.sin() * scaling

    def reset_cache(self) -> None:
        """Recompute cos/sin on the CPU and copy them in (after `to_empty` from the meta device)."""
        with torch.device("cpu"):
            cos, sin = self._compute_cache(self.max_positions)
        self.cos_cache = cos.to(self.cos_cache.device)
        self.sin_cache = sin.to(self.sin_cache.device)
        self._step_cache = None

    @property
    def max_positions(self) -> int:
        return self.cos_cache.shape[0]

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]; positions: [T]."""
        cos, sin = self._cos_sin(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def new_forward(self) -> None:
        """Forget the previous forward's cos/sin (called at the start of every model forward, so a
        CUDA-graph capture records the lookup even when its warm-up ran with the same tensor)."""
        self._step_cache = None

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """q and k in one call: `qk` is `[T, H + Hkv, D]` (q heads, then k heads); the same
        elementwise rotation as `forward`, over both at once."""
        cos, sin = self._cos_sin(positions, qk.dtype)
        return self._rotate(qk, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of `positions`, looked up once per forward and shared by every layer (the
        cache holds a reference to the positions tensor, so `is` cannot match a recycled object)."""
        c = self._step_cache
        if c is not None and c[0] is positions and c[1] == dtype:
            return c[2], c[3]
        cos = self.cos_cache[positions].to(dtype)[:, None, :]
        sin = self.sin_cache[positions].to(dtype)[:, None, :]
        self._step_cache = (positions, dtype, cos, sin)
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
