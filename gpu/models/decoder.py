"""Our own decoder (Llama / Qwen2 / Qwen3 / Mistral, Mixtral / Qwen3-MoE / gpt-oss) over a flattened,
paged batch.

`forward(input_ids [T], positions [T], kv_caches, attn_metadata) -> hidden [T, hidden]`; `attn_metadata`
is one backend plan shared by every layer, or a list with each layer's plan (layers of different
`AttentionWindow`s, or of different KV-cache groups, attend with different plans: `layer_windows`);
`compute_logits(hidden [N, hidden]) -> [N, vocab]` in float32. Built for one tensor-parallel rank
(`shard`, `tp`; default: the whole model) it holds that rank's heads, MLP columns and vocabulary rows
(`servetwin.gpu.models.tp_shard`) and sums / gathers the partial results over `tp`. q/k/v and gate/up are packed
(`qkv_proj`, `gate_up_proj`); `servetwin.gpu.loader` packs HF checkpoints into them. On the CPU in
float32 the small ops run as fused native calls (`servetwin.gpu.cpu_layer_kernels`): q/k norm + RoPE in
place in `qkv`, the residual add fused into the post-attention RMSNorm, the MoE layer whole.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from servetwin.gpu.attention.backend import AttentionBackend
from servetwin.gpu.cpu_layer_kernels import layer_kernels_for
from servetwin.gpu.models.config import AttentionWindow, DecoderConfig
from servetwin.gpu.models.layers import RMSNorm, SwiGLU, VocabParallelEmbedding, linear
from servetwin.gpu.models.moe import FusedMoE
from servetwin.gpu.models.rope import RotaryEmbedding
from servetwin.gpu.models.tp_shard import TPShard
from servetwin.gpu.parallel_state import TPGroup

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        # this rank's heads: q/k/v column-parallel (`qkv_proj`), o_proj row-parallel, summed over `tp`
        self.num_heads, self.num_kv_heads, self.head_dim = shard.local_heads, shard.local_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.tp = tp
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = [rotary]  # shared; a list keeps it out of this module's state dict
        self.backend: Optional[AttentionBackend] = None
        # gpt-oss: one learned logit per head joins the softmax (passed only when present, so backends
        # without sinks keep their signature)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: Any) -> torch.Tensor:
        T = x.shape[0]
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        if self._native_qk(qkv, positions):  # q/k norm and RoPE in one native call, in place in qkv
            q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        elif self.q_norm is not None:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
            q, k = self.rotary[0](positions, q, k)
        else:  # rotate q and k together: [T, H + Hkv, D]
            qk = self.rotary[0].rotate_qk(
                positions, qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim))
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        assert self.backend is not None, "attention backend not set (call DecoderLM.set_attention_backend)"
        if self.sinks is None:
            o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata, self.scale)
        else:
            o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata, self.scale, sinks=self.sinks)
        return self.tp.all_reduce(linear(o.reshape(T, self.q_size), self.o_proj.weight, self.o_proj.bias))

    def _native_qk(self, qkv: torch.Tensor, positions: torch.Tensor) -> bool:
        """On the CPU in float32: normalise (Qwen3) and rotate q and k in place with the native kernel
        (`servetwin.gpu.cpu_layer_kernels.qk_norm_rope`); False: the caller runs the torch ops."""
        rot = self.rotary[0]
        qw = kw = None
        eps = 0.0
        if self.q_norm is not None:
            qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        lk = layer_kernels_for(qkv, rot.cos_cache, rot.sin_cache, qw, kw)
        if (lk is None or not qkv.is_contiguous() or positions.dtype != torch.int64 or positions.device.type != "cpu"
                or rot.rotary_dim % 2 or (self.k_norm is not None and self.k_norm.eps != eps)):
            return False
        lk.qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim, qw, kw, eps, rot.cos_cache,
                        rot.sin_cache, positions)
        return True


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, layer: int, shard: TPShard, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, shard, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (FusedMoE(cfg.hidden_size, cfg.moe, tp) if cfg.moe is not None and cfg.is_moe_layer(layer)
                               else SwiGLU(cfg.hidden_size, cfg.intermediate_size // tp.world_size, cfg.mlp_bias, tp))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn_metadata: Any) -> torch.Tensor:
        a = self.self_attn(positions, self.input_layernorm(x), kv_cache, attn_metadata)
        x, h = self.post_attention_layernorm.add_forward(a, x)  # x + attention output, and its norm
        return x.add_(self.mlp(h))  # x is this layer's own tensor


class DecoderLM(nn.Module):
    def __init__(self, cfg: DecoderConfig, max_positions: int, hf_config: Optional[Any] = None,
                 tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup()
        self.shard = TPShard(self.tp.rank, self.tp.world_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.vocab_size)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, hf_config)
        self.embed_tokens = VocabParallelEmbedding(self.shard, cfg.hidden_size, self.tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, i, self.shard, self.tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layer_offset, self.is_first_stage, self.is_last_stage = 0, True, True  # the whole model
        # the LM head's rows: this rank's vocabulary slice (tied: the embedding's own)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, self.shard.vocab_per_rank,
                                                                      bias=False)

    @property
    def layer_windows(self) -> list[AttentionWindow]:
        """Each layer's attention window: layers with different windows need different backend plans."""
        first = self.layer_offset
        return [self.config.window(first + i) for i in range(len(self.layers))]

    def keep_pipeline_stage(self, start: int, end: int, is_first: bool, is_last: bool) -> None:
        """Drop what pipeline stage [start, end) does not run (vLLM builds `PPMissingLayer`s in their
        place): the other layers, the embedding unless it is the first stage (or the last with tied
        weights), the final norm and the LM head unless it is the last. `layer_windows` and the KV
        caches follow the kept layers."""
        self.layer_offset = start
        self.layers = nn.ModuleList(list(self.layers)[start:end])
        self.is_first_stage, self.is_last_stage = is_first, is_last
        if not is_first and not (is_last and self.lm_head is None):
            self.embed_tokens = None
        if not is_last:
            self.norm, self.lm_head = None, None

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        for layer in self.layers:
            layer.self_attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attn_metadata: Any, intermediate: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final hidden states; a pipeline stage before the last returns its layers' output (the
        residual stream, vLLM's `IntermediateTensors`) and a later stage starts from `intermediate`."""
        self.rotary.new_forward()
        x = self.embed_tokens(input_ids) if intermediate is None else intermediate
        # one plan for every layer, or one per layer (its KV group's table and its window)
        per_layer = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(self.layers)
        for layer, kv, meta in zip(self.layers, kv_caches, per_layer):
            x = layer(positions, x, kv, meta)
        return self.norm(x) if self.is_last_stage else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, w)
        if self.tp.world_size > 1:  # every rank samples the same tokens, so every rank gets all logits
            logits = self.tp.all_gather(logits, dim=-1)[..., :self.config.vocab_size]
        return logits.float()
