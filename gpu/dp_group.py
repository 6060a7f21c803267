"""The data-parallel group of an MoE model's engine processes (vLLM 0.33 `ParallelConfig.stateless_init_dp_group`,
`config/parallel.py`: a gloo group on the CPU, whatever the device, for the ranks' lockstep all-reduces).

Each engine-core process joins it once, from the rendezvous file its front end named
(`DPRankInfo.init_path`); the engine's tensor-parallel workers (other processes) keep their own group.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from servetwin.gpu.parallel_state import COLLECTIVE_TIMEOUT_S


class GlooDPGroup:
    """`DPGroup` (core/engine/dp_lockstep.py) over a gloo process group of `world_size` engine processes."""

    def __init__(self, rank: int, world_size: int, init_path: str) -> None:
        self.rank, self.world_size = rank, world_size
        # the engine process runs no other process group (its TP ranks are worker processes)
        dist.init_process_group("gloo", init_method=f"file://{init_path}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t)
        return [int(v) for v in t.tolist()]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
