"""Engine arguments with vLLM's names; an unknown name is an error that names it."""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, fields
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.executor import NO_BACKENDS, executor_backend, registered_backends
from servetwin.core.kv_cache.hashing import HASH_ALGOS
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.factory import create_connector
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.spec_decode import SpeculativeConfig


# vLLM's engine-argument names for fields we name as its configs do (vLLM's `--scheduling-policy`
# sets `SchedulerConfig.policy`): accepted as input, one field either way
# vLLM 0.11's pass_config name of the fused all-reduce + RMSNorm (renamed fuse_allreduce_rms in 0.12)
ENGINE_ARG_ALIASES: dict[str, str] = {"scheduling_policy": "policy", "enable_fi_allreduce_fusion": "fuse_allreduce_rms"}
# vLLM's --moe-backend values the simulator prices (vllm/config/kernel.py MoEBackend; the kernels per GPU are
# the hardware preset's `efficiency.moe_kernels`)
MOE_BACKENDS = ("auto", "marlin", "triton")


# vLLM engine arguments servetwin does not implement yet (vllm/engine/arg_utils.py names): refused with
# "not supported yet" instead of "unknown". Remove an entry when its feature lands (docs/unsupported.md lists
# the same table; tests/core/test_core_engine_args_limits.py keeps the two in step).
NOT_SUPPORTED_YET: dict[str, str] = {
    "enable_expert_parallel": "expert parallelism for MoE layers",
    "enable_lora": "LoRA adapters",
    "structured_outputs_config": "structured output (guided decoding)",
    "cpu_offload_gb": "CPU weight offloading",
}


def not_supported_yet(key: str) -> Optional[str]:
    """The refusal for a vLLM engine argument servetwin does not implement yet (None: not one of them)."""
    what = NOT_SUPPORTED_YET.get(key)
    return None if what is None else (f"vLLM's {key} ({what}) is not supported yet by servetwin "
                                      "(docs/unsupported.md lists what is not)")


