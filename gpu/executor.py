"""`TorchExecutor`: the real backend behind `servetwin.core.engine.executor.Executor`.

One `execute_model(scheduler_output)` = RunnerState update -> flattened inputs (prefill chunks and
decodes together) -> one forward over the paged KV cache -> logits at each request's last scheduled
token -> sampler for the rows whose chunk reaches their last known token. Decode-only batches replay
a CUDA graph on CUDA unless `enforce_eager`.

With `tp` (a `TPGroup` of size > 1) this executor is one tensor-parallel rank inside a
`servetwin.gpu.multiproc_executor` worker: it holds that rank's model shard and a KV pool of its own KV
heads, and runs the same steps as every other rank (the collectives inside the model keep them in step).
"""
from __future__ import annotations

from servetwin.core.config_error import ConfigError
import dataclasses
import logging
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from servetwin.core.kv_cache.kv_cache_planning import model_kv_plan
from servetwin.core.kv_cache.kv_sizing import KVCacheSpec, kv_heads_per_rank
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.gpu.models.model_files import check_max_model_len
from servetwin.core.outputs import Logprobs, ModelRunnerOutput, StepTiming
from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.engine.runner_state import RunnerState, ScheduledRow
from servetwin.gpu.attention import CommonAttentionMetadata, select_attention_backend
from servetwin.gpu.attention.layer_plans import build_layer_metadata
from servetwin.gpu.cuda_graphs import CudaGraphRunner, default_capture_sizes
from servetwin.gpu.input_batch import InputBatch, build_block_table, prepare_inputs, to_device
from servetwin.gpu.kv_connector.factory import create_connector_worker
from servetwin.gpu.kv_cache import allocate_kv_caches, cpu_num_blocks, cuda_num_blocks
from servetwin.gpu.loader import load_model
from servetwin.gpu.models.registry import ModelInfo, load_tokenizer, resolve_model
from servetwin.gpu.models.tp_shard import check_tensor_parallel
from servetwin.gpu.parallel_state import PPGroup, TPGroup, pp_layer_range
from servetwin.gpu.step_profiling import StepProfiler, StepTimer, step_annotation
from servetwin.gpu.step_sampler import StepSampler
from servetwin.core.sched.spec_decode import DraftTokenIds, SpeculativeConfig
from servetwin.gpu.spec_decode import make_drafter
from servetwin.gpu.spec_decode.verify import draft_positions, first_positions, verify_rows

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "'cuda' requested but torch.cuda.is_available() is False")
    return dev


def resolve_dtype(dtype: Optional[str | torch.dtype], device: torch.device, hf_config: Any) -> torch.dtype:
    """None / "auto": float32 on the CPU; on CUDA the checkpoint's dtype when it is 16-bit, else
    bfloat16 (vLLM's rule for float32 checkpoints). Otherwise the named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        cfg = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "")
        ckpt = _DTYPES.get(cfg.replace("torch.", ""))
        return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16
    try:
        return _DTYPES[str(dtype)]
    except KeyError:
        raise ConfigError("dtype", f"unknown dtype {dtype!r} (allowed: {sorted(_DTYPES)} or 'auto')") from None


def cpu_has_native_bf16() -> Optional[bool]:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX in /proc/cpuinfo's flags); None
    when that cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        return None
    return None


def slow_cpu_dtype_warning(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """The warning for bfloat16 on a CPU without native bfloat16, else None: there every bf16 matmul is
    emulated (one 256x576 @ 576x1536 product took 372 ms against 6.6 ms in float32 on the AVX2 AMD EPYC
    test machine, one thread), so a run that takes a minute in float32 takes an hour."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cpu_has_native_bf16() is not False:
        return None
    return ("dtype bfloat16 on a CPU without native bfloat16 (no AVX512-BF16 / AMX): matmuls run ~50x slower "
            "than in float32 here; use dtype float32 (e.g. --set engine.dtype=float32 with "
            "experiments/calibrations/cpu_smollm2-135m-fp32-avx2.yaml)")


