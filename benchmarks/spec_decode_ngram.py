"""n-gram speculative decoding against no speculation on a repetitive workload, torch backend, one run.

    python benchmarks/spec_decode_ngram.py [--model smollm2-135m] [--requests 64] [--max-tokens 32]
                                           [-k 3] [--max-num-seqs 4] [--rounds 3] [--budget-s 170]
                                           [--device cpu] [--json F]

The workload: each prompt repeats a short random phrase (the text an input-grounded task copies
from), so prompt lookup finds long matches and the model (greedy) continues the repetition. Both
engines decode the same prompts greedily; every round checks that their outputs are identical, then
the script prints wall time, output tokens per second and the acceptance from vLLM's counters
(`LLM.get_metrics()`), side by side, and the ratio of the best walls.

Rounds alternate the two engines, and the order within a round (A B, B A, A B, ...), so a change of
machine load hits both; each engine's first generate (a warm-up) is not timed. Progress is printed
after every timed generate. A round that would end past `--budget-s` (seconds since the start,
projected from the last round) is not started: the table then says how many rounds ran.

Why a few concurrent requests (`--max-num-seqs 4`): speculation trades compute for steps. A verify
step runs 1 + k tokens per row; with few rows a CPU (or GPU) step costs about the same for 1 or
1 + k tokens (weights are read once a step), so accepted drafts are nearly free tokens. With many
rows the step is compute-bound and costs about (1 + k)x, and speculation can only break even - vLLM
recommends it for latency at low load for the same reason. Raise `--max-num-seqs` to see that.

The defaults are sized for about 3 minutes on two quiet CPU cores (smollm2-135m, fp32); the budget
keeps a slower machine inside it with fewer rounds.
Timing belongs on a quiet machine; on a loaded one the table says only that it runs.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Optional

from servetwin.core import LLM, SamplingParams

SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens")


def repetitive_prompts(n: int, vocab: int, seed: int = 0, min_len: int = 24, max_len: int = 56) -> list[dict]:
    """`n` prompts, each a random phrase of 4-8 token ids (from [3, vocab)) repeated to a length in
    [min_len, max_len]."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(4 + i % 5)]
        length = min_len + (i * 13) % (max_len - min_len + 1)
        out.append({"prompt_token_ids": (phrase * length)[:length]})
    return out


def spec_counters(llm: LLM) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens); {} without speculation."""
    m = {x.name: x.value for x in llm.get_metrics() if x.name in SPEC_METRICS}
    return {name.split("num_")[-1]: float(m[name]) for name in SPEC_METRICS if name in m}


def acceptance(counters: dict[str, float]) -> dict[str, float]:
    """Acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted / drafts)."""
    if not counters:
        return {}
    return {"acceptance_rate": counters["accepted_tokens"] / max(counters["draft_tokens"], 1.0),
            "mean_acceptance_length": 1 + counters["accepted_tokens"] / max(counters["drafts"], 1.0)}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="requests decoding at once")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=40)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3, help="timed generates per engine, alternating")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="start no round that would end later than this many seconds after the start")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.requests < 1 or a.max_tokens < 1 or a.k < 1 or not 1 <= a.min_prompt <= a.max_prompt:
        ap.error("--rounds, --requests, --max-tokens and -k must be >= 1, and 1 <= --min-prompt <= --max-prompt")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    start = time.perf_counter()
    common = dict(model=a.model, backend="torch", device=a.device, multiprocess=False, skip_tokenizer_init=True,
                  max_model_len=a.max_prompt + a.max_tokens + a.k + 8, num_gpu_blocks=1024,
                  max_num_seqs=a.max_num_seqs)
    if a.device == "cpu":
        common["dtype"] = "float32"
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    engines = {"no speculation": LLM(**common), f"ngram k={a.k}": LLM(**common, speculative_config=spec)}
    base, spec_name = list(engines)
    # ids every supported model's vocabulary holds
    prompts = repetitive_prompts(a.requests, vocab=300, min_len=a.min_prompt, max_len=a.max_prompt)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in engines.values():  # warm-up (not timed, not counted)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    before = spec_counters(engines[spec_name])
    print(f"{a.model} on {a.device}: {a.requests} requests x {a.max_tokens} tokens, max_num_seqs "
          f"{a.max_num_seqs}, {a.rounds} rounds; engines ready after {time.perf_counter() - start:.0f} s", flush=True)
    walls: dict[str, list[float]] = {name: [] for name in engines}
    tokens = a.requests * a.max_tokens
    for r in range(a.rounds):
        last_round = sum(w[-1] for w in walls.values()) if r else 0.0
        if r and time.perf_counter() - start + last_round > a.budget_s:
            print(f"  stopping after {r} of {a.rounds} rounds: another would pass --budget-s {a.budget_s:g}", flush=True)
            break
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        outputs = {}
        for name in order:
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            walls[name].append(time.perf_counter() - t0)
            outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
            print(f"  round {r + 1}/{a.rounds} {name:<16} {walls[name][-1]:7.2f} s {tokens / walls[name][-1]:8.1f} tok/s"
                  f"  (elapsed {time.perf_counter() - start:.0f} s)", flush=True)
        if outputs[base] != outputs[spec_name]:
            print(f"FAIL: greedy outputs differ with n-gram speculation (round {r + 1})")
            return 1
        assert sum(len(t) for t in outputs[base]) == tokens
    after = spec_counters(engines[spec_name])
    acc = acceptance({key: after[key] - before.get(key, 0.0) for key in after})
    results = {"model": a.model, "device": a.device, "requests": a.requests, "max_tokens": a.max_tokens, "k": a.k,
               "max_num_seqs": a.max_num_seqs, "rounds": len(walls[base]), "output_tokens_per_round": tokens,
               "outputs_identical": True, "engines": {}}
    print(f"outputs identical in every round ({len(walls[base])}); {tokens} output tokens per round")
    print(f"{'engine':<18}{'best wall s':>12}{'median s':>10}{'tok/s':>10}{'acceptance':>12}{'mean len':>10}")
    for name in engines:
        best = min(walls[name])
        row = {"walls_s": walls[name], "best_wall_s": best, "output_tok_s": tokens / best,
               **(acc if name == spec_name else {})}
        results["engines"][name] = row
        rate = f"{acc['acceptance_rate']:.3f}" if name == spec_name else "-"
        mlen = f"{acc['mean_acceptance_length']:.2f}" if name == spec_name else "-"
        print(f"{name:<18}{best:>12.2f}{statistics.median(walls[name]):>10.2f}{tokens / best:>10.1f}{rate:>12}{mlen:>10}")
    results["speedup"] = min(walls[base]) / min(walls[spec_name])
    print(f"speed-up (best wall, no speculation / ngram): {results['speedup']:.2f}x; "
          f"total {time.perf_counter() - start:.0f} s")
    for llm in engines.values():
        llm.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