def resolve_aliases(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with vLLM's alias names replaced by our field names; an alias and its field both
    given is an error naming both."""
    out = dict(kwargs)
    for alias, name in ENGINE_ARG_ALIASES.items():
        if alias in out:
            if name in out:
                raise ConfigError(alias, f"given together with {name!r}: both name one setting ({alias} is "
                                         f"vLLM's name for {name}); give one of them")
            out[name] = out.pop(alias)
    return out


# vLLM's defaults for the step's token budget and the running cap, by device and entry point
# (EngineArgs._set_default_args, the same from 0.11 to 0.33): a GPU with at least 70 GiB that is
# not an A100 gets the large set (an A100 regressed with it, vLLM PR #17885).
LARGE_GPU_MEMORY_BYTES = 70 * 2**30
VLLM_BATCH_DEFAULTS = {  # (large GPU, API server) -> (max_num_batched_tokens, max_num_seqs)
    (True, False): (16384, 1024), (True, True): (8192, 1024),
    (False, False): (8192, 256), (False, True): (2048, 256),
}


def vllm_default_batch_limits(device_name: str, device_memory_bytes: int, api_server: bool) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that vLLM picks on this GPU when neither is given:
    `api_server` for `vllm serve`, else the offline `LLM` class."""
    large = device_memory_bytes >= LARGE_GPU_MEMORY_BYTES and "a100" not in device_name.lower()
    return VLLM_BATCH_DEFAULTS[(large, bool(api_server))]


def apply_batch_defaults(kwargs: dict[str, Any], api_server: bool) -> dict[str, Any]:
    """Engine keyword arguments with `max_num_batched_tokens` / `max_num_seqs`, where left out, set to
    what vLLM picks on the backend's device (`ExecutorBackend.batch_defaults`: the simulator's GPU);
    unchanged where the backend has no such defaults. Without chunked prefill the budget stays
    EngineArgs' (>= max_model_len, as vLLM's)."""
    if "max_num_seqs" in kwargs and "max_num_batched_tokens" in kwargs:
        return kwargs
    name = kwargs.get("backend", next(f.default for f in fields(EngineArgs) if f.name == "backend"))
    if name not in registered_backends():
        return kwargs  # EngineArgs.from_kwargs names the bad backend
    limits = executor_backend(name).batch_defaults
    limits = limits(kwargs.get("hardware"), api_server) if limits is not None else None
    if limits is None:
        return kwargs
    tokens, seqs = limits
    out = dict(kwargs)
    out.setdefault("max_num_seqs", seqs)
    if "max_num_batched_tokens" not in out and out.get("enable_chunked_prefill", True):
        out["max_num_batched_tokens"] = max(tokens, out["max_num_seqs"])
    return out


def parse_acceptance_rates(raw: Any) -> list[float]:
    """`spec_acceptance_rates`: a list of probabilities, or "0.8,0.6" (a CLI flag)."""
    if isinstance(raw, str):
        try:
            raw = [float(x) for x in raw.split(",")]
        except ValueError:
            raise ConfigError("spec_acceptance_rates", f"must be comma-separated numbers, got {raw!r}") from None
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ConfigError("spec_acceptance_rates", f"must be a non-empty list of probabilities, got {raw!r}")
    for i, r in enumerate(raw):
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ConfigError(f"spec_acceptance_rates[{i}]", f"must be a probability in [0, 1], got {r!r}")
    return [float(r) for r in raw]


def check_kv_transfer_config(raw: Any, block_size: int) -> KVTransferConfig:
    """`kv_transfer_config` parsed, its connector class found and built once, so a bad name, module or
    `kv_connector_extra_config` value fails here naming `kv_transfer_config.<field>`."""
    config = KVTransferConfig.from_dict(raw)
    try:
        create_connector(config, block_size if isinstance(block_size, int) and block_size > 0 else 16)
    except ConfigError as e:
        raise e.within("kv_transfer_config") from None
    except (TypeError, ValueError) as e:  # a connector's own check of its extra config
        raise ConfigError("kv_transfer_config.kv_connector_extra_config", str(e)) from None
    return config


@dataclass(slots=True)
class EngineArgs:
    model: str = "tiny-llama"
    backend: str = "torch"  # a registered executor backend: "torch" | "sim" | "fake" | a plugin's
    tokenizer: Optional[str] = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: int = 128
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # "builtin": fast, for simulated runs (core/kv_cache/hashing.py)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    async_scheduling: bool = False
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    disable_hybrid_kv_cache_manager: bool = False
    enforce_eager: bool = False
    # simulator: vLLM's compilation_config.max_cudagraph_capture_size; None: vLLM's default,
    # min(2 * max_num_seqs, 512, max_num_batched_tokens)
    max_cudagraph_capture_size: Optional[int] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine-core processes behind the front end's load balancer
    max_logprobs: int = 20
    attention_backend: str = "auto"
    device: str = "auto"
    hardware: Optional[str] = None  # simulator: hardware preset or YAML path
    quantization: Optional[str] = None  # simulator: "fp8" weights (W8A8 where the device has fp8, else W8A16)
    kv_cache_dtype: str = "auto"  # simulator: "auto" (the model dtype) or "fp8"
    # simulator: vLLM's compilation_config.pass_config.fuse_allreduce_rms (off by default, as vLLM)
    fuse_allreduce_rms: bool = False
    # simulator: vLLM's --moe-backend for the routed experts ("auto": the hardware preset's kernel per format)
    moe_backend: str = "auto"
    multiprocess: bool = False
    profile_dir: Optional[str] = None
    # vLLM's speculative_config dict ({"method": "ngram", "num_speculative_tokens": 3, ...}); parsed
    # by from_kwargs into a SpeculativeConfig (core/sched/spec_decode.py)
    speculative_config: Optional[SpeculativeConfig] = None
    # simulator: per-position acceptance rates of the drafts (sim/spec_acceptance.py; None: the method's default)
    spec_acceptance_rates: Optional[list[float]] = None
    # vLLM's kv_transfer_config dict ({"kv_connector": "NixlConnector", "kv_role": "kv_consumer", ...});
    # parsed by from_kwargs into a KVTransferConfig (core/kv_connector/config.py)
    kv_transfer_config: Optional[KVTransferConfig] = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        kwargs = resolve_aliases(kwargs)
        allowed = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in allowed:
                if not_supported_yet(key):
                    raise ConfigError(f"{key}", not_supported_yet(key))
                close = difflib.get_close_matches(key, sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"{key}", f"unknown engine argument{hint}; allowed: {sorted(allowed)}")
        args = cls(**kwargs)
        if args.num_gpu_blocks_override is not None and args.num_gpu_blocks is None:
            args.num_gpu_blocks = args.num_gpu_blocks_override
        registered = registered_backends()
        if args.backend not in registered:
            raise ConfigError("backend", f"must be a registered executor backend "
                                         f"({', '.join(map(repr, registered)) or NO_BACKENDS}), got {args.backend!r}")
        if not isinstance(args.tensor_parallel_size, int) or args.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size", f"must be an integer >= 1, got {args.tensor_parallel_size!r}")
        if (not isinstance(args.pipeline_parallel_size, int) or isinstance(args.pipeline_parallel_size, bool)
                or args.pipeline_parallel_size < 1):
            raise ConfigError("pipeline_parallel_size", f"must be an integer >= 1, got {args.pipeline_parallel_size!r}")
        if (not isinstance(args.data_parallel_size, int) or isinstance(args.data_parallel_size, bool)
                or args.data_parallel_size < 1):
            raise ConfigError("data_parallel_size", f"must be an integer >= 1, got {args.data_parallel_size!r}")
        if not isinstance(args.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
            raise ConfigError("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {args.device!r}")
        if args.quantization not in (None, "fp8"):
            raise ConfigError("quantization", f"must be 'fp8' or null, got {args.quantization!r}")
        if args.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError("kv_cache_dtype", f"must be 'auto' or 'fp8', got {args.kv_cache_dtype!r}")
        if args.moe_backend not in MOE_BACKENDS:
            raise ConfigError("moe_backend", f"must be one of {', '.join(MOE_BACKENDS)}, got {args.moe_backend!r}")
        if (not isinstance(args.max_logprobs, int) or isinstance(args.max_logprobs, bool)
                or args.max_logprobs < -1):
            raise ConfigError("max_logprobs", f"must be an integer >= -1 (-1: no limit), got {args.max_logprobs!r}")
        if args.speculative_config is not None:
            args.speculative_config = SpeculativeConfig.from_dict(args.speculative_config)
            args.speculative_config.check(args.default_max_num_batched_tokens(args.max_model_len or 0),
                                          args.async_scheduling)
        if args.spec_acceptance_rates is not None:
            args.spec_acceptance_rates = parse_acceptance_rates(args.spec_acceptance_rates)
        if args.kv_transfer_config is not None:
            args.kv_transfer_config = check_kv_transfer_config(args.kv_transfer_config, args.block_size)
        if args.num_gpu_blocks_override is not None:
            CacheConfig(num_gpu_blocks=args.num_gpu_blocks_override)  # raises naming num_gpu_blocks
        # the KV-cache settings fail here, before any executor divides by a zero block size or
        # reports a bad block count as "no available memory"
        args.cache_config()
        return args

    def default_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        base = max(8192, self.max_num_seqs)
        return base if self.enable_chunked_prefill else max(base, max_model_len)

    def cache_config(self, num_gpu_blocks: Optional[int] = None,
                     kv_cache_groups: Optional[tuple] = None) -> CacheConfig:
        """`kv_cache_groups`: the model's groups, from its executor (None: one full-attention group)."""
        return CacheConfig(block_size=self.block_size,
                           num_gpu_blocks=num_gpu_blocks if num_gpu_blocks is not None else self.num_gpu_blocks,
                           enable_prefix_caching=self.enable_prefix_caching,
                           prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                           kv_cache_groups=kv_cache_groups)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=self.default_max_num_batched_tokens(max_model_len),
            max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold, policy=self.policy,
            async_scheduling=self.async_scheduling, pipeline_parallel_size=self.pipeline_parallel_size,
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl, watermark=self.watermark)


# The values an argument takes, where they are a fixed set (`servetwin serve` offers them as choices)
FIELD_CHOICES: dict[str, tuple[str, ...]] = {"policy": ("fcfs", "priority"), "kv_cache_dtype": ("auto", "fp8"),
                                             "prefix_caching_hash_algo": HASH_ALGOS,
                                             "quantization": ("fp8",),
                                             "attention_backend": ("auto", "torch-paged", "flash-attn"),
                                             "moe_backend": MOE_BACKENDS}

# One line per engine argument for `servetwin serve --help` (vLLM's meaning; servetwin's additions say so).
FIELD_HELP: dict[str, str] = {
    "tokenizer": "tokenizer name or path (default: the model's; 'toy': the built-in toy tokenizer)",
    "skip_tokenizer_init": "no tokenizer: prompts must be token ids, outputs carry no text",
    "dtype": "weights and activations dtype: auto, float32, bfloat16, float16",
    "seed": "random seed of the sampler",
    "block_size": "tokens per KV-cache block",
    "max_num_batched_tokens": "token budget of one step (default on a simulated GPU: vLLM's for that GPU, 8192 "
                              "for vllm serve on an H100/H200, 2048 on an A100/L40S; else max(8192, max_num_seqs); "
                              "without chunked prefill also >= max_model_len)",
    "max_num_seqs": "most requests running at once (default on a simulated GPU: vLLM's, 1024 on an H100/H200, "
                    "256 on an A100/L40S; else 128)",
    "max_model_len": "longest prompt + output in tokens (default: the model's max_position_embeddings)",
    "enable_prefix_caching": "reuse the KV blocks of identical prompt prefixes",
    "prefix_caching_hash_algo": "prefix-cache block hash: sha256 (default), sha256_cbor, xxhash, xxhash_cbor "
                                "(vLLM's), or builtin (servetwin's fast 64-bit hash for simulated runs)",
    "enable_chunked_prefill": "split long prompts over several steps, mixed with decodes",
    "long_prefill_token_threshold": "cap on the prompt tokens one request gets per step (0: no cap)",
    "policy": "scheduling policy: fcfs or priority (vLLM's --scheduling-policy; give one of the two)",
    "async_scheduling": "schedule step n+1 while step n runs (vLLM's async scheduling)",
    "scheduler_reserve_full_isl": "admit a request only if its whole prompt fits the free KV blocks",
    "watermark": "share of KV blocks kept free when admitting new requests",
    "gpu_memory_utilization": "share of device memory for weights, activations and KV cache (vLLM: 0.9)",
    "num_gpu_blocks": "KV-cache blocks, instead of sizing from memory (vLLM's --num-gpu-blocks-override)",
    "num_gpu_blocks_override": "KV-cache blocks, instead of sizing from memory",
    "kv_cache_memory_bytes": "bytes for the KV cache, instead of gpu_memory_utilization",
    "disable_hybrid_kv_cache_manager": "one full-attention KV cache group even for sliding-window / chunked "
                                       "local layers (vLLM's --disable-hybrid-kv-cache-manager)",
    "enforce_eager": "no CUDA graphs",
    "max_cudagraph_capture_size": "simulator: largest CUDA-graph capture size; steps up to it are padded to the "
                                  "next size (vLLM's --max-cudagraph-capture-size; default min(2 x max_num_seqs, "
                                  "512, max_num_batched_tokens))",
    "tensor_parallel_size": "devices one model is split over (the simulator models the communication; the torch "
                            "backend runs one worker process per rank: gloo on the CPU, NCCL on CUDA)",
    "pipeline_parallel_size": "pipeline stages the model's layers are split over (vLLM's layer partition); the "
                              "engine keeps that many batches in flight (torch backend: one worker per stage)",
    "data_parallel_size": "engine-core processes (DP ranks, each with its own tensor_parallel_size workers); the "
                          "front end routes each request with vLLM's internal load balancer",
    "max_logprobs": "most logprobs a request may ask for (-1: no limit)",
    "attention_backend": "attention kernel: auto, torch-paged, flash-attn",
    "device": "torch device: auto, cpu, cuda, cuda:N",
    "hardware": "simulator: a hardware preset (`servetwin presets`) or a hardware YAML",
    "quantization": "simulator: fp8 weights (W8A8 where the device has fp8, else W8A16); default: the model dtype",
    "kv_cache_dtype": "simulator: KV-cache dtype, auto (the model dtype) or fp8",
    "fuse_allreduce_rms": "simulator: vLLM's fused all-reduce + residual add + RMSNorm (compilation_config."
                          "pass_config.fuse_allreduce_rms; 0.11: enable_fi_allreduce_fusion), TP > 1 on Hopper/Blackwell",
    "moe_backend": "simulator: the routed experts' kernel, vLLM's --moe-backend: auto (the hardware preset's kernel "
                   "for the experts' format), marlin, triton (vLLM's default for MXFP4 on Hopper)",
    "speculative_config": "speculative decoding, vLLM's JSON: {\"method\": \"ngram\"|\"draft_model\"|\"eagle\"|"
                          "\"mtp\", \"num_speculative_tokens\": k, \"prompt_lookup_min\"/\"prompt_lookup_max\" (ngram), "
                          "\"model\" (draft_model)}",
    "spec_acceptance_rates": "simulator: acceptance rate of draft position 0, 1, ... given the ones before "
                             "accepted, the last repeating (e.g. 0.8,0.6; default: the method's, sim/spec_acceptance.py)",
    "kv_transfer_config": "KV connector, vLLM's JSON: {\"kv_connector\": \"NixlConnector\"|\"OffloadingConnector\"|"
                          "a plugin's class, \"kv_role\": \"kv_producer\"|\"kv_consumer\"|\"kv_both\", "
                          "\"kv_load_failure_policy\": \"fail\"|\"recompute\", \"kv_connector_extra_config\": {...}, "
                          "\"kv_connector_module_path\": module} (docs/kv_connectors.md)",
    "profile_dir": "torch backend: write a torch.profiler chrome trace and per-step timings here",
}
