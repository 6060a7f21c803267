"""Size the simulated KV pool exactly as the engine would (docs/scheduler_behaviour.md §5), and build the executor.

vLLM V1 (`gpu_worker.determine_available_memory`) profiles one dummy forward of
`max_num_batched_tokens` (then a dummy sampler run over `min(max_num_seqs, tokens)` rows) and keeps

    available = total_memory * gpu_memory_utilization - (weights + torch_peak_increase + non_torch_increase)

for the KV cache, `num_blocks = available // bytes_per_block` (`servetwin.core.kv_cache.kv_sizing`).
Its terms, as the simulator estimates them:
- `total_memory`: what the CUDA driver reports (`HardwareSpec.memory_bytes`, e.g. 79.11 GiB on an
  H100 80GB), not the datasheet's 80 GiB;
- weights: the parameter count x bytes per weight (1 with fp8 weights, the embedding, LM head, routers and
  norms staying in the model dtype), per tensor-parallel rank; an MoE model's experts at their storage
  precision in the layout their kernel pads them to (`CostModel.weight_bytes_per_rank`);
- the activation peak: the larger of the forward's transient buffers and the sampler's (they are not
  live at the same time): per token ACT_D_BUFFERS d-sized plus ACT_FF_BUFFERS dff-sized activations
  (fitted to vLLM's logged peaks, see below), and per sampled row the bf16 logits plus
  SAMPLER_FP32_COPIES fp32 copies of them;
- non-torch memory: what the profile sees grow outside PyTorch's allocator since the worker started
  (the CUDA context is created before the baseline, so it is not counted): cuBLAS/NCCL workspaces,
  NON_TORCH_BYTES_CUDA, plus NCCL's buffers per extra rank under tensor parallelism.
The fitted constants reproduce vLLM's logs: Llama-3.1-8B on an H100 (V1, 8192 batched tokens, 256
sequences, utilisation 0.9: weights 14.99 GiB, activation peak 1.21 GiB, non-torch 0.32 GiB, KV
54.68 GiB = 447,776 tokens) and Qwen2-7B on an A100-80GB at utilisation 0.5 (2048 tokens, 256
sequences: 29,053 blocks). An explicit `num_gpu_blocks` (e.g. the engine's logged count) or
`kv_cache_memory_bytes` bypasses the estimate. Matching the engine's block count matters more for
accuracy than anything else in the pool, so the summary reports every term.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.executor import ExecutorInfo
from servetwin.core.kv_cache.kv_cache_planning import KVCachePlan, describe_kv_plan, model_kv_plan
from servetwin.core.kv_cache.kv_sizing import KVCacheSpec
from servetwin.sim.cost_model import CostModel, default_cuda_graph_sizes
from servetwin.sim.executor import SimExecutor
from servetwin.sim.spec_acceptance import AcceptanceModel
from servetwin.sim.spec_drafter import SimDrafter
from servetwin.sim.kv_transfer import build_kv_worker
from servetwin.sim.hardware import HardwareSpec, load_hardware
from servetwin.sim.model_spec import ModelSpec, load_model_spec
from servetwin.sim.pipeline import PipelineStages, stage_layers

DEFAULT_HARDWARE = "h100-sxm"  # the simulated device when the engine arguments name none
NON_TORCH_BYTES_CUDA = 300 * 2**20  # cuBLAS workspace, allocator overheads (vLLM logs 0.1-0.35 GiB at tp 1)
NON_TORCH_BYTES_PER_RANK = 256 * 2**20  # NCCL / custom all-reduce buffers per extra tensor-parallel rank
ACT_D_BUFFERS = 13.0  # d-sized activations per token live at the forward's peak (residual, norms, q/k/v, o, ...)
ACT_FF_BUFFERS = 1.8  # dff-sized ones (gate_up output, SiLU-and-mul output), fitted with ACT_D_BUFFERS
SAMPLER_FP32_COPIES = 2  # fp32 logits and probabilities during the dummy sampler run


@dataclass(slots=True, frozen=True)
class KVPoolSize:
    num_gpu_blocks: int
    kv_spec: KVCacheSpec
    requested_bytes: int
    weight_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    available_kv_bytes: int
    # the model's KV cache groups: a pool block is one page of each of `group_size` layers
    kv_plan: Optional[KVCachePlan] = None

    @property
    def kv_cache_groups(self) -> Optional[tuple]:
        """None for one full-attention group (the scheduler's default)."""
        return None if self.kv_plan is None else self.kv_plan.scheduler_groups

    @property
    def bytes_per_block(self) -> int:
        """One pool block: a page of each layer of one KV cache group (all layers for one group)."""
        layers = self.kv_spec.num_layers if self.kv_plan is None else self.kv_plan.group_size
        return layers * self.kv_spec.page_size_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"num_gpu_blocks": self.num_gpu_blocks, "bytes_per_block": self.bytes_per_block,
                "requested_bytes": self.requested_bytes, "weight_bytes": self.weight_bytes,
                "activation_peak_bytes": self.activation_peak_bytes, "non_torch_bytes": self.non_torch_bytes,
                "available_kv_bytes": self.available_kv_bytes,
                # None: one full-attention group (every dense model)
                "kv_cache_groups": None if self.kv_cache_groups is None else describe_kv_plan(self.kv_plan)}


