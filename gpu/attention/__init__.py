"""Attention backends behind one interface (`AttentionBackend`): flash-attn and torch-paged."""
from servetwin.gpu.attention.backend import AttentionBackend, write_kv
from servetwin.gpu.attention.flash_attn import FlashAttnBackend
from servetwin.gpu.attention.metadata import CommonAttentionMetadata
from servetwin.gpu.attention.selector import ATTENTION_BACKENDS, select_attention_backend
from servetwin.gpu.attention.torch_paged import TorchPagedAttention

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "CommonAttentionMetadata", "FlashAttnBackend",
           "TorchPagedAttention", "select_attention_backend", "write_kv"]
