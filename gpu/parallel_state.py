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


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the process group: NCCL when the model runs on CUDA (each rank on `cuda:<rank>`), else gloo."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TPGroup(rank, world_size)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
