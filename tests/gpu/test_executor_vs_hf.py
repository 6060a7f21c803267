"""TorchExecutor logits and greedy tokens against HF transformers (fp32, eager attention).

Every row of every step is checked: the executor's logits at the row's last scheduled token must
equal HF's full forward of the same token prefix, across prefill chunks, prefix-cache hits (shared
physical blocks), decodes and a preempted-then-resumed request.
"""
from __future__ import annotations

import random

import pytest
import torch

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.sched.output import CachedRequestData, NewRequestData
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from backend_helpers import GREEDY, check_step_logits, make_executor, oracle, step

@pytest.mark.parametrize("name,mode", [("tiny-llama", "batched"), ("tiny-qwen2", "batched"), ("tiny-qwen3", "batched"),
                                       ("tiny-llama", "split"), ("tiny-qwen3", "split")])
def test_hand_built_steps_match_hf(name, mode):
    """Chunked prefill, a prefix hit on another request's blocks, decodes, preempt + resume ("split":
    the CPU default, decodes through the native kernel when it builds)."""
    ex, orc = make_executor(name, torch_paged_mode=mode), oracle(name)
    rng = random.Random(7)
    pa = [rng.randrange(3, 320) for _ in range(40)]
    pb = [rng.randrange(3, 320) for _ in range(23)]
    pc = pa[:32] + [rng.randrange(3, 320) for _ in range(9)]  # shares A's first two full blocks
    pd = [rng.randrange(3, 320) for _ in range(5)]
    outputs: dict[str, list[int]] = {"A": [], "B": [], "C": [], "D": []}
    checked = 0

    def run(so):
        nonlocal checked
        out = ex.execute_model(so)
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            outputs[rid].extend(toks)
        checked += check_step_logits(ex, orc, so, out)
        return out

    # 1: A whole prompt (3 blocks), B first chunk of 12 (samples nothing)
    out = run(step(1, new=[NewRequestData("A", pa, GREEDY, ([5, 9, 2],), 0),
                           NewRequestData("B", pb, GREEDY, ([7, 3],), 0)], num_scheduled={"A": 40, "B": 12}))
    assert out.sampled_token_ids[out.req_id_to_index["B"]] == []
    # 2: A decode, B rest of its prompt, C new with a 32-token prefix hit on A's blocks 5 and 9
    run(step(2, new=[NewRequestData("C", pc, GREEDY, ([5, 9, 11],), 32)],
             cached=CachedRequestData(["A", "B"], [None, None], [40, 12], [1, 0]),
             num_scheduled={"A": 1, "B": 11, "C": 9}))
    # 3: decodes (C needs no new block: 42 tokens in 3 blocks), D arrives
    run(step(3, new=[NewRequestData("D", pd, GREEDY, ([13],), 0)],
             cached=CachedRequestData(["A", "B", "C"], [None, None, None], [41, 23, 41], [2, 1, 1]),
             num_scheduled={"A": 1, "B": 1, "C": 1, "D": 5}))
    # 4: B preempted (its blocks 7, 3 are freed); A, C, D decode
    run(step(4, cached=CachedRequestData(["A", "C", "D"], [None, None, None], [42, 42, 5], [3, 2, 1]),
             num_scheduled={"A": 1, "C": 1, "D": 1}, preempted=["B"]))
    # 5: B resumed into fresh blocks, recomputing prompt + its 2 outputs in one chunk
    b_tokens = pb + outputs["B"]
    assert len(outputs["B"]) == 2
    run(step(5, cached=CachedRequestData(["A", "C", "D", "B"], [None, None, None, ([12, 4],)], [43, 43, 6, 0],
                                         [4, 3, 2, 2], {"B"}, {"B": b_tokens}),
             num_scheduled={"A": 1, "C": 1, "D": 1, "B": len(b_tokens)}))
    # 6: A finished; the rest decode
    run(step(6, cached=CachedRequestData(["C", "D", "B"], [None, None, None], [44, 7, 25], [4, 3, 3]),
             num_scheduled={"C": 1, "D": 1, "B": 1}, finished=["A"]))
    assert "A" not in ex.state.requests
    assert checked == 2 + 3 + 4 + 3 + 4 + 3
    assert [len(outputs[r]) for r in "ABCD"] == [5, 4, 5, 4]


