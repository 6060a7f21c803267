"""Random speculative-decoding scenarios (the oracle contract's `speculative` keys) for recording with
vLLM 0.33's oracle driver and replaying with `servetwin replay`.

How tests/core/data/s_fuzz_g<seed>.json were made: `gen_spec_scenarios.py A B OUT [--hybrid]
[--extra] [--chunked]` writes `OUT/g<seed>.json` for seeds A..B-1; the oracle driver recorded each
as `.expected.jsonl`. (Seeds below 100 came from an earlier version without the one-token-admission
prompts; the data files, not this script, are the record.) The scenarios vary the method, k, sync /
async, budgets, pool tightness, prefix caching with shared prefixes and N = m*block_size + 1 prompts
(padded admissions), stops (stop_at, stop ids, min_tokens), draft_lengths, accept_pattern, n > 1,
priority and aborts; `--hybrid` adds sliding-window groups, `--chunked` chunked-local groups and
retention intervals, `--extra` watermark, reserve_full_isl, active-seq caps, block sizes 8 / 64.
"""
from __future__ import annotations

import argparse
import json
import os
import random


def gen(seed: int, out: str, hybrid: bool = False, extra: bool = False, local_chunks: bool = False) -> None:
    """Write scenario number `seed` to `out`."""
    R = random.Random(seed)
    method = R.choice(["ngram", "eagle", "mtp", "ngram", "eagle"])
    asyn = method != "ngram" and R.random() < 0.35
    k = R.choice([1, 2, 3, 4, 5, 2, 3])
    bs = R.choice([16, 32, 32] + ([8, 64] if extra else []))
    nseq = R.choice([2, 4, 8, 8, 16])
    chunked = R.random() < 0.85
    mml = R.choice([256, 512, 1024, 1024])
    mnbt = R.choice([8, 16, 24, 28, 32, 48, 64, 96, 128, 256])
    mnbt = max(mnbt, nseq, k + 1)
    if not chunked:
        mml = R.choice([256, 512]); mnbt = max(mnbt, mml)
    caching = R.random() < 0.45
    acc = R.choice(["all", "none", {"seed": R.randrange(10000)}, {"pattern": [R.randrange(0, k + 2) for _ in range(R.randrange(1, 6))]}, {"seed": R.randrange(10000)}])
    nreq = R.randrange(3, 20 if extra else 12)
    prefixes = [[R.randrange(1000, 30000) for _ in range(R.choice([bs + 1, 2 * bs + 1, bs + 5, 3 * bs]))] for _ in range(2)]
    reqs = []
    maxlen_req = 0
    for i in range(nreq):
        plen = R.choice([R.randrange(1, 40), R.randrange(10, 120), R.randrange(60, 220)])
        plen = min(plen, mml - 20)
        r = {"id": f"s{i:02d}", "arrival_step": R.randrange(0, 12)}
        if caching and R.random() < 0.6:
            pre = R.choice(prefixes)
            body = [R.randrange(1000, 30000) for _ in range(R.choice([0, 0, 1, 3, 17, plen]))]
            toks = (pre + body)[: mml - 20]
            if R.random() < 0.45:
                toks = (pre + body)[: (len(pre) // bs) * bs + 1]  # N = m*bs + 1: a one-token admission (padding)
        else:
            toks = [R.randrange(1000, 30000) for _ in range(plen)]
        r["prompt_token_ids"] = toks
        mt = R.choice([R.randrange(1, 20), R.randrange(10, 90), R.randrange(50, 200)])
        if R.random() < 0.2:
            mt = mml  # hits max_model_len
        mt = min(mt, mml - len(toks)) if R.random() < 0.7 else mt
        mt = max(mt, 1)
        r["max_tokens"] = mt
        maxlen_req = max(maxlen_req, min(len(toks) + mt, mml))
        x = R.random()
        if x < 0.25:
            r["ignore_eos"] = False
            r["stop_at"] = [R.randrange(0, max(1, min(mt, 40)))]
        elif x < 0.35:
            r["stop_token_ids"] = [5, 7]
            r["stop_at"] = [[R.randrange(0, max(1, min(mt, 40))), R.choice([5, 7])]]
            if R.random() < 0.5:
                r["min_tokens"] = R.randrange(0, min(mt, 8) + 1)
        if not asyn and R.random() < 0.3:
            r["draft_lengths"] = [R.randrange(0, k + 1) for _ in range(R.randrange(1, 5))]
        if R.random() < 0.25:
            r["accept_pattern"] = [R.randrange(0, k + 2) for _ in range(R.randrange(1, 5))]
        if R.random() < 0.12 and "stop_at" not in r:
            r["n"] = R.choice([2, 3])
        if R.random() < 0.2:
            r["priority"] = R.randrange(0, 3)
        reqs.append(r)
    need = -(-(maxlen_req + k + 2) // bs) + 1
    groups = None
    if hybrid and R.random() < 0.6:
        if local_chunks and R.random() < 0.5:
            groups = [{"type": "full_attention"}, {"type": "chunked_local_attention", "attention_chunk_size": R.choice([32, 64, 128])}]
        else:
            groups = [{"type": "full_attention"}] + [{"type": "sliding_window", "sliding_window": R.choice([32, 64, 128])} for _ in range(R.randrange(1, 3))]
        need *= len(groups)
    tight = R.random() < 0.45
    nblocks = need + (R.randrange(1, 6) if tight else R.randrange(20, 150))
    settings = {"max_num_seqs": nseq, "max_num_batched_tokens": mnbt, "enable_chunked_prefill": chunked,
                "long_prefill_token_threshold": R.choice([0, 0, 16, 32]), "block_size": bs,
                "num_gpu_blocks": nblocks + 1, "enable_prefix_caching": caching,
                "policy": "priority" if R.random() < 0.2 else "fcfs", "max_model_len": mml, "max_steps": 3000,
                "speculative": {"num_speculative_tokens": k, "method": method, "acceptance": acc}}
    if settings["long_prefill_token_threshold"] > mml: settings["long_prefill_token_threshold"] = 0
    if asyn:
        settings["async_scheduling"] = True
    if groups:
        settings["kv_cache_groups"] = groups
        if local_chunks and R.random() < 0.4 and any(g["type"] == "sliding_window" for g in groups):
            settings["prefix_cache_retention_interval"] = R.choice([None, bs, 2 * bs])
    if extra:
        if R.random() < 0.3: settings["watermark"] = R.choice([0.01, 0.05, 0.1])
        if R.random() < 0.3: settings["scheduler_reserve_full_isl"] = False
        if R.random() < 0.3: settings["max_num_active_seqs"] = R.randrange(1, nseq + 1)
        if R.random() < 0.3 and settings["long_prefill_token_threshold"]: settings["long_prefill_token_threshold_adaptive"] = True
        if R.random() < 0.3: settings["max_num_seqs"] = 1
    sc = {"settings": settings, "requests": reqs}
    if R.random() < 0.15:
        sc["aborts"] = [{"step": R.randrange(2, 30), "id": R.choice(reqs)["id"], "phase": R.choice(["between_steps", "during_step"])}]
    json.dump(sc, open(out, "w"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first", type=int)
    ap.add_argument("stop", type=int)
    ap.add_argument("out_dir")
    for flag in ("hybrid", "extra", "chunked"):
        ap.add_argument(f"--{flag}", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    for seed in range(args.first, args.stop):
        gen(seed, os.path.join(args.out_dir, f"g{seed:04d}.json"), args.hybrid, args.extra, args.chunked)


if __name__ == "__main__":
    main()
