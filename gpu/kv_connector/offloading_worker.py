"""The offloading connector's worker side in the torch backend: a CPU tensor tier (pinned on CUDA)
that load jobs copy into the KV pool and store jobs copy out of it (vLLM 0.33
`kv_connector/v1/offloading/worker.py` with `kv_offload/cpu` handlers, one chunk per block).

Per step (`OffloadingConnectorMetadata` from `core/kv_connector/offloading.py`):
- before the forward pass: this step's loads (their blocks were allocated for a request that is not
  scheduled yet) and the stores in `jobs_to_flush` (their blocks are reused by this step);
- after it: the other stores - their blocks hold KV this very forward pass computed (vLLM submits
  them at the start of the next step, before anything can overwrite those blocks).
Copies are synchronous, so every job of a step is reported complete in that step's output
(`completed_jobs`, and `finished_recving` for a request whose load finished).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_connector.base import KVConnectorOutput
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.offloading import PAGE_BYTES
from servetwin.core.kv_cache.kv_sizing import cdiv


@dataclass(slots=True)
class OffloadTransferStats:
    """What the worker moved (blocks and bytes each way)."""
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0


def unique_layer_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Every distinct K and V tensor of the pool (layers of several groups share tensors)."""
    seen: dict[int, torch.Tensor] = {}
    for k, v in kv_caches:
        seen.setdefault(id(k), k)
        seen.setdefault(id(v), v)
    return list(seen.values())


def num_cpu_chunks(config: KVTransferConfig, kv_bytes_per_block: int) -> int:
    """The CPU tier's slots, as the scheduler side counts them; its `kv_bytes_per_block` must be the
    pool's real block size, else the two sides would disagree on the tier's size."""
    given = config.get_from_extra_config("kv_bytes_per_block", None)
    if given != kv_bytes_per_block:
        raise ConfigError("kv_connector_extra_config.kv_bytes_per_block",
                          f"must be the KV pool's bytes per block, {kv_bytes_per_block}, got {given!r} "
                          "(with_kv_bytes_per_block fills it in)")
    return int(config.get_from_extra_config("cpu_bytes_to_use", 0)) // (cdiv(kv_bytes_per_block, PAGE_BYTES) * PAGE_BYTES)


class OffloadingWorker:
    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 kv_bytes_per_block: int) -> None:
        self.layers = unique_layer_caches(kv_caches)
        self.num_chunks = num_cpu_chunks(config, kv_bytes_per_block)
        self.kv_bytes_per_block = kv_bytes_per_block
        pin = self.layers[0].device.type == "cuda"
        self.cpu_tier = [torch.zeros((self.num_chunks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                         for t in self.layers]
        self.stats = OffloadTransferStats()
        self._completed: dict[int, int] = {}
        self._recved: set[str] = set()
        self._stores_left: list[Any] = []

    def _load(self, job: Any) -> None:
        if job.gpu_block_ids:
            dst = torch.tensor(job.gpu_block_ids, device=self.layers[0].device)
            src = torch.tensor(job.cpu_chunk_ids)
            for pool, tier in zip(self.layers, self.cpu_tier):
                pool.index_copy_(0, dst, tier.index_select(0, src).to(pool.device, non_blocking=True))
        self.stats.num_loaded_blocks += len(job.gpu_block_ids)
        self.stats.loaded_bytes += len(job.gpu_block_ids) * self.kv_bytes_per_block

    def _store(self, job: Any) -> None:
        if job.gpu_block_ids:
            src = torch.tensor(job.gpu_block_ids, device=self.layers[0].device)
            dst = torch.tensor(job.cpu_chunk_ids)
            for pool, tier in zip(self.layers, self.cpu_tier):
                tier.index_copy_(0, dst, pool.index_select(0, src).cpu())
        self.stats.num_stored_blocks += len(job.gpu_block_ids)
        self.stats.stored_bytes += len(job.gpu_block_ids) * self.kv_bytes_per_block

    def before_forward(self, meta: Any) -> None:
        """This step's loads and flushed stores (see the module docstring)."""
        for job_id, job in meta.load_jobs.items():
            self._load(job)
            self._completed[job_id] = 1
            self._recved.add(job.req_id)
        for job_id, job in meta.store_jobs.items():
            if job_id in meta.jobs_to_flush:
                self._store(job)
                self._completed[job_id] = 1
            else:
                self._stores_left.append((job_id, job))
        if self.layers[0].device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the pinned source of a load is reused later

    def after_forward(self) -> KVConnectorOutput | None:
        """Run the step's remaining stores; the step's report (None: nothing happened)."""
        for job_id, job in self._stores_left:
            self._store(job)
            self._completed[job_id] = 1
        self._stores_left = []
        if not self._completed:
            return None
        out = KVConnectorOutput(finished_recving=self._recved or None, completed_jobs=self._completed)
        self._completed, self._recved = {}, set()
        return out

    def close(self) -> None:
        """Nothing to stop (the tier is plain memory)."""


def with_kv_bytes_per_block(config: KVTransferConfig, kv_bytes_per_block: int) -> KVTransferConfig:
    """`config` with `kv_bytes_per_block` set to the pool's (for the scheduler side's tier size)."""
    extra = dict(config.kv_connector_extra_config)
    extra.setdefault("kv_bytes_per_block", kv_bytes_per_block)
    return KVTransferConfig(config.kv_connector, config.kv_role, config.kv_load_failure_policy, extra,
                            config.kv_connector_module_path)