@pytest.mark.parametrize("name,mode", [("tiny-llama", "loop"), ("tiny-qwen3", "loop"), ("tiny-qwen3", "batched"),
                                       ("tiny-llama", "split"), ("tiny-qwen3", "split")])
def test_engine_core_mixed_batches_match_hf(name, mode):
    """The real scheduler: small token budget (chunks), staggered arrivals sharing a prefix (hits),
    a small KV pool (preemptions); every row of every step checked against HF."""
    ex, orc = make_executor(name, num_gpu_blocks=14, max_model_len=128, torch_paged_mode=mode), oracle(name)
    eng = EngineCore(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6, max_model_len=128),
                     CacheConfig(block_size=16, num_gpu_blocks=ex.num_gpu_blocks), ex)
    rng = random.Random(3)
    shared = [rng.randrange(3, 320) for _ in range(36)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (4, 10, 17)]
    prompts += [[rng.randrange(3, 320) for _ in range(n)] for n in (7, 30)]
    arrivals = {0: [0, 3], 4: [1, 4], 7: [2]}
    seen = {"hits": 0, "preempted": 0, "resumed": 0, "partial": 0, "mixed": 0}
    for s in range(200):
        for i in arrivals.get(s, []):
            eng.add_request(Request(f"r{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=20,
                                                                         ignore_eos=True)))
        if not eng.has_work() and s > max(arrivals):
            break
        res = eng.step()
        so, out = res.scheduled, res.model_output
        if so is None or so.is_empty:
            continue
        check_step_logits(ex, orc, so, out)
        seen["hits"] += sum(1 for r in so.scheduled_new_reqs if r.num_computed_tokens > 0)
        seen["preempted"] += len(so.preempted_req_ids)
        seen["resumed"] += len(so.scheduled_cached_reqs.resumed_req_ids)
        seen["partial"] += sum(1 for t in out.sampled_token_ids if not t)
        q = list(so.num_scheduled_tokens.values())
        seen["mixed"] += int(1 in q and max(q) > 1)
    assert not eng.has_work()
    assert all(v > 0 for v in seen.values()), f"scenario did not exercise everything: {seen}"


@pytest.mark.parametrize("name,async_scheduling", [("tiny-llama", False), ("tiny-qwen3", False),
                                                   ("tiny-qwen3", True)])
def test_greedy_generation_equals_hf_generate(name, async_scheduling):
    ex, orc = make_executor(name), oracle(name)
    eng = EngineCore(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512,
                                     async_scheduling=async_scheduling),
                     CacheConfig(block_size=16, num_gpu_blocks=ex.num_gpu_blocks), ex)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 17, 33, 50)]
    n_new = 12
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)))
    got: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for o in eng.step().outputs:
            got[o.request_id].extend(o.new_token_ids)
    for res in eng.drain():
        for o in res.outputs:
            got[o.request_id].extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        assert got[f"g{i}"] == orc.generate_greedy(p, n_new), f"prompt {i} (len {len(p)})"


def test_loop_batched_and_split_attention_agree():
    outs = {}
    for mode in ("batched", "loop", "split"):
        ex = make_executor("tiny-qwen3", torch_paged_mode=mode)
        rng = random.Random(5)
        new = [NewRequestData(f"q{i}", [rng.randrange(3, 320) for _ in range(n)], GREEDY, ([1 + 3 * i, 2 + 3 * i, 3 + 3 * i],), 0)
               for i, n in enumerate((5, 20, 33))]
        ex.execute_model(step(1, new=new, num_scheduled={"q0": 5, "q1": 20, "q2": 16}))
        ex.execute_model(step(2, cached=CachedRequestData(["q0", "q1", "q2"], [None] * 3, [5, 20, 16], [1, 1, 0]),
                              num_scheduled={"q0": 1, "q1": 1, "q2": 17}))
        outs[mode] = dict(ex.last_logits)
    for rid in outs["batched"]:
        torch.testing.assert_close(outs["batched"][rid], outs["loop"][rid], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs["split"][rid], outs["loop"][rid], atol=1e-5, rtol=1e-5)
