"""Sanity table of what held-out users will ask: gpt-oss-120b on H200 and B200, TP 1/2/4/8, 1k/1k,
1k/8k and 8k/1k tokens, 4..128 closed-loop clients - predictions only, nothing fitted or compared.

    .venv/bin/python benchmarks/moe_heldout_sanity.py [--hw h200,b200] [--tp 1,2,4,8] [--conc 4,32,128]
        [--shapes 1024x1024,1024x8192,8192x1024] [--requests-per-client 2]

Each run is benchmarks/published_moe's TP8 case (InferenceMAX's vLLM 0.13 serve flags, the client's
uniform [0.8 L, L] lengths) with the GPU, TP, lengths and concurrency replaced; B200 runs take the B200
scripts' kv_cache_dtype fp8 and fuse_allreduce_rms. Prints per run: output tok/s (all GPUs), per GPU, TPOT
mean, TTFT p50 / mean, the KV pool's peak use, the API server's CPU share and what binds (experiments/run/binding.py). Checks every
figure is finite and positive; says which TP is slower than the one below it at the same load.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from servetwin.experiments.validate.published import run_case

CASE = Path(__file__).parent / "published_moe" / "cases" / "M_h100_tp8_1024x1024_c64_v013.yaml"
B200_ENGINE = ["engine.kv_cache_dtype=fp8", "engine.fuse_allreduce_rms=true"]


def overrides(hw: str, tp: int, isl: int, osl: int, conc: int, per_client: int) -> list[str]:
    out = [f"hardware={hw}", f"engine.tensor_parallel_size={tp}", f"engine.max_num_seqs={conc}",
           f"workload.requests={per_client * conc}", f"workload.arrival.clients={conc}",
           f"workload.prompt_tokens.low={int(0.8 * isl)}", f"workload.prompt_tokens.high={isl}",
           f"workload.output_tokens.low={int(0.8 * osl)}", f"workload.output_tokens.high={osl}"]
    return out + (B200_ENGINE if hw == "b200" else [])


def row(hw: str, tp: int, isl: int, osl: int, conc: int, per_client: int) -> dict:
    try:
        sim, _ = run_case(CASE, overrides=overrides(hw, tp, isl, osl, conc, per_client))
    except Exception as e:  # noqa: BLE001 - the table reports it
        return {"error": f"{type(e).__name__}: {e}"}
    figs = {"out_tok_s": sim.get("output_tok_s"), "tpot_ms": 1e3 * (sim.get("tpot_s") or {}).get("mean", math.nan),
            "ttft_p50_ms": 1e3 * (sim.get("ttft_s") or {}).get("p50", math.nan),
            "ttft_mean_ms": 1e3 * (sim.get("ttft_s") or {}).get("mean", math.nan)}
    bad = [k for k, v in figs.items() if k != "api_cpu" and v is None or not math.isfinite(v) or v <= 0]
    kv = sim.get("kv_peak_usage")
    figs["api_cpu"] = (sim.get("frontend") or {}).get("cpu_utilization")
    binding = (sim.get("binding") or {}).get("resource", "?")
    return {**figs, "kv_peak": kv, "binding": binding, "bad": bad}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hw", default="h200,b200")
    p.add_argument("--tp", default="1,2,4,8")
    p.add_argument("--conc", default="4,32,128")
    p.add_argument("--shapes", default="1024x1024,1024x8192,8192x1024")
    p.add_argument("--requests-per-client", type=int, default=2)
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    print("| GPU | in/out | clients | TP | out tok/s | per GPU | TPOT ms | TTFT p50 / mean ms | KV peak | API CPU | binds |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    problems = []
    for hw in a.hw.split(","):
        for isl, osl in shapes:
            for conc in ints(a.conc):
                prev = None
                for tp in ints(a.tp):
                    r = row(hw, tp, isl, osl, conc, a.requests_per_client)
                    name = f"{hw} {isl}/{osl} c{conc} TP{tp}"
                    if "error" in r:
                        print(f"| {hw} | {isl}/{osl} | {conc} | {tp} | error: {r['error']} ||||||", flush=True)
                        problems.append(f"{name}: {r['error']}")
                        continue
                    if r["bad"]:
                        problems.append(f"{name}: not finite/positive: {r['bad']}")
                    if prev is not None and r["out_tok_s"] < prev[1]:
                        problems.append(f"{name}: {r['out_tok_s']:.0f} tok/s, slower than TP{prev[0]}'s {prev[1]:.0f}")
                    prev = (tp, r["out_tok_s"])
                    kv = _pct(r["kv_peak"])
                    print(f"| {hw} | {isl}/{osl} | {conc} | {tp} | {r['out_tok_s']:,.0f} | {r['out_tok_s'] / tp:,.0f} | "
                          f"{r['tpot_ms']:.2f} | {r['ttft_p50_ms']:.0f} / {r['ttft_mean_ms']:.0f} | {kv} | "
                          f"{_pct(r['api_cpu'])} | {r['binding']} |", flush=True)
    print("\n" + ("\n".join(problems) if problems else "no errors, every figure finite, TP never slower than the TP below"))
    return 1 if any("error" in x or "not finite" in x for x in problems) else 0


if __name__ == "__main__":
    sys.exit(main())
