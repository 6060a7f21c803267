"""Which part of each weight one tensor-parallel rank holds (vLLM 0.33's `model_executor/layers/linear.py`
`QKVParallelLinear` / `MergedColumnParallelLinear` / `RowParallelLinear` and
`vocab_parallel_embedding.py`).

- q heads: `num_heads / tp` consecutive heads a rank; KV heads: `num_kv_heads / tp` a rank, or, with
  fewer KV heads than ranks, each KV head replicated on `tp / num_kv_heads` consecutive ranks
  (`QKVParallelLinear`: `num_kv_head_replicas`);
- column-parallel (qkv, gate/up, expert w13): output rows split; row-parallel (o_proj, down, expert
  w2): input columns split, the partial products summed by an all-reduce; a row-parallel bias is held
  by rank 0 only (zero elsewhere), so the sum adds it once, as `RowParallelLinear` adds it on rank 0;
- vocabulary (embedding, LM head): `ceil(vocab / tp)` consecutive rows a rank, the last rank's tail
  padded with zero rows (vLLM pads to a multiple of 64 first; the padding is never a real token).

`check_tensor_parallel` refuses the sizes vLLM refuses, with vLLM's message meaning.
"""
from __future__ import annotations

from dataclasses import dataclass

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_sizing import kv_heads_per_rank


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_sizes: tuple[int, ...], tp: int) -> None:
    """vLLM's refusals: `ModelConfig.verify_with_parallel_config` (heads), `QKVParallelLinear` (KV heads:
    divisible by tp, or tp a multiple of them) and `divide()` of the MLP width."""
    if num_heads % tp:
        raise ConfigError("tensor_parallel_size", f"Total number of attention heads ({num_heads}) must be "
                                                  f"divisible by tensor parallel size ({tp}).")
    if (num_kv_heads >= tp and num_kv_heads % tp) or (num_kv_heads < tp and tp % num_kv_heads):
        raise ConfigError("tensor_parallel_size", f"Total number of KV heads ({num_kv_heads}) must be divisible "
                                                  f"by tensor parallel size ({tp}) or tensor parallel size by it.")
    for width in intermediate_sizes:
        if width % tp:
            raise ConfigError("tensor_parallel_size", f"MLP intermediate size ({width}) is not divisible by "
                                                      f"tensor parallel size ({tp}).")


@dataclass(frozen=True, slots=True)
class TPShard:
    """Rank `rank` of `size`: the slices of a model's weights it holds."""
    rank: int
    size: int
    num_heads: int  # the model's
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return kv_heads_per_rank(self.num_kv_heads, self.size)

    @property
    def first_kv_head(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        return self.rank // (self.size // self.num_kv_heads)  # replicated: tp / num_kv_heads ranks share one

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def split(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's part of `n` items split evenly (a column- or row-parallel dim)."""
        return self.rank * (n // self.size), n // self.size

    def q_rows(self) -> tuple[int, int]:
        return self.rank * self.local_heads * self.head_dim, self.local_heads * self.head_dim

    def kv_rows(self) -> tuple[int, int]:
        return self.first_kv_head * self.head_dim, self.local_kv_heads * self.head_dim

    def vocab_rows(self) -> tuple[int, int]:
        """(start, rows present in the checkpoint) of this rank's vocabulary slice (the rest is padding)."""
        start = min(self.vocab_start, self.vocab_size)
        return start, min(self.vocab_per_rank, self.vocab_size - start)

