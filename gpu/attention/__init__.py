"""Attention backends behind one interface (`AttentionBackend`): flash-attn and torch-paged."""
from gpu.attention.backend import AttentionBackend, write_kv
from gpu.attention.flash_attn import FlashAttnBackend
from gpu.attention.metadata import CommonAttentionMetadata
from gpu.attention.selector import ATTENTION_BACKENDS, select_attention_backend
from gpu.attention.torch_paged import TorchPagedAttention

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "CommonAttentionMetadata", "FlashAttnBackend",
           "TorchPagedAttention", "select_attention_backend", "write_kv"]
