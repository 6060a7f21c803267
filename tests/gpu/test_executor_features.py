"""TorchExecutor: KV sizing, timing, step annotations and the profiler trace, logprobs, seeds."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from servetwin.core.engine.executor import Executor, make_executor
from servetwin.core.kv_cache.kv_sizing import KVCacheSpec
from servetwin.core.sched.output import CachedRequestData, NewRequestData
from servetwin.core.engine.runner_state import CachedRequestState, ScheduledRow
from servetwin.core.sampling_params import SamplingParams
from servetwin.gpu.executor import TorchExecutor
from servetwin.gpu.models.registry import resolve_model
from servetwin.gpu.step_profiling import step_annotation
from backend_helpers import GREEDY, HFOracle, step


def ex_(**kw) -> TorchExecutor:
    kw.setdefault("num_gpu_blocks", 32)
    kw.setdefault("max_model_len", 256)
    return TorchExecutor(kw.pop("model", "tiny-llama"), device="cpu", **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def test_is_an_executor_with_public_numbers():
    ex = make_executor("torch", model="tiny-qwen3", device="cpu", num_gpu_blocks=16, max_model_len=128)
    assert isinstance(ex, Executor) and isinstance(ex, TorchExecutor)
    assert (ex.num_gpu_blocks, ex.max_model_len, ex.vocab_size, ex.eos_token_ids) == (16, 128, 320, [2])
    assert ex.kv_spec == KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=16, dtype="float32", block_size=16)
    assert ex.dtype == torch.float32 and ex.attention_backend_name == "torch-paged"
    assert len(ex.kv_caches) == 2 and ex.kv_caches[0][0].shape == (17, 16, 2, 16)  # + the pad block


def test_kv_sizing_from_budget_and_auto_fit():
    spec_bytes = 2 * 16 * 2 * 16 * 2 * 4  # layers * (K+V) * block * kv heads * head dim * fp32
    ex = ex_(num_gpu_blocks=None, kv_cache_memory_bytes=10 * spec_bytes + 5, max_model_len=-1)
    assert ex.num_gpu_blocks == 10 and ex.max_model_len == 9 * 16  # auto-fit: null block reserved
    default = ex_(num_gpu_blocks=None, max_model_len=None)  # 512 MiB CPU budget
    assert default.num_gpu_blocks == 512 * 2**20 // spec_bytes and default.max_model_len == 4096
    with pytest.raises(ValueError, match="largest max_model_len that fits is 144"):
        ex_(num_gpu_blocks=10, max_model_len=1000)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ex_(max_model_len=10_000)


def test_timing_and_empty_step():
    ex = ex_()
    out = ex.execute_model(step(0, new=[NewRequestData("a", prompt(20), GREEDY, ([1, 2],), 0)],
                                num_scheduled={"a": 20}))
    t = out.timing
    assert t.duration_s > 0 and t.forward_s > 0 and t.prepare_s > 0 and t.sample_s > 0
    assert t.duration_s == pytest.approx(t.prepare_s + t.forward_s + t.sample_s)
    assert t.padded_batch_size == 20
    empty = ex.execute_model(step(1, finished=["a"]))
    assert empty.req_ids == [] and empty.timing.duration_s == 0.0 and "a" not in ex.state.requests


def test_step_annotation_context_vs_generation():
    def row(rid, n_prompt, n_out, sched):
        st = CachedRequestState(rid, list(range(n_prompt + n_out)), n_prompt, ([1],), None)
        return ScheduledRow(rid, st, 0, sched)
    rows = [row("new", 10, 0, 10), row("chunk2", 30, 0, 8), row("dec", 5, 3, 1), row("resumed", 5, 2, 7)]
    assert step_annotation(rows, {"new"}) == "execute_context_2(18)_generation_2(8)"


def test_profile_dir_writes_chrome_trace(tmp_path):
    ex = ex_(profile_dir=str(tmp_path))
    ex.execute_model(step(0, new=[NewRequestData("a", prompt(9), GREEDY, ([1],), 0)], num_scheduled={"a": 9}))
    ex.execute_model(step(1, cached=CachedRequestData(["a"], [None], [9], [1]), num_scheduled={"a": 1}))
    ex.close()
    names = {e.get("name") for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]}
    assert "execute_context_1(9)_generation_0(0)" in names
    assert "execute_context_0(0)_generation_1(1)" in names


def test_logprobs_and_prompt_logprobs_match_hf():
    ex = ex_()
    orc = HFOracle(resolve_model("tiny-llama").path)
    p = prompt(21, 3)
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    out1 = ex.execute_model(step(0, new=[NewRequestData("a", p, sp, ([4, 5],), 0)], num_scheduled={"a": 12}))
    out2 = ex.execute_model(step(1, cached=CachedRequestData(["a"], [None], [12], [0]), num_scheduled={"a": 9}))
    ref = torch.log_softmax(orc.all_logits(p), dim=-1)
    plp = out1.prompt_logprobs_dict["a"] + out2.prompt_logprobs_dict["a"]
    assert len(plp) == len(p) and plp[0] is None
    for t in range(1, len(p)):
        e = plp[t]
        assert e.token_ids[0] == p[t]
        assert e.logprobs[0] == pytest.approx(ref[t - 1, p[t]].item(), abs=1e-4)
        top = ref[t - 1].topk(2).indices.tolist()
        assert [tok for tok in e.token_ids[1:]] == [tok for tok in top if tok != p[t]][:len(e.token_ids) - 1]
    assert out1.logprobs is None and out1.sampled_token_ids == [[]]
    (lp,) = out2.logprobs[0]
    tok = out2.sampled_token_ids[0][0]
    assert lp.token_ids[0] == tok == int(ref[-1].argmax()) and lp.sampled_rank == 1
    assert lp.logprobs[0] == pytest.approx(ref[-1, tok].item(), abs=1e-4)
    assert len(lp.token_ids) == 3  # the sampled token is the top-1: top-3 without repeating it


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours():
    def run(with_neighbour: bool) -> list[int]:
        ex = ex_()
        sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=8)
        new = [NewRequestData("s", prompt(7), sp, ([1],), 0)]
        sched = {"s": 7}
        if with_neighbour:
            new.append(NewRequestData("n", prompt(5, 9), SamplingParams(temperature=1.0, max_tokens=8), ([2],), 0))
            sched["n"] = 5
        toks = []
        out = ex.execute_model(step(0, new=new, num_scheduled=sched))
        toks += out.sampled_token_ids[0]
        for s in range(1, 6):
            ids = list(sched)
            cached = CachedRequestData(ids, [None] * len(ids), [ex.state.requests[i].num_computed_tokens for i in ids],
                                       [s] * len(ids))
            out = ex.execute_model(step(s, cached=cached, num_scheduled={i: 1 for i in ids}))
            toks += out.sampled_token_ids[0]
        return toks
    a, b, c = run(False), run(False), run(True)
    assert a == b == c and len(a) == 6 and len(set(a)) > 1


def test_dtype_resolution():
    from types import SimpleNamespace
    from servetwin.gpu.executor import resolve_dtype
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fp32, bf16 = SimpleNamespace(dtype="float32"), SimpleNamespace(dtype="bfloat16")
    assert resolve_dtype(None, cpu, bf16) == resolve_dtype("auto", cpu, bf16) == torch.float32
    assert resolve_dtype("auto", cuda, fp32) == torch.bfloat16
    assert resolve_dtype("auto", cuda, SimpleNamespace(dtype="float16")) == torch.float16
    assert resolve_dtype("float16", cpu, fp32) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int4", cpu, fp32)


def test_lm_head_only_for_sampling_rows_gives_the_same_tokens():
    """Without keep_logits the LM head runs only on rows that sample (a partial prefill chunk needs
    none); the tokens equal those of an executor that computes every row's logits."""
    def run(keep: bool) -> list[list[list[int]]]:
        ex = ex_(keep_logits=keep)
        a, b, c = prompt(30, 1), prompt(9, 2), prompt(20, 3)
        outs = [ex.execute_model(step(0, new=[NewRequestData("a", a, GREEDY, ([1, 2],), 0),
                                              NewRequestData("b", b, GREEDY, ([3],), 0)],
                                      num_scheduled={"a": 12, "b": 9}))]  # a: partial chunk
        outs.append(ex.execute_model(step(1, new=[NewRequestData("c", c, GREEDY, ([4, 5],), 0)],
                                          cached=CachedRequestData(["a", "b"], [None, None], [12, 9], [0, 0]),
                                          num_scheduled={"a": 18, "b": 1, "c": 7})))  # c: partial
        outs.append(ex.execute_model(step(2, cached=CachedRequestData(["a", "b", "c"], [None] * 3, [30, 10, 7],
                                                                       [0, 0, 0]),
                                          num_scheduled={"a": 1, "b": 1, "c": 13})))
        return [o.sampled_token_ids for o in outs]
    with_all, only_sampling = run(True), run(False)
    assert with_all == only_sampling
    assert only_sampling[0][0] == [] and only_sampling[1][2] == [] and all(only_sampling[2])


