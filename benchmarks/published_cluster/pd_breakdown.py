"""The P/D arm taken apart: what the published figures count, and what the simulated TTFT is made of.

    python benchmarks/published_cluster/pd_breakdown.py [RUNS/pd_gptoss120b_h200_8p_tp1_2d_tp4]

First, from the published report alone (`published.json` here and the percentiles below, all copied from llm-d
guides/pd-disaggregation/README.md, 'Benchmarking Report', rate=45), what its figures count. inference-perf
(kubernetes-sigs/inference-perf) counts a request's output tokens by re-tokenising the streamed text on the
client (`apis/completion.py`, `tokenizer.count_tokens(output_text)`), and computes TPOT = (last chunk - first
chunk) / (output tokens - 1) and ITL as the gaps between per-token timestamps, a chunk's re-tokenised tokens
all taking the chunk's arrival time (`reportgen/base.py`, `summarize_requests`; read at its 2026 versions: the
report does not state which one it ran, its own figures show the client count, 282.7 tokens per request).
So the published output tok/s, TPOT and ITL are on the client's token count, not on the 250 tokens each
request decoded (`max_tokens` 250 with `ignore_eos`), and the chunk times are when the client parsed them.

Second, given a run folder (`servetwin run cases/pd_gptoss120b_h200_8p_tp1_2d_tp4.yaml -o RUNS/NAME`), the
simulated path of every request, in parts that add up to its TTFT: the prefill instance's front end, its
queue, its prefill, the response back to the decode pod, the decode instance's front end, the wait for the
KV read (the read itself shown apart) and the first decode step, and the decode front end's output. Then how
busy each role's engines were and the decode span per token. Measured parts of the simulation; nothing fitted.
"""
from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import pandas as pd

CASE = "pd_gptoss120b_h200_8p_tp1_2d_tp4"
SERVED_OUTPUT_TOKENS = 250  # the workload profile's output_len, sent as max_tokens with ignore_eos
# Percentiles of the report that published.json does not keep (seconds; TPOT in s per client-counted token)
REPORT_PERCENTILES = {
    "ttft": {"p25": 0.927698435029015, "p75": 1.3245190941961482},
    "tpot": {"p1": 0.0003802231368589049, "p25": 0.004326083754862285, "p75": 0.006938906643558673},
    "e2e": {"p25": 2.506768883089535, "p75": 3.000033031741623},
    "itl": {"p50": 1.2325122952461243e-05, "p90": 1.8372898921370506e-05, "p99p9": 0.9875524381587752,
            "max": 2.2948232810012996},
}


def harness_view(pub: dict[str, float], pct: dict[str, dict[str, float]], served: int, decode_instances: int,
                 rate: float) -> dict[str, float]:
    """What the published figures imply on the served-token basis (ms unless named otherwise)."""
    client_tokens = pub["out_tok_s"] / pub["req_s"]  # output tok/s and req/s share the run's span
    span_ms = pub["tpot_mean"] * (client_tokens - 1)  # first chunk -> last chunk, the mean request
    tpot_served = span_ms / (served - 1)
    # a span's IQR from TPOT's; E2E = TTFT + span (+ the [DONE] tail): were they independent, E2E's IQR
    # would be sqrt(IQR_ttft^2 + IQR_span^2) (normal shapes); a smaller one means they move against each other
    iqr_ttft = pct["ttft"]["p75"] - pct["ttft"]["p25"]
    iqr_span = (pct["tpot"]["p75"] - pct["tpot"]["p25"]) * (client_tokens - 1)
    iqr_e2e = pct["e2e"]["p75"] - pct["e2e"]["p25"]
    return {
        "client_tokens_per_request": client_tokens,
        "served_req_s_out_tok_s": pub["req_s"] * served,
        "tpot_served_ms": tpot_served,
        "e2e_minus_ttft_per_token_ms": (pub["e2e_mean"] - pub["ttft_mean"]) / (served - 1),
        "chunk_tokens_per_request": span_ms / pub["itl_mean"] + 1,
        "ttft_span_correlation": (iqr_e2e ** 2 - iqr_ttft ** 2 - iqr_span ** 2) / (2 * iqr_ttft * iqr_span),
        "in_flight_per_decode_instance": rate / decode_instances * served * tpot_served / 1e3,
    }


