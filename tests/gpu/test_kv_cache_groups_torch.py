"""The torch backend with several KV cache groups: each layer writes and reads its own group's block
table. Two full-attention groups (one layer each, as vLLM's grouping gives when full layers outnumber
the group size) must generate exactly what one group does, through prefix hits and preemptions."""
from __future__ import annotations

from servetwin.core import LLM, SamplingParams
from servetwin.core.kv_cache.kv_cache_interface import FullAttentionSpec
from servetwin.core.kv_cache.kv_cache_planning import KVCachePlan

CPU = dict(model="tiny-llama", backend="torch", multiprocess=False, device="cpu", dtype="float32",
           skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=40)
PROMPTS = [list(range(5, 5 + n)) for n in (9, 23, 14)] + [list(range(5, 5 + 23)) + [300, 301]]


def _generate(**kw) -> tuple[list[list[int]], int, tuple, int, list[int]]:
    with LLM(**CPU, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        sched = llm.llm_engine.client.engine_core.scheduler
        kv = sched.kv_cache_manager
        return ([o.outputs[0].token_ids for o in outs], kv.block_pool.num_gpu_blocks, kv.kv_cache_groups,
                sched.num_preemptions_total, [o.num_cached_tokens for o in outs])


def test_two_full_groups_generate_what_one_group_does(monkeypatch):
    num_gpu_blocks = 12  # too small for all four prompts at once: preemptions; the last one hits a prefix
    one, _, groups, preempted, cached = _generate(num_gpu_blocks=num_gpu_blocks)
    assert groups == (FullAttentionSpec(),) and preempted > 0 and any(cached)
    plan = KVCachePlan((FullAttentionSpec(), FullAttentionSpec()), (0, 1), 1)
    monkeypatch.setattr("servetwin.gpu.executor.model_kv_plan", lambda cfg, disable=False: plan)
    two, n, groups, preempted2, cached2 = _generate(num_gpu_blocks=num_gpu_blocks * 2)  # the same blocks per group
    assert groups == plan.kv_cache_groups and n == num_gpu_blocks * 2
    assert (preempted2, cached2) == (preempted, cached)
    assert two == one
