"""n-gram speculative decoding against no speculation on a repetitive workload, torch backend, one run.

    python benchmarks/spec_decode_ngram.py [--model smollm2-135m] [--requests 32] [--max-tokens 128] [-k 3]
                                           [--device cpu] [--rounds 2]

The workload: each prompt repeats a short random phrase (the text an input-grounded task copies
from), so prompt lookup finds long matches. Both engines decode the same prompts greedily; the
script checks that their outputs are identical, then prints wall time, output tokens per second
and the acceptance from vLLM's counters (`LLM.get_metrics()`), side by side. Rounds alternate the
two engines (warm-up: the first generate of each engine is not timed) so a change of machine load
hits both. Timing belongs on a quiet machine; on a loaded one the table says only that it runs.
"""
from __future__ import annotations

import argparse
import random
import time

from servetwin.core import LLM, SamplingParams


def repetitive_prompts(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(4 + i % 5)]
        length = 48 + (i * 13) % 80
        out.append({"prompt_token_ids": (phrase * length)[:length]})
    return out


def spec_metrics(llm: LLM) -> dict[str, float]:
    m = {x.name: x for x in llm.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in m:
        return {}
    drafts, drafted = m["vllm:spec_decode_num_drafts"].value, m["vllm:spec_decode_num_draft_tokens"].value
    accepted = m["vllm:spec_decode_num_accepted_tokens"].value
    return {"acceptance": accepted / max(drafted, 1), "mean_accept_len": 1 + accepted / max(drafts, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    common = dict(model=a.model, backend="torch", device=a.device, multiprocess=False, skip_tokenizer_init=True,
                  max_model_len=512, num_gpu_blocks=1024, max_num_seqs=32)
    if a.device == "cpu":
        common["dtype"] = "float32"
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    engines = {"no speculation": LLM(**common), f"ngram k={a.k}": LLM(**common, speculative_config=spec)}
    prompts = repetitive_prompts(a.requests, vocab=300)  # ids every supported model's vocabulary holds
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    walls: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    for _ in range(a.rounds):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            walls[name].append(time.perf_counter() - t0)
            outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
    base, spec_name = list(engines)
    assert outputs[base] == outputs[spec_name], "greedy outputs differ with n-gram speculation"
    tokens = sum(len(t) for t in outputs[base])
    print(f"{a.model} on {a.device}: {a.requests} requests, {tokens} output tokens per round, outputs identical")
    print(f"{'engine':<18}{'best wall s':>12}{'tok/s':>10}{'acceptance':>12}{'mean len':>10}")
    for name, llm in engines.items():
        best = min(walls[name])
        m = spec_metrics(llm)
        acc = f"{m['acceptance']:.3f}" if m else "-"
        mlen = f"{m['mean_accept_len']:.2f}" if m else "-"
        print(f"{name:<18}{best:>12.2f}{tokens / best:>10.1f}{acc:>12}{mlen:>10}")
    print(f"speed-up: {min(walls[base]) / min(walls[spec_name]):.2f}x")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
