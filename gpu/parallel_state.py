"""The tensor-parallel group of one worker: its rank, the group size and the collectives the model uses
(vLLM 0.33's `vllm/distributed/parallel_state.py` `GroupCoordinator`, reduced to one TP group).

`TPGroup()` (size 1) is the single-process model: every collective returns its input, so the TP=1 code
path runs no `torch.distributed` call at all. A worker of a `MultiprocExecutor` calls
`init_tp_group(rank, size, init_method, device)`: gloo on the CPU, NCCL on CUDA, as vLLM picks them.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# a peer that died mid-collective makes gloo fail at once (its socket closes); this bounds a peer that
# hangs instead
COLLECTIVE_TIMEOUT_S = 120


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (vLLM's `tensor_model_parallel_all_reduce`)."""
        if self.world_size > 1:
            dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along `dim`, rank order (`tensor_model_parallel_all_gather`)."""
        if self.world_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (the KV pool: vLLM sizes every rank by the smallest)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


@dataclass(frozen=True, slots=True)
class PPGroup:
    """This worker's pipeline stage: `rank` of `world_size` stages (vLLM's PP `GroupCoordinator`). The
    intermediate tensors go point to point, stage r to stage r + 1 (`send_tensor_dict` /
    `recv_tensor_dict`); the sizes need not travel: every stage builds the same batch from the same
    scheduler output, so the receiver knows the shape."""
    rank: int = 0
    world_size: int = 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    def send_next(self, t: torch.Tensor) -> None:
        dist.send(t.contiguous(), dst=self.rank + 1)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=self.rank - 1)
        return t

    def min_int(self, value: int) -> int:
        """The smallest of the stages' `value`s (each stage's KV pool holds its own layers; the
        scheduler's pool is the smallest)."""
        return TPGroup(self.rank, self.world_size).min_int(value)


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers [start, end) of stage `pp_rank` (vLLM 0.33 distributed/utils.py:198 `get_pp_indices`
    without its VLLM_PP_LAYER_PARTITION override): equal parts, the remainder one layer each to the
    stages before the last, counted back from it (the last also holds the norm and the LM head)."""
    partitions = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the process group: NCCL when the model runs on CUDA (each rank on `cuda:<rank>`), else gloo.
    (With pipeline parallelism the same world is the PP group; TP x PP is not combined here.)"""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TPGroup(rank, world_size)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