def activation_peak_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1) -> int:
    """Peak transient memory of vLLM's profiling run: max(forward buffers, sampler buffers)."""
    b = model.dtype_bytes
    per_token = (ACT_D_BUFFERS * model.hidden_size + ACT_FF_BUFFERS * model.intermediate_size / tp) * b
    forward = max_num_batched_tokens * per_token
    rows = min(max_num_seqs, max_num_batched_tokens)
    sampler = rows * model.vocab_size * (b + 4 * SAMPLER_FP32_COPIES)
    return int(max(forward, sampler))


def non_torch_bytes(hw: HardwareSpec, tp: int = 1) -> int:
    if hw.device_type != "cuda":
        return 0
    return NON_TORCH_BYTES_CUDA + NON_TORCH_BYTES_PER_RANK * (tp - 1 if tp > 1 else 0)


def size_kv_pool(model: ModelSpec, hw: HardwareSpec, block_size: int = 16, gpu_memory_utilization: float = 0.9,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 128, tp: int = 1,
                 num_gpu_blocks: Optional[int] = None, kv_cache_memory_bytes: Optional[int] = None,
                 kv_dtype: Optional[str] = None, quantization: Optional[str] = None,
                 weight_bytes: Optional[int] = None,
                 disable_hybrid_kv_cache_manager: bool = False) -> KVPoolSize:
    kv_heads = max(1, model.num_kv_heads // tp)
    spec = KVCacheSpec(num_layers=model.num_layers, num_kv_heads=kv_heads, head_size=model.head_dim,
                       dtype=kv_dtype if kv_dtype not in (None, "auto") else model.dtype, block_size=block_size)
    requested = math.ceil(hw.memory_bytes * gpu_memory_utilization)
    # at their storage precision (an MoE model's MXFP4 experts: 4.25 bits); fp8 quantisation: 1 byte each
    # but the embedding, LM head, routers and norms (`ModelSpec.fp8_weight_bytes`);
    # `weight_bytes`: the rank's figure when the caller knows it (`CostModel.weight_bytes_per_rank`: padded experts)
    if weight_bytes is not None:
        weights = weight_bytes
    else:
        weights = (model.fp8_weight_bytes if quantization == "fp8" else model.weight_bytes) // tp
    act = activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, tp)
    non_torch = non_torch_bytes(hw, tp)
    if kv_cache_memory_bytes is not None:
        available = kv_cache_memory_bytes
    else:
        available = requested - weights - act - non_torch
    plan = model_kv_plan(model, disable_hybrid_kv_cache_manager)
    blocks = num_gpu_blocks if num_gpu_blocks is not None else plan.num_blocks(max(available, 0),
                                                                             spec.page_size_bytes)
    if blocks < 2:
        raise ConfigError(
            "gpu_memory_utilization", f"{hw.name} ({hw.memory_bytes / 2**30:.1f} GiB x {gpu_memory_utilization}) "
            f"leaves {available / 2**30:.2f} GiB for the KV cache after {weights / 2**30:.2f} GiB of weights "
            f"and {act / 2**30:.2f} GiB of activations: not even 2 blocks fit. Use a bigger device, "
            "tensor_parallel_size, or an explicit num_gpu_blocks.")
    return KVPoolSize(blocks, spec, requested, weights, act, non_torch, int(available), plan)


def max_capture_size(args: Any, max_num_batched_tokens: int) -> int:
    """vLLM's `max_cudagraph_capture_size`: as given, else min(2 * max_num_seqs, 512), never above the
    step's token budget."""
    given = getattr(args, "max_cudagraph_capture_size", None)
    size = given if given is not None else min(2 * args.max_num_seqs, 512)
    return min(size, max_num_batched_tokens)


def pipeline_stage_model(model: ModelSpec, weight_bytes: int, pp: int) -> tuple[ModelSpec, int]:
    """What one device of the widest pipeline stage holds (its pool is every stage's, as vLLM takes the
    smallest): that stage's layers and their share of the rank's weights (the embedding and LM head are
    spread with the layers here, not placed on the first and last stage)."""
    if pp == 1:
        return model, weight_bytes
    if pp > model.num_layers:
        raise ConfigError("pipeline_parallel_size", f"{pp} stages for {model.num_layers} layers")
    n = max(stage_layers(model.num_layers, pp))
    types = None if model.layer_types is None else model.layer_types[:n]
    return dataclasses.replace(model, num_layers=n, layer_types=types), weight_bytes * n // model.num_layers


