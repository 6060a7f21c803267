"""Scheduler and cache configuration with vLLM 0.33 names, defaults and validation."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.hashing import HASH_ALGOS, get_hash_fn_by_name
from servetwin.core.kv_cache.kv_cache_interface import ONE_FULL_GROUP, check_group_mix, check_retention_interval
from servetwin.core.sched.request_queue import SchedulingPolicy


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}", f"must be an integer >= {minimum}, got {value!r}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: Optional[int] = None  # None: 32768 with chunked prefill, else max_num_batched_tokens
    max_num_scheduled_tokens: Optional[int] = None
    max_num_active_seqs: Optional[int] = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    async_scheduling: bool = False
    # vLLM's parallel_config.pipeline_parallel_size: the batch queue's depth and whether the scheduler
    # sends each running request's new tokens back to the first stage (vLLM's `use_pp`)
    pipeline_parallel_size: int = 1

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight at once (vLLM 0.33 config/vllm.py:588 `max_concurrent_batches`, V1 model
        runner): PP fills the pipeline with PP batches; async scheduling alone overlaps 2."""
        pp = self.pipeline_parallel_size
        return 2 if self.async_scheduling and pp <= 1 else pp

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is None:
            self.max_model_len = 32768 if self.enable_chunked_prefill else self.max_num_batched_tokens
        _check_int("max_model_len", self.max_model_len, 2)
        if self.max_num_scheduled_tokens is None:
            self.max_num_scheduled_tokens = self.max_num_batched_tokens
        _check_int("max_num_scheduled_tokens", self.max_num_scheduled_tokens, 1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError("policy", f"must be 'fcfs' or 'priority', got {self.policy!r}")
        if not isinstance(self.watermark, (int, float)) or not 0.0 <= self.watermark < 1.0:
            raise ConfigError("watermark", f"must be in [0, 1), got {self.watermark!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "max_num_batched_tokens", f"{self.max_num_batched_tokens} is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill disabled, so the longest sequence could "
                "never be scheduled; raise max_num_batched_tokens or lower max_model_len.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("max_num_batched_tokens", f"{self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.max_num_active_seqs is not None:
            _check_int("max_num_active_seqs", self.max_num_active_seqs, 1)
            if self.max_num_active_seqs > self.max_num_seqs:
                raise ConfigError("max_num_active_seqs", f"{self.max_num_active_seqs} must be <= "
                                 f"max_num_seqs ({self.max_num_seqs})")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ConfigError("long_prefill_token_threshold", f"{self.long_prefill_token_threshold} must be "
                             f"<= max_model_len ({self.max_model_len})")

    @property
    def max_in_flight_tokens(self) -> int:
        """Tokens scheduled but not yet processed: one step, two with async scheduling (vLLM's
        `VllmConfig.max_in_flight_tokens`; sizes the window groups' admission cap)."""
        return self.max_num_batched_tokens * (2 if self.async_scheduling else 1)

    @property
    def scheduling_policy(self) -> SchedulingPolicy:
        return SchedulingPolicy(self.policy)


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None  # None: sized from memory by the executor
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: Optional[int] = None
    prefix_caching_hash_algo: str = "sha256"  # vLLM's names, plus "builtin" (core/kv_cache/hashing.py)
    cache_dtype: str = "auto"
    # KV cache groups (core/kv_cache/kv_cache_interface.py); None: one full-attention group
    kv_cache_groups: Optional[tuple] = None
    # vLLM's sparse sliding-window retention: 0 (default), None (dense) or a multiple of block_size
    prefix_cache_retention_interval: Optional[int] = 0

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.num_gpu_blocks is not None:
            _check_int("num_gpu_blocks", self.num_gpu_blocks, 2)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.kv_cache_groups is not None:
            self.kv_cache_groups = tuple(self.kv_cache_groups)
            if not self.kv_cache_groups:
                raise ConfigError("kv_cache_groups", "must be None or a non-empty list of groups")
            check_group_mix(self.kv_cache_groups)
        check_retention_interval(self.prefix_cache_retention_interval, self.kv_cache_groups or ONE_FULL_GROUP,
                                 self.block_size)
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ConfigError("prefix_caching_hash_algo", f"must be one of {', '.join(HASH_ALGOS)}, got "
                             f"{self.prefix_caching_hash_algo!r}")
        try:
            get_hash_fn_by_name(self.prefix_caching_hash_algo)
        except ValueError as exc:  # an optional package is missing
            raise ConfigError("prefix_caching_hash_algo", str(exc).split(": ", 1)[1]) from None


def field_names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}