@pytest.mark.parametrize("native, device, dtype, warns", [
    (False, "cpu", torch.bfloat16, True),  # AVX2 only: emulated bf16, ~50x slower
    (True, "cpu", torch.bfloat16, False),  # AVX512-BF16 / AMX
    (None, "cpu", torch.bfloat16, False),  # unknown: no claim
    (False, "cpu", torch.float32, False),
    (False, "cuda", torch.bfloat16, False),
])
def test_bfloat16_on_a_cpu_without_native_bfloat16_is_warned_about(monkeypatch, native, device, dtype, warns):
    import servetwin.gpu.executor as ex

    monkeypatch.setattr(ex, "cpu_has_native_bf16", lambda: native)
    warning = ex.slow_cpu_dtype_warning(torch.device(device), dtype)
    assert (warning is not None) == warns
    if warns:
        assert "float32" in warning and "cpu_smollm2-135m-fp32-avx2.yaml" in warning


def test_the_cpu_flags_are_read_where_linux_has_them():
    from servetwin.gpu.executor import cpu_has_native_bf16

    lines = open("/proc/cpuinfo").read().splitlines() if os.path.exists("/proc/cpuinfo") else []
    flags = next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), None)
    assert cpu_has_native_bf16() == (None if flags is None else bool(flags & {"avx512_bf16", "amx_bf16"}))