def build_sim_executor(args: Any):
    """The `sim` backend's `ExecutorBackend.from_engine_args` (args: `EngineArgs`): size the pool, build the
    `SimExecutor`."""

    model = load_model_spec(args.model, dtype=None if args.dtype in (None, "auto") else args.dtype)
    hw = load_hardware(args.hardware or DEFAULT_HARDWARE)
    mnbt = args.max_num_batched_tokens or max(8192, args.max_num_seqs)
    quantization = getattr(args, "quantization", None)
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto") or "auto"
    cost_model = CostModel(model, hw, tp=args.tensor_parallel_size,
                           cuda_graphs=(not args.enforce_eager) and hw.device_type == "cuda",
                           graph_sizes=default_cuda_graph_sizes(max_capture_size(args, mnbt)),
                           piecewise_graphs=hw.provenance.get("backend") != "torch",
                           ipc=bool(getattr(args, "multiprocess", False)), quantization=quantization,
                           kv_cache_dtype=kv_cache_dtype, async_scheduling=bool(args.async_scheduling),
                           fuse_allreduce_rms=bool(getattr(args, "fuse_allreduce_rms", False)),
                           moe_backend=getattr(args, "moe_backend", "auto"))
    pp = getattr(args, "pipeline_parallel_size", 1)
    if pp > 1 and hw.interconnect_bandwidth <= 0:
        raise ConfigError("pipeline_parallel_size", f"hardware {hw.name!r} has no interconnect to send activations "
                                                    "between stages (interconnect_bandwidth 0; a CPU calibration "
                                                    "measures one)")
    stage_model, weight_bytes = pipeline_stage_model(model, cost_model.weight_bytes_per_rank, pp)
    pool = size_kv_pool(stage_model, hw, args.block_size, args.gpu_memory_utilization, mnbt, args.max_num_seqs,
                        args.tensor_parallel_size, args.num_gpu_blocks, args.kv_cache_memory_bytes,
                        kv_dtype=kv_cache_dtype, quantization=quantization,
                        weight_bytes=weight_bytes,
                        disable_hybrid_kv_cache_manager=getattr(args, "disable_hybrid_kv_cache_manager", False))
    requested_len = args.max_model_len if args.max_model_len is not None else model.max_position_embeddings
    in_flight = mnbt * (2 if getattr(args, "async_scheduling", False) else 1)
    max_len = pool.kv_plan.fit_max_model_len(pool.num_gpu_blocks, pool.kv_spec, requested_len,
                                             model.max_position_embeddings, in_flight)
    executor = SimExecutor(cost_model=cost_model)
    executor.kv_pool = pool
    if getattr(args, "speculative_config", None) is not None:
        rates = getattr(args, "spec_acceptance_rates", None)
        executor.enable_spec_decode(SimDrafter(args.speculative_config,
                                               AcceptanceModel(tuple(rates), args.seed) if rates else None))
    if pp > 1:
        executor.pipeline = PipelineStages(stage_layers(model.num_layers, pp), model.hidden_size * model.dtype_bytes,
                                           hw.interconnect_bandwidth, hw.interconnect_latency_s)
    kv_config = getattr(args, "kv_transfer_config", None)
    if kv_config is not None and pp > 1:  # a waiting step's time would not be booked on the stages
        raise ConfigError("kv_transfer_config", "the simulator does not model KV transfers with "
                                                "pipeline_parallel_size > 1 yet")
    if kv_config is not None:  # each TP rank moves its shard over its own link
        kv_bytes_per_token = model.kv_bytes_per_token(cost_model.kv_bytes_per_element) / args.tensor_parallel_size
        # the CPU tier's chunk is one pool block of every rank, unless given (vLLM 0.33 sizes it as the
        # worker's KV allocation / num_blocks x world size, offloading/config.py:199-211, cpu/spec.py:111-124:
        # with hybrid groups a page of each layer of one group, else of every layer)
        if kv_config.kv_connector == "OffloadingConnector":
            kv_config.kv_connector_extra_config.setdefault("kv_bytes_per_block",
                                                           pool.bytes_per_block * args.tensor_parallel_size)
        executor.enable_kv_transfer(build_kv_worker(kv_config, kv_bytes_per_token, args.block_size,
                                                    None if pool.kv_plan is None else pool.bytes_per_block))
    return ExecutorInfo(executor, pool.num_gpu_blocks, max_len, model.vocab_size, [], None,
                        kv_cache_groups=pool.kv_cache_groups)
