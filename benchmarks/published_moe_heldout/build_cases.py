"""Write this folder's `cases/*.yaml` and `published.json` from the study's artifacts (`agg_bmk_run_*.json`,
verbatim): every vLLM gpt-oss-120b row of InferenceMAX runs 20667906037 (vLLM v0.13.0) and 20218553330 (v0.11.2)
except the nine that `benchmarks/published_moe` holds as the training set. JUDGING ONLY: nothing may be fitted
on these rows (README.md).

    .venv/bin/python benchmarks/published_moe_heldout/build_cases.py      # then: servetwin validate benchmarks/published_moe_heldout

Each case is the training cases' experiment with the row's GPU, TP, lengths and concurrency, and the serve
flags of that GPU's InferenceX script at commit 4e52ed4c6 (README.md, "Serving settings").
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
# (artifact, run id, case-name suffix, published.json engine_version): the training set's run (v0.13.0,
# 2026-01-02) and the study's vLLM v0.11.2 run of the same grid (December 2025, between InferenceX #273,
# which moved to v0.11.2 on 2025-12-05, and #327, which moved to v0.13.0 on 2026-01-02)
RUNS = (("agg_bmk_run_20667906037.json", 20667906037, "v013", "vLLM v0.13.0 (image vllm/vllm-openai:v0.13.0)"),
        ("agg_bmk_run_20218553330.json", 20218553330, "v0112", "vLLM v0.11.2 (image vllm/vllm-openai:v0.11.2)"))
TRAINING = HERE.parent / "published_moe" / "published.json"
HARDWARE = {"h100": "h100-sxm", "h200": "h200", "b200": "b200"}
SOURCE = ("InferenceMAX (SemiAnalysis; github.com/SemiAnalysisAI/InferenceX) GitHub Actions run {run}, "
          "agg_bmk.json as committed in github.com/gminneci/mantile reconcile/sources/inferencemax/raw/"
          "run_{run}/agg_bmk.json (snapshot 72ff84ebfd56ee0b15bd17d7d49a70fbb4e50256); row hw={hw} "
          "framework=vllm model=openai/gpt-oss-120b tp={tp} ep=1 isl={isl} osl={osl} conc={conc}")
NOTE = "Throughputs are the deployment's (the artifact's per-GPU values x TP); times in ms (the artifact's seconds x 1000)."
LATENCIES = (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el"))


def case_name(row: dict, suffix: str) -> str:
    return f"M_{row['hw']}_tp{row['tp']}_{row['isl']}x{row['osl']}_c{row['conc']}_{suffix}"


def max_model_len(row: dict) -> int:
    """H100: the config's fixed 10240; H200 and B200: the scripts' ISL + OSL + 20 (1k/1k) or + 200."""
    if row["hw"] == "h100":
        return 10240
    return row["isl"] + row["osl"] + (20 if row["isl"] == row["osl"] == 1024 else 200)


def engine(row: dict) -> dict:
    out = {"tensor_parallel_size": row["tp"],
           "max_num_seqs": 512 if row["hw"] == "b200" else row["conc"],  # B200's script: --max-num-seqs 512
           "max_num_batched_tokens": 8192, "enable_chunked_prefill": True, "enable_prefix_caching": False,
           "async_scheduling": True, "block_size": 16, "max_model_len": max_model_len(row),
           "max_cudagraph_capture_size": 2048, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto"}
    if row["hw"] == "b200":  # config.yaml: kv-cache-dtype fp8, pass_config fuse_allreduce_rms
        out.update(kv_cache_dtype="fp8", fuse_allreduce_rms=True)
    return out


def case(row: dict, suffix: str) -> dict:
    def lengths(n: int) -> dict:  # the client's randint(int(0.8 L), L + 1)
        return {"type": "uniform", "low": int(0.8 * n), "high": n}
    return {"name": case_name(row, suffix), "seed": 0, "model": "../../published_moe/models/gpt-oss-120b",
            "hardware": HARDWARE[row["hw"]], "backends": ["sim"],
            "frontend": {"type": "api_server", "endpoint": "completions"}, "engine": engine(row),
            "workload": {"requests": 10 * row["conc"], "prompt_tokens": lengths(row["isl"]),
                         "output_tokens": lengths(row["osl"]),
                         "arrival": {"type": "closed_loop", "clients": row["conc"]}, "seed": 0},
            "output": {"step_requests": False, "plots": False}}


def published(row: dict, run: int, engine_version: str) -> dict:
    tp = row["tp"]
    figures = {"out_tok_s": round(row["output_tput_per_gpu"] * tp, 2), "tot_tok_s": round(row["tput_per_gpu"] * tp, 2)}
    for ours, theirs in LATENCIES:
        for stat, key in (("mean", "mean"), ("p50", "median"), ("p99", "p99")):
            figures[f"{ours}_{stat}"] = round(row[f"{key}_{theirs}"] * 1e3, 3)
    return {"source": SOURCE.format(run=run, **row), "engine_version": engine_version, "note": NOTE,
            "published": figures}


def main() -> None:
    training = json.loads(TRAINING.read_text())
    held_out: dict[str, tuple[dict, dict]] = {}  # name -> (case, published entry)
    skipped = 0
    for file, run, suffix, version in RUNS:
        rows = json.loads((HERE / file).read_text())
        for row in rows:
            name = case_name(row, suffix)
            entry = published(row, run, version)
            if name in training:  # in-sample: the mapping must reproduce the training set's figures; skipped
                mine, theirs = entry["published"], training[name]["published"]
                assert all(abs(mine[k] - theirs[k]) <= 0.01 * abs(theirs[k]) for k in mine if k in theirs), name
                skipped += 1
                continue
            held_out[name] = (case(row, suffix), entry)
    assert skipped == len(training), f"training cases not in the artifacts: {len(training) - skipped}"
    cases_dir = HERE / "cases"
    cases_dir.mkdir(exist_ok=True)
    for old in cases_dir.glob("*.yaml"):
        old.unlink()
    for name, (exp, entry) in sorted(held_out.items()):
        header = (f"# Held-out (judging only; README.md): {entry['source'].split(', agg_bmk')[0]}, "
                  f"{entry['engine_version']}, gpt-oss-120b.\n# Written by build_cases.py; serve flags of InferenceX "
                  "@4e52ed4c6 (README.md).\n")
        (cases_dir / f"{name}.yaml").write_text(header + yaml.safe_dump(exp, sort_keys=False))
    (HERE / "published.json").write_text(
        json.dumps({name: entry for name, (_, entry) in sorted(held_out.items())}, indent=1) + "\n")
    print(f"{len(held_out)} held-out cases written ({skipped} training rows skipped)")


if __name__ == "__main__":
    main()