def cuda_graph_unsupported_reason(cfg: Any) -> Optional[str]:
    """Why decode steps of this model cannot replay a captured CUDA graph (None: they can)."""
    if cfg.moe is not None:
        return "the MoE layers dispatch to a data-dependent set of experts"
    if not cfg.all_full_attention:
        return "sliding-window / chunked layers plan per-request key windows on the host"
    return None


def tensor_parallel_widths(cfg: Any) -> tuple[int, ...]:
    """The MLP widths tensor parallelism splits (dense, and the experts')."""
    return (cfg.intermediate_size,) + (() if cfg.moe is None else (cfg.moe.intermediate_size,))


@dataclasses.dataclass(frozen=True, slots=True)
class _StageLayers:
    """The layers of one pipeline stage, as `model_kv_plan` reads a model (all full attention)."""
    num_layers: int


class TorchExecutor:
    def __init__(self, model: str = "tiny-llama", dtype: Optional[str] = None, device: str = "auto",
                 block_size: int = 16, num_gpu_blocks: Optional[int] = None,
                 kv_cache_memory_bytes: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 128,
                 max_model_len: Optional[int] = None, enforce_eager: bool = False,
                 attention_backend: str = "auto", seed: int = 0, profile_dir: Optional[str] = None,
                 torch_paged_mode: str = "auto", cuda_graph_sizes: Optional[list[int]] = None,
                 keep_logits: bool = False, disable_hybrid_kv_cache_manager: bool = False,
                 async_scheduling: bool = False, tp: Optional[TPGroup] = None, pp: Optional[PPGroup] = None,
                 model_info: Optional[ModelInfo] = None,
                 speculative_config: Optional[SpeculativeConfig] = None,
                 kv_transfer_config: Optional[KVTransferConfig] = None) -> None:
        torch.manual_seed(seed)
        self.device = resolve_device(device)
        self.model_info: ModelInfo = model_info or resolve_model(model)
        self.tp = tp or TPGroup()
        self.pp = pp or PPGroup()
        self.dtype = resolve_dtype(dtype, self.device, self.model_info.hf_config)
        if (warning := slow_cpu_dtype_warning(self.device, self.dtype)) is not None:
            logger.warning(warning)
        self.block_size = block_size
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        cfg = self.model_info.decoder_config
        derived_max_len = cfg.max_position_embeddings
        check_max_model_len(max_model_len, derived_max_len)
        want_len = derived_max_len if max_model_len in (None, -1) else max_model_len
        check_tensor_parallel(cfg.num_heads, cfg.num_kv_heads, tensor_parallel_widths(cfg), self.tp.world_size)
        self.model = load_model(self.model_info, self.dtype, self.device, max_positions=want_len,
                                tp=self.tp if self.tp.world_size > 1 else None)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(self.model_info.eos_token_ids)
        # KV cache groups from the layers' attention types; a pool block = one page of `group_size` layers
        self.kv_plan = model_kv_plan(cfg, disable_hybrid_kv_cache_manager)
        self.kv_cache_groups = self.kv_plan.scheduler_groups
        num_layers = self._keep_pipeline_stage(cfg.num_layers)
        # this rank's KV heads (core's rule, so the simulator's pool and this one agree)
        local_kv_heads = kv_heads_per_rank(cfg.num_kv_heads, self.tp.world_size)
        self.kv_spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=local_kv_heads,
                                   head_size=cfg.head_dim, dtype=str(self.dtype).replace("torch.", ""),
                                   block_size=block_size)
        pool_spec = dataclasses.replace(self.kv_spec, num_layers=self.kv_plan.group_size)
        self.attn_backend = select_attention_backend(attention_backend, self.device, self.dtype, block_size,
                                                     cfg.head_dim, cfg.num_heads // self.tp.world_size,
                                                     local_kv_heads,
                                                     torch_paged_mode, cfg.attention_sinks,
                                                     any(w.chunk_size for w in cfg.layer_windows))
        self.model.set_attention_backend(self.attn_backend)
        if self.device.type == "cuda":
            n = cuda_num_blocks(pool_spec, num_gpu_blocks, kv_cache_memory_bytes, self.device,
                                gpu_memory_utilization,
                                lambda: self._dummy_forward(min(max_num_batched_tokens, want_len)))
        else:
            n = cpu_num_blocks(pool_spec, num_gpu_blocks, kv_cache_memory_bytes)
        # every rank's pool as large as the smallest (vLLM takes the minimum too)
        n = self.pp.min_int(self.tp.min_int(n))
        self.max_model_len = self.kv_plan.fit_max_model_len(
            n, self.kv_spec, -1 if max_model_len == -1 else want_len, derived_max_len,
            max_num_batched_tokens * (2 if async_scheduling else 1))
        self.num_gpu_blocks = n
        self.pad_block_id = n  # the extra block past the scheduler's pool
        self.kv_caches = allocate_kv_caches(self.kv_spec, n, self.dtype, self.device,
                                            None if self.kv_cache_groups is None else self.kv_plan.layer_to_group)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s), max_model_len %d, %d KV cache group(s)",
                    n, block_size, n * pool_spec.bytes_per_block / 2**20, self.kv_spec.dtype, self.max_model_len,
                    len(self.kv_plan.kv_cache_groups))
        # a KV connector's worker side; `kv_transfer_config` (pool's kv_bytes_per_block filled in) is
        # what EngineCore builds the scheduler's connector from
        self.kv_bytes_per_block = pool_spec.bytes_per_block
        self.kv_transfer_config, self.kv_connector_worker = create_connector_worker(
            kv_transfer_config, self.kv_caches, self.kv_bytes_per_block)
        self.graph_runner: Optional[CudaGraphRunner] = None
        reason = cuda_graph_unsupported_reason(cfg) or (
            None if self.kv_cache_groups is None else "a CUDA graph captures one block table, not one per KV cache group"
        ) or ("tensor parallelism: the graphs would capture the NCCL collectives (not done here)"
              if self.tp.world_size > 1 else None) or (
            "pipeline parallelism: a stage's graph would capture its sends" if self.pp.world_size > 1 else None)
        if self.device.type == "cuda" and not enforce_eager and reason:
            logger.info("CUDA graphs off: %s", reason)
        elif self.device.type == "cuda" and not enforce_eager:
            sizes = cuda_graph_sizes or default_capture_sizes(max_num_seqs)
            self.graph_runner = CudaGraphRunner(self.model, self.attn_backend, self.kv_caches, block_size,
                                                self.pad_block_id, self.max_model_len, self.device, sizes)
            self.graph_runner.capture()
        self.state = RunnerState()
        self.sampler = StepSampler(self.device, self.vocab_size)
        self._init_drafter(speculative_config, async_scheduling, seed)
        self.profiler = StepProfiler(profile_dir, self.device)
        self.keep_logits = keep_logits
        self.last_logits: dict[str, torch.Tensor] = {}
        self._tokenizer: Any = None
        # called after every step with (scheduler_output, model_output); e.g. `servetwin compare` reads
        # each step's `timing.cpu_s` to tell a contended core from a slow step
        self.step_observers: list[Callable[[SchedulerOutput, ModelRunnerOutput], None]] = []

    def _keep_pipeline_stage(self, num_layers: int) -> int:
        """At PP > 1 keep this stage's layers (vLLM's `get_pp_indices`); the layers this rank runs."""
        if self.pp.world_size == 1:
            return num_layers
        if self.kv_cache_groups is not None:
            raise ConfigError("pipeline_parallel_size", "pipeline parallelism of a model with several KV cache "
                                                        "groups (sliding-window / chunked layers) is not supported")
        if num_layers < self.pp.world_size:
            raise ConfigError("pipeline_parallel_size", f"{self.pp.world_size} stages for {num_layers} layers")
        start, end = pp_layer_range(num_layers, self.pp.rank, self.pp.world_size)
        self.model.keep_pipeline_stage(start, end, self.pp.is_first_rank, self.pp.is_last_rank)
        self.kv_plan = model_kv_plan(_StageLayers(end - start))
        return end - start

    def _init_drafter(self, config: Optional[SpeculativeConfig], async_scheduling: bool, seed: int) -> None:
        """Speculative decoding: the drafter, and the generator of the rejection sampler's draws."""
        self.drafter = None if config is None else make_drafter(config, self.vocab_size, self.max_model_len,
                                                                self.device, self.dtype)
        if config is not None and async_scheduling:
            raise ConfigError("async_scheduling", "the torch backend drafts after each step (sync scheduling "
                                                  "only); turn async_scheduling off with speculative_config")
        self.spec_generator = torch.Generator(self.device).manual_seed(seed)
        self._draft_token_ids: Optional[DraftTokenIds] = None

    def take_draft_token_ids(self) -> Optional[DraftTokenIds]:
        """The drafts for the requests of the step just executed (vLLM's executor method)."""
        drafts, self._draft_token_ids = self._draft_token_ids, None
        return drafts

    def _propose(self, rows: list[ScheduledRow], sampled: list[list[int]]) -> None:
        """vLLM's drafter runs after sampling, for the rows that sampled (a partial prefill gets [])."""
        live = [i for i, toks in enumerate(sampled) if toks]
        drafts = self.drafter.propose([rows[i].state.token_ids for i in live])
        per_row: list[list[int]] = [[] for _ in rows]
        for i, d in zip(live, drafts):
            per_row[i] = d
        self._draft_token_ids = DraftTokenIds([r.req_id for r in rows], per_row)

    # -- public helpers ------------------------------------------------------------------------
    @property
    def attention_backend_name(self) -> str:
        return self.attn_backend.name

    @property
    def is_moe(self) -> bool:
        """Routed experts in some layer: the model's data-parallel ranks step in lockstep."""
        return self.model_info.decoder_config.moe is not None

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """One forward of a single token on a throwaway cache (vLLM's `execute_dummy_batch`): the step an
        idle MoE data-parallel rank runs so that its peers' collectives have a partner."""
        self._dummy_forward(1)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parameters this process holds (a tensor-parallel rank: its shard; tied once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of this process's KV pool (distinct tensors: KV cache groups share theirs)."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for kv in self.kv_caches for t in kv}
        return sum(seen.values())

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_info)
        return self._tokenizer

    def close(self) -> None:
        """Write the chrome trace (when `profile_dir` is set); stop a KV connector's worker side."""
        self.profiler.close()
        if self.kv_connector_worker is not None:
            self.kv_connector_worker.close()

    # -- vLLM's /start_profile and /stop_profile --------------------------------------------------
    def start_profile(self, profile_dir: str) -> None:
        self.profiler.start(profile_dir)

    def stop_profile(self) -> Optional[str]:
        """Write the steps since `start_profile` as `<dir>/servetwin-torch.<ms>.pt.trace.json` (None: not on)."""
        path = self.profiler.stop(f"servetwin-torch.{time.time_ns() // 1_000_000}.pt.trace.json")
        return None if path is None else str(path)

    def kept_logits(self) -> dict[str, torch.Tensor]:
        """The last step's logits per request (with `keep_logits`): a method, so that
        `MultiprocExecutor.collective_rpc("kept_logits")` fetches rank 0's."""
        return self.last_logits

    def reset(self) -> None:
        """Forget every request (a new engine over this executor starts from an empty runner state)."""
        self.sampler.forget(list(self.state.requests))
        self.state = RunnerState()
        self._draft_token_ids = None

    # -- one step ------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        cpu0 = time.process_time()
        self.sampler.forget(list(so.finished_req_ids))
        rows = self.state.update(so)
        connector_meta = so.kv_connector_metadata if self.kv_connector_worker is not None else None
        if connector_meta is not None:
            self.kv_connector_worker.before_forward(connector_meta)
        if not rows:
            out = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                    timing=StepTiming(duration_s=0.0))
        else:
            new_ids = {r.req_id for r in so.scheduled_new_reqs}
            with self.profiler.step(step_annotation(rows, new_ids)), torch.inference_mode():
                out = self._execute(rows, so)
        if connector_meta is not None:
            out.kv_connector_output = self.kv_connector_worker.after_forward()
        out.timing.cpu_s = time.process_time() - cpu0
        for observe in self.step_observers:
            observe(so, out)
        return out

    def _attention_metadata(self, batch: InputBatch) -> Any:
        """The plan of every layer (`build_layer_metadata`): each KV cache group has its own block table
        and slot mapping (one group: the batch's own), each layer reads its group's, with its window."""
        dev = self.device
        qsl, seq_lens = to_device(batch.query_start_loc, dev), to_device(batch.seq_lens, dev)  # every group's
        commons = [CommonAttentionMetadata(
            num_reqs=batch.num_reqs, num_actual_tokens=batch.num_tokens, max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len, block_size=self.block_size, query_start_loc=qsl, seq_lens=seq_lens,
            block_table=to_device(table, dev), slot_mapping=to_device(slots, dev),
            query_start_loc_cpu=batch.query_start_loc, seq_lens_cpu=batch.seq_lens)
            for table, slots in zip(batch.block_tables, batch.slot_mappings)]
        layer_group = None if self.kv_cache_groups is None else self.kv_plan.layer_to_group
        return build_layer_metadata(self.attn_backend, commons, self.model.layer_windows, layer_group)

    def _execute(self, rows: list[ScheduledRow], so: SchedulerOutput) -> ModelRunnerOutput:
        timer = StepTimer(self.device)
        timer.mark()
        batch = prepare_inputs(rows, self.block_size, self.pad_block_id)
        if self.drafter is not None:  # rows whose drafts go unverified sample before them
            batch.logits_indices = first_positions(rows, batch.logits_indices)
        input_ids = to_device(batch.input_ids, self.device)
        positions = to_device(batch.positions, self.device)
        use_graph = self.graph_runner is not None and self.graph_runner.can_run(batch)
        if not use_graph:
            attn_meta = self._attention_metadata(batch)
        sample_idx = [i for i, r in enumerate(rows) if r.samples]
        # LM-head rows: every request's last token with keep_logits (tests read them all), else only
        # the requests that sample this step (a partial prefill chunk needs no logits)
        logit_rows = list(range(len(rows))) if self.keep_logits else sample_idx
        timer.mark()
        if use_graph:
            hidden, padded = self.graph_runner.run(batch, input_ids, positions)
            last_hidden = hidden if len(logit_rows) == len(rows) else hidden[torch.tensor(logit_rows, device=self.device)]
        else:
            hidden = self._stage_forward(batch, input_ids, positions, attn_meta)
            if not self.pp.is_last_rank:  # the last stage samples; this one's output went on
                timer.mark()
                timer.mark()
                return ModelRunnerOutput(req_ids=batch.req_ids, req_id_to_index={}, sampled_token_ids=[],
                                         timing=timer.timing(batch.num_tokens))
            padded = batch.num_tokens
            if len(logit_rows) == len(rows) == batch.num_tokens:  # one token per row: every token's hidden
                last_hidden = hidden
            else:
                idx = batch.logits_indices if len(logit_rows) == len(rows) else batch.logits_indices[logit_rows]
                last_hidden = hidden[to_device(idx, self.device)] if len(idx) else None
        logits = self.model.compute_logits(last_hidden) if last_hidden is not None else None
        timer.mark()

        sampled = [[] for _ in rows]
        logprobs: Optional[list[Optional[list[Logprobs]]]] = None
        if sample_idx:
            assert logits is not None
            sel = (logits if len(logit_rows) == len(sample_idx)
                   else logits[torch.tensor(sample_idx, device=self.device)])
            tokens, lps = self.sampler.sample([rows[i] for i in sample_idx], sel)
            if lps is not None and any(lp is not None for lp in lps):
                logprobs = [None] * len(rows)
                for j, i in enumerate(sample_idx):
                    logprobs[i] = None if lps[j] is None else [lps[j]]
            if any(rows[i].spec_token_ids for i in sample_idx):  # the verify step
                pos = draft_positions(rows, sample_idx, batch.logits_indices)
                draft_logits = self.model.compute_logits(hidden[torch.tensor(pos, device=self.device)]) if pos else None
                tokens = verify_rows(rows, sample_idx, tokens, draft_logits, self.spec_generator)
            else:
                tokens = [[t] for t in tokens]
            for j, i in enumerate(sample_idx):
                sampled[i] = tokens[j]
        prompt_logprobs = self._prompt_logprobs(rows, batch, hidden, so) if not use_graph else {}
        timer.mark()
        timing = timer.timing(padded)

        if self.keep_logits:
            self.last_logits = {r.req_id: logits[i].detach().float().cpu() for i, r in enumerate(rows)}
        for r, toks in zip(rows, sampled):
            if toks:
                self.state.append_sampled(r.req_id, toks)
        if self.drafter is not None:
            self._propose(rows, sampled)
        req_ids = batch.req_ids
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                 sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs_dict=prompt_logprobs, timing=timing)

    def _stage_forward(self, batch: InputBatch, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn_meta: Any) -> torch.Tensor:
        """This rank's layers: a later pipeline stage starts from the previous stage's hidden states
        (received, [tokens, hidden]); a stage before the last sends its output on."""
        intermediate = None
        if not self.pp.is_first_rank:
            shape = (batch.num_tokens, self.model_info.decoder_config.hidden_size)
            intermediate = self.pp.recv_prev(shape, self.dtype, self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, attn_meta, intermediate)
        if not self.pp.is_last_rank:
            self.pp.send_next(hidden)
        return hidden

    def _prompt_logprobs(self, rows: list[ScheduledRow], batch: InputBatch, hidden: torch.Tensor,
                         so: SchedulerOutput) -> dict[str, list[Optional[Logprobs]]]:
        out: dict[str, list[Optional[Logprobs]]] = {}
        resumed = so.scheduled_cached_reqs.resumed_req_ids
        qsl = batch.query_start_loc
        for i, r in enumerate(rows):
            if r.req_id in resumed or not self.sampler.wants_prompt_logprobs(r):
                continue
            chunk_logits = self.model.compute_logits(hidden[int(qsl[i]):int(qsl[i + 1])])
            out[r.req_id] = self.sampler.prompt_logprobs(r, chunk_logits)
        return out

    # -- memory profiling (CUDA) ---------------------------------------------------------------
    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> None:
        """One forward of `num_tokens` tokens (one request) on a throwaway cache, plus the logits of
        `max_num_seqs` rows: the activation peak the KV budget must leave room for."""
        B, dev = self.block_size, self.device
        nb = -(-num_tokens // B)
        spec = self.kv_spec
        caches = allocate_kv_caches(spec, nb, self.dtype, dev)
        positions = np.arange(num_tokens, dtype=np.int64)
        block_table = build_block_table([list(range(nb))], np.array([nb]), nb)
        qsl = np.array([0, num_tokens], dtype=np.int32)
        seq_lens = np.array([num_tokens], dtype=np.int32)
        common = CommonAttentionMetadata(
            num_reqs=1, num_actual_tokens=num_tokens, max_query_len=num_tokens, max_seq_len=num_tokens,
            block_size=B, query_start_loc=to_device(qsl, dev), seq_lens=to_device(seq_lens, dev),
            block_table=to_device(block_table, dev), slot_mapping=to_device(positions, dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        meta = build_layer_metadata(self.attn_backend, [common], self.model.layer_windows)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        intermediate = None if self.pp.is_first_rank else torch.zeros(
            num_tokens, self.model_info.decoder_config.hidden_size, dtype=self.dtype, device=dev)
        hidden = self.model(ids, to_device(positions, dev), caches, meta, intermediate)
        if not self.pp.is_last_rank:
            del caches, hidden
            return
        idx = torch.arange(min(self.max_num_seqs, num_tokens), device=dev)
        logits = self.model.compute_logits(hidden[idx])
        torch.softmax(logits, dim=-1)
        del caches, hidden, logits
