"""Sliding-window, attention-sink and MoE models (tiny-mistral-sw, tiny-mixtral, tiny-qwen3-moe,
tiny-gpt-oss) against HF transformers (fp32, eager attention): every scheduled row's logits, across
prompts longer than the window, prefill chunks that cross the window edge, prefix-cache hits, decodes
past the window and preemption; and the blocks a window leaves behind are never read."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.output import CachedRequestData, NewRequestData
from servetwin.gpu.models.tiny import TINY_GPT_OSS_WINDOW, TINY_SLIDING_WINDOW
from backend_helpers import GREEDY, check_step_logits, make_executor, oracle, step

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """HF's and our forwards of these tiny models are per-op overhead: one thread avoids OpenMP barrier
    spinning when the 2 cores are shared (measured: 3-5x faster under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


NEW_MODELS = ["tiny-mistral-sw", "tiny-mixtral", "tiny-qwen3-moe", "tiny-gpt-oss"]
# fp32: the experts' weighted outputs are summed per token in another order than HF's (one index_add_
# over all experts vs one per expert); the largest |diff| seen is 2.1e-5 (tiny-qwen3-moe, 4 layers)
MOE_ATOL = 6e-5


@pytest.mark.parametrize("name", NEW_MODELS)
def test_spec_parameter_count_equals_hf_and_ours(name):
    """core's ModelSpec counts (sinks, router / expert biases, dense layers, tied heads) on real modules."""
    from transformers import AutoModelForCausalLM
    from servetwin.gpu.loader import load_model
    from servetwin.gpu.models.registry import resolve_model
    info = resolve_model(name)
    hf = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=torch.float32, local_files_only=True)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert info.spec.num_parameters == n_hf == sum(p.numel() for p in load_model(info).parameters())


def test_tiny_models_attention_and_moe_fields():
    from servetwin.gpu.models.registry import resolve_model
    sw = resolve_model("tiny-mistral-sw").decoder_config
    assert [w.sliding_window for w in sw.layer_windows] == [TINY_SLIDING_WINDOW] * sw.num_layers
    oss = resolve_model("tiny-gpt-oss").decoder_config
    assert [w.sliding_window for w in oss.layer_windows] == [TINY_GPT_OSS_WINDOW, None]
    assert oss.attention_sinks and oss.moe.swiglu_limit == 2.0 and oss.moe.router_bias and oss.moe.expert_bias
    qm = resolve_model("tiny-qwen3-moe").decoder_config
    assert qm.dense_layers == (0,) and not qm.moe.renormalize and qm.moe.num_experts == 16
    assert resolve_model("tiny-mixtral").decoder_config.moe.renormalize


def group_ids(ex, ids: list[int]) -> tuple[list[int], ...]:
    """One logical block table in each of the executor's KV cache groups, on disjoint blocks (the j-th
    layers of the groups share one KV tensor, so two groups must never share a block)."""
    return tuple([b + g * GROUP_STRIDE for b in ids] for g in range(len(ex.kv_plan.kv_cache_groups)))


GROUP_STRIDE = 64


@pytest.mark.parametrize("name,mode,block_size", [("tiny-mistral-sw", "batched", 4), ("tiny-mistral-sw", "split", 16),
                                                  ("tiny-gpt-oss", "loop", 4), ("tiny-gpt-oss", "batched", 16),
                                                  ("tiny-mixtral", "split", 8), ("tiny-qwen3-moe", "batched", 8)])
