"""The torch executor's plugin (entry point `torch` of the group `servetwin.executors`).

It loads without torch (the executor class is named, imported on first use), so that its
`check_args` runs at config time in a fraction of a second."""
from __future__ import annotations

import importlib.util

from servetwin.core.engine.dp_lockstep import DPGroup, DPRankInfo
from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.executor import ExecutorBackend, ExecutorInfo
from servetwin.gpu.models.model_files import (attention_heads, check_max_model_len, config_on_disk,
                                              max_position_embeddings)
from servetwin.gpu.models.tp_shard import check_tensor_parallel

if importlib.util.find_spec("torch") is None:  # registered but unusable: the registry says so by name
    raise ImportError("No module named 'torch' (the torch backend needs it: pip install torch)")


def torch_executor_kwargs(args: EngineArgs) -> dict:
    """`TorchExecutor`'s arguments from `EngineArgs` (one process, or each tensor-parallel rank)."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                num_gpu_blocks=args.num_gpu_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_batched_tokens=args.max_num_batched_tokens or max(8192, args.max_num_seqs),
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
                seed=args.seed, profile_dir=args.profile_dir,
                disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                async_scheduling=args.async_scheduling, speculative_config=args.speculative_config,
                kv_transfer_config=args.kv_transfer_config)


def build_torch_executor(args: EngineArgs) -> ExecutorInfo:
    """Load the model and size the KV cache on the device (as vLLM's GPU worker does): in this process
    (`UniprocExecutor`'s place) at TP=1, in one worker process per rank (`MultiprocExecutor`) above."""
    kwargs = torch_executor_kwargs(args)
    if args.tensor_parallel_size > 1 and args.speculative_config is not None:
        # the ranks would draft, but nothing takes their drafts
        raise ConfigError("speculative_config", "the torch backend drafts at tensor_parallel_size 1 only")
    if args.pipeline_parallel_size > 1 and args.speculative_config is not None:
        raise ConfigError("speculative_config", "the torch backend drafts at pipeline_parallel_size 1 only")
    if (args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1) and args.kv_transfer_config is not None:
        # the connector's worker side lives in the one-process executor only (gpu/kv_connector)
        raise ConfigError("kv_transfer_config", "the torch backend runs a KV connector at tensor_parallel_size 1 "
                                                "and pipeline_parallel_size 1 only")
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        from servetwin.gpu.multiproc_executor import MultiprocExecutor, default_worker_threads  # noqa: PLC0415

        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        mp = MultiprocExecutor(tp, kwargs, threads=default_worker_threads(args.device, tp * pp),
                               pipeline_parallel_size=pp)
        return ExecutorInfo(mp, mp.num_gpu_blocks, mp.max_model_len, mp.vocab_size, list(mp.eos_token_ids or []),
                            mp.model_path, kv_cache_groups=mp.kv_cache_groups, is_moe=mp.is_moe)
    from servetwin.gpu.executor import TorchExecutor  # noqa: PLC0415

    ex = TorchExecutor(**kwargs)
    path = ex.model_info.path
    return ExecutorInfo(ex, ex.num_gpu_blocks, ex.max_model_len, ex.vocab_size, list(ex.eos_token_ids or []),
                        str(path) if path else None, kv_cache_groups=ex.kv_cache_groups, is_moe=ex.is_moe)


def check_torch_args(args: EngineArgs) -> None:
    """`max_model_len` against the model's `max_position_embeddings`, and `tensor_parallel_size` against
    its heads, read from its config.json when it is on disk (no torch, no weights); a model not built or
    converted yet is checked when it loads."""
    if args.pipeline_parallel_size > 1 and args.async_scheduling:
        # vLLM's V1 runner feeds PP + async scheduling through a device broadcast of the sampled tokens
        raise ConfigError("pipeline_parallel_size", "pipeline parallelism with async_scheduling is not supported by "
                                                    "the torch backend yet")
    if args.pipeline_parallel_size > 1 and args.tensor_parallel_size > 1:
        raise ConfigError("pipeline_parallel_size", f"tensor parallelism ({args.tensor_parallel_size}) and pipeline "
                                                    "parallelism together are not supported yet")
    path = config_on_disk(args.model)
    limit = max_position_embeddings(path) if path is not None else None
    if limit is not None and args.max_model_len not in (None, -1):
        check_max_model_len(args.max_model_len, limit)
    heads = attention_heads(path) if path is not None and args.tensor_parallel_size > 1 else None
    if heads is not None:  # the MLP widths are checked when the model loads
        check_tensor_parallel(*heads, (), args.tensor_parallel_size)


def init_torch_dp_group(info: DPRankInfo) -> DPGroup:
    """The gloo group of an MoE model's data-parallel ranks (one per engine process)."""
    from servetwin.gpu.dp_group import GlooDPGroup  # noqa: PLC0415

    return GlooDPGroup(info.rank, info.size, info.init_path)


BACKEND = ExecutorBackend("torch", "servetwin.gpu.executor:TorchExecutor", build_torch_executor,
                          check_args=check_torch_args, init_dp_group=init_torch_dp_group)