def harness_rows(view: dict[str, float], pub: dict[str, float], pct: dict[str, dict[str, float]]) -> list[str]:
    itl = pct["itl"]
    return [
        f"== {CASE}: what the published figures count (inference-perf) ==",
        f"output tokens per request as the client counts them: out_tok_s / req_s = "
        f"{view['client_tokens_per_request']:.1f} (decoded: {SERVED_OUTPUT_TOKENS}); on the decoded count the "
        f"published run made {view['served_req_s_out_tok_s']:,.0f} output tok/s",
        f"TPOT {pub['tpot_mean']:.3f} ms per client token = {view['tpot_served_ms']:.2f} ms per decoded token "
        f"(E2E - TTFT over {SERVED_OUTPUT_TOKENS - 1} gaps: {view['e2e_minus_ttft_per_token_ms']:.2f} ms)",
        f"ITL mean {pub['itl_mean']:.3f} ms: the same span over ~{view['chunk_tokens_per_request']:.0f} tokens "
        f"(chunks re-tokenised one by one count more)",
        f"stream delivery: ITL p50 {1e6 * itl['p50']:.0f} us, p90 {1e6 * itl['p90']:.0f} us (most chunks parsed "
        f"back to back, i.e. arriving in bursts), p99.9 {itl['p99p9']:.2f} s, max {itl['max']:.2f} s; "
        f"TPOT p1 {1e3 * pct['tpot']['p1']:.2f} ms (a whole stream in one burst)",
        f"TTFT vs first->last chunk span: correlation ~{view['ttft_span_correlation']:.2f} (from the IQRs; "
        f"a late first chunk comes with a short span: chunks held, then flushed)",
        f"Little's law on the decoded basis: {view['in_flight_per_decode_instance']:.0f} requests in flight per "
        f"decode instance",
    ]


def requests_by_instance(run: str) -> pd.DataFrame:
    """Every engine's request table with the engine's name (`instance`)."""
    frames = []
    for path in sorted(glob.glob(os.path.join(run, "sim", "instances", "*", "requests.parquet"))):
        frame = pd.read_parquet(path)
        frame["instance"] = os.path.basename(os.path.dirname(path))
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def path_parts(run: str) -> pd.DataFrame:
    """Per P/D request (seconds): the parts of its TTFT, in path order, and the KV read; they add up to `ttft`."""
    reqs = requests_by_instance(run)
    is_prefill = reqs.request_id.str.endswith(".prefill")
    pre = reqs[is_prefill].assign(request_id=lambda f: f.request_id.str.removesuffix(".prefill"))
    both = reqs[~is_prefill].merge(pre, on="request_id", suffixes=("", "_p"))
    kv = pd.read_parquet(os.path.join(run, "sim", "kv_transfers.parquet"))
    both = both.merge(kv[["request_id", "start_s", "end_s"]], on="request_id")
    return pd.DataFrame({
        "prefill front end": both.engine_arrival_s_p - both.arrival_s_p,
        "prefill queue": both.first_scheduled_s_p - both.engine_arrival_s_p,
        "prefill": both.first_token_s_p - both.first_scheduled_s_p,
        "prefill response": both.client_finish_s_p - both.first_token_s_p,
        "decode front end": both.engine_arrival_s - both.client_finish_s_p,
        "KV wait (read incl.)": both.first_scheduled_s - both.engine_arrival_s,
        "first decode step": both.first_token_s - both.first_scheduled_s,
        "decode output": both.client_first_token_s - both.first_token_s,
        "ttft": both.client_first_token_s - both.arrival_s,
        "KV read": both.end_s - both.start_s,
        "span per token": (both.client_finish_s - both.client_first_token_s) / (both.output_tokens - 1),
    })


def busy_fraction(run: str, role: str) -> float:
    """Mean over the role's engines (those that served `.prefill` requests, or the others) of the share of
    the run their steps took (from first step to last)."""
    reqs = requests_by_instance(run)
    served_prefill = reqs.groupby("instance").request_id.agg(lambda ids: ids.str.endswith(".prefill").any())
    shares = []
    for name, is_prefill in served_prefill.items():
        if is_prefill == (role == "prefill"):
            steps = pd.read_parquet(os.path.join(run, "sim", "instances", name, "steps.parquet"))
            shares.append(steps.duration_s.sum() / (steps.t_end_s.max() - steps.t_start_s.min()))
    return float(np.mean(shares))


def path_rows(run: str) -> list[str]:
    parts = path_parts(run)
    rows = [f"== the simulated path ({len(parts)} requests; ms) ==", "| part | mean | p50 | p99 |", "|---|---:|---:|---:|"]
    for name in parts.columns:
        col = 1e3 * parts[name]
        rows.append(f"| {name} | {col.mean():.2f} | {col.median():.2f} | {col.quantile(0.99):.2f} |")
    rows.append(f"prefill engines busy {100 * busy_fraction(run, 'prefill'):.0f}% of the run, decode engines "
                f"{100 * busy_fraction(run, 'decode'):.0f}%")
    return rows


def main(argv: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "published.json"), encoding="utf-8") as f:
        pub = json.load(f)[CASE]["published"]
    view = harness_view(pub, REPORT_PERCENTILES, SERVED_OUTPUT_TOKENS, decode_instances=2, rate=45.0)
    print("\n".join(harness_rows(view, pub, REPORT_PERCENTILES)))
    if argv:
        print("\n" + "\n".join(path_rows(argv[0])))


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