def test_hand_built_steps_cross_the_window(name, mode, block_size):
    """A 37-token prompt in chunks of 9 + 28 (the second crosses the window edge), a prefix hit of two
    shared blocks, decodes beyond the window next to a fresh prompt, preempt + resume."""
    ex, orc = (make_executor(name, torch_paged_mode=mode, block_size=block_size, max_model_len=128,
                             num_gpu_blocks=2 * GROUP_STRIDE + 1), oracle(name))
    rng = random.Random(13)
    pa = [rng.randrange(3, 320) for _ in range(37)]
    pb = [rng.randrange(3, 320) for _ in range(6)]
    hit = 2 * block_size
    pc = pa[:hit] + [rng.randrange(3, 320) for _ in range(19)]
    nb = lambda n: -(-n // block_size)  # noqa: E731
    ids = iter(range(1, 200))
    blocks = {r: [next(ids) for _ in range(nb(n + 12))] for r, n in (("A", 37), ("B", 6))}
    blocks["C"] = blocks["A"][:2] + [next(ids) for _ in range(nb(len(pc) + 12) - 2)]
    out_tokens: dict[str, list[int]] = {"A": [], "B": [], "C": []}

    def run(so):
        out = ex.execute_model(so)
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            out_tokens[rid].extend(toks)
        check_step_logits(ex, orc, so, out, MOE_ATOL)

    run(step(1, new=[NewRequestData("A", pa, GREEDY, group_ids(ex, blocks["A"]), 0)], num_scheduled={"A": 9}))
    run(step(2, new=[NewRequestData("B", pb, GREEDY, group_ids(ex, blocks["B"]), 0)],
             cached=CachedRequestData(["A"], [None], [9], [0]), num_scheduled={"A": 28, "B": 6}))
    run(step(3, new=[NewRequestData("C", pc, GREEDY, group_ids(ex, blocks["C"]), hit)],
             cached=CachedRequestData(["A", "B"], [None, None], [37, 6], [1, 1]),
             num_scheduled={"A": 1, "B": 1, "C": len(pc) - hit}))
    for s in range(4, 9):  # decodes walk A and C across block and window edges
        done = {r: len(p) + len(out_tokens[r]) - 1 for r, p in (("A", pa), ("B", pb), ("C", pc))}
        run(step(s, cached=CachedRequestData(["A", "B", "C"], [None] * 3, [done["A"], done["B"], done["C"]],
                                             [len(out_tokens[r]) for r in "ABC"]),
                 num_scheduled={"A": 1, "B": 1, "C": 1}))
    assert [len(out_tokens[r]) for r in "ABC"] == [7, 7, 6]


def _poison_out_of_window(ex, window: int) -> int:
    """NaN every cached block that lies wholly before the window of each request's next query (what a
    sliding-window KV group frees and may hand to another request); returns how many were poisoned."""
    bs, n = ex.block_size, 0
    for st in ex.state.requests.values():
        first = max(0, st.num_computed_tokens - window + 1) // bs
        for b in st.block_ids[0][:first]:  # tiny-mistral-sw: one sliding-window group
            for k, v in ex.kv_caches:
                k[b].fill_(float("nan"))
                v[b].fill_(float("nan"))
            n += 1
    return n


@pytest.mark.parametrize("mode", ["batched", "split", "loop"])
def test_out_of_window_blocks_are_never_read(mode):
    """Sliding-window layers only: blocks behind the window hold NaN after every step, outputs still
    equal HF's (a single read of one, masked or not, would turn the logits into NaN)."""
    ex, orc = (make_executor("tiny-mistral-sw", torch_paged_mode=mode, block_size=4, max_model_len=128),
                oracle("tiny-mistral-sw"))
    rng = random.Random(21)
    pa = [rng.randrange(3, 320) for _ in range(30)]
    pb = [rng.randrange(3, 320) for _ in range(17)]
    new = [NewRequestData("A", pa, GREEDY, (list(range(1, 13)),), 0),
           NewRequestData("B", pb, GREEDY, (list(range(13, 22)),), 0)]
    ex.execute_model(step(1, new=new, num_scheduled={"A": 20, "B": 17}))
    poisoned = _poison_out_of_window(ex, TINY_SLIDING_WINDOW)
    out = ex.execute_model(so := step(2, cached=CachedRequestData(["A", "B"], [None, None], [20, 17], [0, 1]),
                                      num_scheduled={"A": 10, "B": 1}))
    check_step_logits(ex, orc, so, out, MOE_ATOL)
    gen = {"A": 1, "B": 2}
    for s in range(3, 9):
        poisoned += _poison_out_of_window(ex, TINY_SLIDING_WINDOW)
        done = {"A": 30 + gen["A"] - 1, "B": 17 + gen["B"] - 1}
        so = step(s, cached=CachedRequestData(["A", "B"], [None, None], [done["A"], done["B"]], [gen["A"], gen["B"]]),
                  num_scheduled={"A": 1, "B": 1})
        out = ex.execute_model(so)
        check_step_logits(ex, orc, so, out, MOE_ATOL)
        gen = {r: gen[r] + 1 for r in gen}
    assert poisoned >= 10


@pytest.mark.parametrize("name", NEW_MODELS)
def test_engine_core_greedy_equals_hf(name):
    """The real scheduler with prefix caching on, a 16-token budget (chunks cross the window), shared
    prefixes (hits) and a small pool (preemption): every row's logits, then whole generations vs
    HF's greedy tokens."""
    # tiny-gpt-oss holds blocks in two KV cache groups (sliding 10, full): a pool as tight per group
    ex, orc = make_executor(name, num_gpu_blocks=40 if name == "tiny-gpt-oss" else 22, max_model_len=128, block_size=8,
                            torch_paged_mode="split" if name != "tiny-gpt-oss" else "batched"), oracle(name)
    eng = EngineCore(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=5, max_model_len=128),
                     CacheConfig(block_size=8, num_gpu_blocks=ex.num_gpu_blocks, enable_prefix_caching=True,
                                 kv_cache_groups=ex.kv_cache_groups), ex)
    rng = random.Random(zlib.crc32(name.encode()))  # str hash() is salted per process
    shared = [rng.randrange(3, 320) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (5, 14)]
    prompts += [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 31)]
    # an exact resend: a sliding-window group keeps (sparse retention) only the window tail before the
    # prompt's replay boundary, so tiny-mistral-sw (no full-attention group) hits there and only there
    prompts.append(list(prompts[0]))
    n_new = 10
    arrivals = {0: [0, 3], 3: [1], 5: [2], 8: [4]}
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    hits = 0
    for s in range(400):
        for i in arrivals.get(s, []):
            eng.add_request(Request(f"r{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=n_new,
                                                                         ignore_eos=True)))
        if not eng.has_work() and s > max(arrivals):
            break
        res = eng.step()
        for o in res.outputs:
            got[o.request_id].extend(o.new_token_ids)
        so = res.scheduled
        if so is None or so.is_empty:
            continue
        check_step_logits(ex, orc, so, res.model_output, MOE_ATOL)
        hits += sum(1 for r in so.scheduled_new_reqs if r.num_computed_tokens > 0)
    assert not eng.has_work() and hits > 0
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == orc.generate_greedy(p, n_new), f"{name} prompt {i} (len {len(p)})"


def test_llm_generate_tiny_gpt_oss_equals_hf():
    """The offline front end on tiny-gpt-oss: text prompts longer than its 10-token window."""
    from servetwin.core.engine.llm import LLM
    orc = oracle("tiny-gpt-oss")
    texts = ["The scheduler decides which requests run in each step. A request arrives with a prompt",
             "What is the capital of France?"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model="tiny-gpt-oss", backend="torch", multiprocess=False, device="cpu", num_gpu_blocks=64,
             max_model_len=256, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        outs = llm.generate(texts, greedy)
    assert len(outs[0].prompt_token_ids) > TINY_GPT_OSS_WINDOW
    for out in outs:
        assert list(out.outputs[0].token_ids) == orc.generate_greedy(out.prompt_token_ids, 12)
