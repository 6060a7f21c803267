#!/usr/bin/env python3
"""Differential fuzz of the KV connector paths: random NixlConnector scenarios go through vLLM 0.33's
real scheduler (the oracle's connectors driver, with its fake worker) and through `servetwin replay`;
every divergence is printed, and its scenario + recording kept for tests/core/data.

    python scripts/connector_fuzz.py --driver PATH/vllm_oracle_driver_connectors.py \\
        --vllm-python /tmp/vllm-venv/bin/python --out /tmp/fuzz --seeds 0 100 [--family spec]

Families: `nixl` (P/D, the default), `offload` (the CPU tier), `spec` (either, with speculative
decoding; tests/core/data/k_spec_fuzz_0NN came from seed NN of an earlier version that sized the pool
before drawing the requests' lengths - the data files, not this script, are the record), `spec_hybrid` (P/D with speculative decoding
over full attention + a sliding window; k_spec_hybrid_fuzz_0NN = seed NN), `offload_hybrid` (the CPU tier over full
attention + a sliding window).

The driver and a Python with vLLM 0.33.0 are not part of servetwin (the script records with them in a
subprocess, one process for the whole batch: vLLM's import dominates a single recording).
Scenarios vary role, failure policy, sync/async scheduling, block size, tight pools, shared prefixes
(local hit + remote read), read delays and failures, send delays and leases, aborts.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

# the recorder, run by the vLLM Python: imports the driver and records every scenario given
RECORDER = r'''
import importlib.util, json, os, sys
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
spec = importlib.util.spec_from_file_location("drv", sys.argv[1])
drv = importlib.util.module_from_spec(spec); spec.loader.exec_module(drv)
model_dir = drv.ensure_model_dir(drv.DEFAULT_MODEL_DIR)
for path in sys.argv[2:]:
    out = path[:-5] + ".expected.jsonl"
    try:
        with open(path) as f: sc = json.load(f)
        with open(out + ".tmp", "w") as o: drv.run(sc, model_dir, o)
        os.replace(out + ".tmp", out)
    except Exception as e:
        print("rejected", path, repr(e)[:200], flush=True)
'''

STEP_KEYS = ["num_scheduled_tokens", "new", "new_prefix_hit_tokens", "running", "resumed", "preempted",
             "sampled", "num_free_blocks_after_schedule", "waiting_ids", "num_free_blocks_after_update",
             "num_running_after", "num_waiting_after", "blocks_per_group", "waiting_for_remote_kvs",
             "delayed_free_after_update", "kv_connector_output", "connector_prefix_cache", "kv_transfer_params",
             "prefix_cache", "spec_tokens", "spec_padded", "accepted", "num_computed_tokens_after_update",
             "spec_decoding", "drafts_proposed"]
SUMMARY_KEYS = ["finish_step", "first_token_step", "unfinished", "output_token_ids", "num_free_blocks_end",
                "kv_transfer_params", "held_at_end", "kv_worker_pending", "spec_decoding", "accepted_tokens"]


def random_scenario(seed: int) -> dict:
    rnd = random.Random(seed)
    role = rnd.choice(["kv_consumer", "kv_consumer", "kv_both", "kv_producer"])
    bs = rnd.choice([16, 32])
    conn = {"name": "NixlConnector", "role": role, "kv_load_failure_policy": rnd.choice(["fail", "recompute"]),
            "recv_delay_steps": rnd.randint(0, 6)}
    if role != "kv_consumer":
        conn["send_delay_steps"] = rnd.choice([None, 0, 1, 3])
        conn["lease_steps"] = rnd.choice([2, 4, 9])
    shared = [rnd.randint(1000, 29000) for _ in range(rnd.choice([bs, 2 * bs, 3 * bs + 7]))]
    requests, longest = [], 0
    for i in range(rnd.randint(4, 10)):
        body = [rnd.randint(1000, 29000) for _ in range(rnd.randint(6, rnd.choice([90, 180])))]
        prompt = shared + body if rnd.random() < 0.5 else body
        r = {"id": f"r{i:02d}", "arrival_step": rnd.randint(0, 10), "prompt_token_ids": prompt,
             "max_tokens": rnd.choice([1, 2, 4, 9, 16])}
        kind = rnd.random()
        if role != "kv_producer" and kind < 0.65:
            r["kv_transfer_params"] = {"do_remote_prefill": True}
            recv = {}
            if rnd.random() < 0.5:
                recv["delay_steps"] = rnd.randint(0, 8)
            if rnd.random() < 0.3:
                recv["fail"] = "all" if rnd.random() < 0.5 else sorted(rnd.sample(range(5), rnd.randint(1, 2)))
            if recv:
                r["kv_recv"] = recv
        elif role != "kv_consumer" and kind < 0.9:
            r["kv_transfer_params"] = {"do_remote_decode": True}
            if rnd.random() < 0.3:
                r["kv_send"] = {"delay_steps": rnd.choice([0, 2, 5])}
        requests.append(r)
        longest = max(longest, len(prompt) + r["max_tokens"])
    need = -(-longest // bs) + 2
    settings = {"max_num_seqs": rnd.choice([1, 2, 3, 6]), "max_num_batched_tokens": rnd.choice([32, 64, 96]),
                "enable_chunked_prefill": True, "long_prefill_token_threshold": rnd.choice([0, 16, 40]),
                "block_size": bs, "num_gpu_blocks": rnd.randint(need, int(need * 1.6) + 1),
                "enable_prefix_caching": rnd.random() < 0.7, "policy": "fcfs", "max_model_len": 1024,
                "max_steps": 250, "kv_connector": conn}
    if rnd.random() < 0.5:
        settings["async_scheduling"] = True
    scenario = {"settings": settings, "requests": requests}
    if rnd.random() < 0.5:
        scenario["aborts"] = [{"step": rnd.randint(1, 14), "id": rnd.choice(requests)["id"],
                               "phase": rnd.choice(["between_steps", "during_step"])}
                              for _ in range(rnd.randint(1, 3))]
    return scenario


def random_offload_scenario(seed: int) -> dict:
    """An OffloadingConnector scenario: shared prefixes evicted from a tight GPU pool and found again
    in a small CPU tier (LRU / ARC, store thresholds, load and store delays)."""
    rnd = random.Random(seed)
    bs = rnd.choice([16, 32])
    conn = {"name": "OffloadingConnector", "cpu_bytes_to_use": 4096 * rnd.randint(2, 24),
            "eviction_policy": rnd.choice(["lru", "arc"]), "store_threshold": rnd.choice([0, 0, 1, 2, 3]),
            "load_delay_steps": rnd.randint(0, 4), "store_delay_steps": rnd.randint(1, 4)}
    prefixes = [[rnd.randint(1000, 29000) for _ in range(rnd.choice([bs, 2 * bs, 3 * bs + 5]))] for _ in range(3)]
    requests, longest = [], 0
    for i in range(rnd.randint(4, 12)):
        body = [rnd.randint(1000, 29000) for _ in range(rnd.randint(1, rnd.choice([40, 120])))]
        prompt = rnd.choice(prefixes) + body if rnd.random() < 0.7 else body
        r = {"id": f"r{i:02d}", "arrival_step": rnd.randint(0, 30), "prompt_token_ids": prompt,
             "max_tokens": rnd.choice([1, 3, 8, 20])}
        requests.append(r)
        longest = max(longest, len(prompt) + r["max_tokens"])
    need = -(-longest // bs) + 2
    settings = {"max_num_seqs": rnd.choice([1, 2, 4, 8]), "max_num_batched_tokens": rnd.choice([32, 64, 128]),
                "enable_chunked_prefill": True, "long_prefill_token_threshold": rnd.choice([0, 32]),
                "block_size": bs, "num_gpu_blocks": rnd.randint(need, int(need * 2) + 2),
                "enable_prefix_caching": True, "policy": "fcfs", "max_model_len": 1024,
                "max_steps": 300, "kv_connector": conn}
    if rnd.random() < 0.4:
        settings["async_scheduling"] = True
    return {"settings": settings, "requests": requests}


def random_spec_connector_scenario(seed: int) -> dict:
    """A connector scenario (P/D or offloading, as above) with speculative decoding on top: method,
    k, acceptance, per-request draft lengths and accept patterns, sync or async (not ngram), and a
    pool tight enough that an async load's spec-step reserve matters."""
    rnd = random.Random(seed * 7919 + 1)
    scenario = random_scenario(seed) if rnd.random() < 0.65 else random_offload_scenario(seed)
    settings = scenario["settings"]
    method = rnd.choice(["ngram", "eagle", "mtp", "eagle"])
    k = rnd.choice([1, 2, 3, 4, 5])
    acceptance = rnd.choice(["all", "none", {"seed": rnd.randrange(10000)},
                             {"pattern": [rnd.randrange(0, k + 2) for _ in range(rnd.randint(1, 4))]}])
    settings["speculative"] = {"num_speculative_tokens": k, "method": method, "acceptance": acceptance}
    if method == "ngram":
        settings.pop("async_scheduling", None)  # vLLM rejects ngram with async scheduling
    settings["max_num_batched_tokens"] = max(settings["max_num_batched_tokens"], k + 2)
    for r in scenario["requests"]:
        if not settings.get("async_scheduling") and rnd.random() < 0.3:
            r["draft_lengths"] = [rnd.randrange(0, k + 1) for _ in range(rnd.randint(1, 4))]
        if rnd.random() < 0.25:
            r["accept_pattern"] = [rnd.randrange(0, k + 2) for _ in range(rnd.randint(1, 4))]
        if rnd.random() < 0.3:
            r["max_tokens"] = rnd.choice([12, 30, 60])
    # every request still fits once, with one verify step of room
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in scenario["requests"])
    need = -(-(longest + 2 * k + 2) // settings["block_size"]) + 1
    settings["num_gpu_blocks"] = max(need, settings["num_gpu_blocks"] + rnd.choice([-2, 0, 0, 1, 3]))
    return scenario


def random_spec_hybrid_scenario(seed: int) -> dict:
    """A P/D scenario with speculative decoding over a full-attention + sliding-window model."""
    rnd = random.Random(seed * 104729 + 3)
    scenario = random_spec_connector_scenario(seed)
    while scenario["settings"]["kv_connector"]["name"] != "NixlConnector":
        seed += 1000003
        scenario = random_spec_connector_scenario(seed)
    settings = scenario["settings"]
    window = rnd.choice([16, 32, 48, 64, 128])
    settings["kv_cache_groups"] = [{"type": "full_attention"}, {"type": "sliding_window", "sliding_window": window}]
    settings["num_gpu_blocks"] *= 2
    if rnd.random() < 0.3:
        settings["prefix_cache_retention_interval"] = rnd.choice([None, 64, 128])
    for r in scenario["requests"]:  # block-level load failures need one KV cache group
        if isinstance((r.get("kv_recv") or {}).get("fail"), list):
            r["kv_recv"]["fail"] = "all"
    return scenario


def random_offload_hybrid_scenario(seed: int) -> dict:
    """An OffloadingConnector scenario over a full-attention + sliding-window model (vLLM 0.33's
    connector supports the hybrid KV cache manager: both groups go to the CPU tier, a sliding-window
    group only the blocks a lookup can reach). Needs a driver that accepts it (the oracle's
    connectors driver rejects sliding-window groups with OffloadingConnector)."""
    rnd = random.Random(seed * 15485863 + 7)
    scenario = random_offload_scenario(seed)
    settings = scenario["settings"]
    bs = settings["block_size"]
    window = rnd.choice([bs // 2, bs, bs + 1, 2 * bs, 3 * bs])
    settings["kv_cache_groups"] = [{"type": "full_attention"}, {"type": "sliding_window", "sliding_window": window}]
    # a pool the longest request just fits in (its window blocks included): prefixes leave the GPU soon
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in scenario["requests"])
    settings["num_gpu_blocks"] = -(-longest // bs) + -(-window // bs) + 3 + rnd.randint(0, 6)
    settings["kv_connector"]["cpu_bytes_to_use"] = 4096 * rnd.randint(8, 48)  # one chunk per block per group
    requests = scenario["requests"]
    for i in range(rnd.randint(0, 6)):  # later resends of a prompt: hits at its replay boundary
        r = dict(rnd.choice(requests), id=f"x{i:02d}", arrival_step=rnd.randint(20, 80))
        requests.append(r)
    settings["max_steps"] = 400
    if rnd.random() < 0.3:
        settings["prefix_cache_retention_interval"] = rnd.choice([None, 2 * bs, 4 * bs])
    return scenario


FAMILIES = {"nixl": random_scenario, "offload": random_offload_scenario, "spec": random_spec_connector_scenario,
            "spec_hybrid": random_spec_hybrid_scenario, "offload_hybrid": random_offload_hybrid_scenario}


def divergences(scenario_path: Path) -> list[str]:
    from servetwin.core.testbed.replay import replay
    from servetwin.core.testbed.scenario import load_scenario

    expected = [json.loads(line) for line in scenario_path.with_suffix(".expected.jsonl").open()]
    got = list(replay(load_scenario(str(scenario_path))))
    out = []
    if len(got) != len(expected):
        out.append(f"{len(got)} lines, vLLM {len(expected)}")
    for e, g in zip(expected, got):
        if e["type"] == "summary":
            out += [f"summary {k}" for k in SUMMARY_KEYS if k in e and g.get(k) != e[k]]
        elif e["type"] == "step" and not (e.get("idle") or e.get("drain_only")):
            out += [f"step {e['step']} {k}" for k in STEP_KEYS if k in e and g.get(k) != e[k]]
            if [[r, g["finish_reasons"][r]] for r in g.get("finished", [])] != e.get("finished", []):
                out.append(f"step {e['step']} finished")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", required=True, help="vllm_oracle_driver_connectors.py")
    ap.add_argument("--vllm-python", required=True, help="a Python with vLLM 0.33.0 installed")
    ap.add_argument("--out", required=True, help="folder for the scenarios and recordings")
    ap.add_argument("--seeds", nargs=2, type=int, default=[0, 50], metavar=("FROM", "TO"))
    ap.add_argument("--family", choices=sorted(FAMILIES), default="nixl",
                    help="nixl: P/D; offload: CPU tier; spec: either with speculative decoding")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in range(*args.seeds):
        p = out / f"k_fuzz_{args.family}_{seed:05d}.json"
        p.write_text(json.dumps(FAMILIES[args.family](seed)))
        paths.append(p)
    subprocess.run([args.vllm_python, "-c", RECORDER, args.driver, *map(str, paths)], check=True)
    recorded = [p for p in paths if p.with_suffix(".expected.jsonl").exists()]
    bad = 0
    for p in recorded:
        diff = divergences(p)
        if diff:
            bad += 1
            print(f"DIVERGES {p.name}: {'; '.join(diff[:5])}")
    print(f"{len(recorded)} scenarios recorded, {bad} diverge")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
