"""Built-in front-end coefficient sets (data, same schema as a front-end YAML file).

`servetwin.sim.frontend.FrontendCoefficients` documents every coefficient; docs/frontend_model.md
says how each set was obtained. Each set carries its provenance.
"""
from __future__ import annotations

from typing import Any

FRONTEND_PRESETS: dict[str, dict[str, Any]] = {
    # vLLM's OpenAI-compatible API server (`vllm serve`, V1, one API-server process) on the host of a
    # GPU server. Ingress magnitudes are a first estimate; the output path and latency_in_s are fitted on the
    # training cases (provenance).
    "vllm": {
        "name": "vllm",
        "coefficients": {
            "c_req_s": 4.0e-3, "c_chat_s": 6.0e-3, "c_prompt_token_s": 2.0e-6,
            "c_hop_s": 5.0e-4, "c_hop_token_s": 2.0e-8,
            "c_step_s": 1.0e-4, "c_token_out_s": 1.0e-5, "c_chunk_s": 3.0e-5, "c_finish_s": 3.0e-4,
            "latency_in_s": 1.0e-2, "latency_out_s": 5.0e-4,
        },
        "provenance": {
            "source": "c_req_s, c_chat_s, c_prompt_token_s, c_hop_s, c_step_s, c_finish_s: first estimate from "
                      "published vLLM 0.11 runs on 1x H100 (shared gpu_reference cases B5, B1; "
                      "docs/frontend_model.md): a burst of 1000 chat requests of 128 tokens is admitted at "
                      "~45 requests/s with the GPU busy about half of the run -> ~11 ms of API-server CPU per "
                      "short chat request (split over HTTP/validation, chat template, tokenisation and the "
                      "engine hop by the proportions measured on servetwin's own server). latency_in_s, "
                      "c_token_out_s, c_chunk_s: grid fit (benchmarks/fit_frontend.py) on the training cases "
                      "only - benchmarks/published_moe (9 x vLLM 0.13, gpt-oss-120b, H100, completions) and "
                      "the shared dense B1/B3/B5 (vLLM 0.11, chat) - minimising the mean over cases of the mean "
                      "|log(predicted/published)|; c_token_out_s fixed at 10 us (incremental detokenisation + "
                      "one RequestOutput), c_chunk_s 30/50/70 us x latency_in_s 10/14/18/25 ms: best 30 us, "
                      "10 ms (50 us ties at 10 ms). The published runs bound the output path: their ITL mean "
                      "equals TPOT within 0.1% up to 8.4k streamed tokens/s, i.e. vLLM wrote one chunk per "
                      "token (no coalescing), so a streamed token costs well under 1/8.4k s",
            "calibrated": True,
            "date": "2026-12-02",
            "engine_version": "vLLM 0.11.0 (V1) chat (B1/B3/B5); vLLM 0.13.0 completions (published_moe)",
            "fit": {"script": "benchmarks/fit_frontend.py", "held_out_used": False,
                    "grid": {"latency_in_s": [0.010, 0.014, 0.018, 0.025], "c_chunk_s": [3e-5, 5e-5, 7e-5],
                             "c_token_out_s": [1e-5]},
                    "previous": {"latency_in_s": 2.5e-2, "c_token_out_s": 5.0e-5, "c_chunk_s": 1.0e-4},
                    "tension": "B1 (vLLM 0.11 chat, 4 clients) wants ~25 ms more front-end latency than the "
                               "vLLM 0.13 completions runs: its TTFT p50 goes -10.5% -> -34%"},
        },
    },
    # servetwin's own API server (core/entrypoints/openai/api_server.py) measured on the 2-core
    # development machine against the fake backend by benchmarks/frontend_costs.py.
    "servetwin": {
        "name": "servetwin",
        "coefficients": {
            "c_req_s": 2.79e-3, "c_chat_s": 8.3e-4, "c_prompt_token_s": 3.0e-7,
            "c_hop_s": 0.0, "c_hop_token_s": 8.6e-7,
            "c_step_s": 5.2e-5, "c_token_out_s": 0.0, "c_chunk_s": 1.09e-4, "c_finish_s": 1.0e-3,
            "latency_in_s": 2.8e-3, "latency_out_s": 0.0,
        },
        "provenance": {
            "source": "measured: python benchmarks/frontend_costs.py --requests 60 (servetwin's API server, "
                      "toy tokenizer, fake backend unpaced; API-server CPU time from /proc over 60 "
                      "sequential requests per kind; msgspec terms timed in-process)",
            "calibrated": True,
            "date": "2026-12-01",
            "machine": "2-core x86_64 VM, Python 3.11.7, load average 8-14 (other jobs running)",
            "measurements": {"completions_128_cpu_s": 2.833e-3, "completions_2000_cpu_s": 5.000e-3,
                             "chat_128_cpu_s": 3.667e-3, "stream_1_cpu_s": 3.833e-3,
                             "stream_65_cpu_s": 10.833e-3, "completions_128_client_p50_s": 5.675e-3,
                             "outputs_msg_per_output_s": 1.10e-5},
            "notes": "CPU-time resolution 10 ms / 60 requests; msgspec's fixed request cost came out "
                     "negative under load (clipped to 0); one sequential stream cannot separate the per-token "
                     "from the per-chunk output cost (all in c_chunk_s)",
        },
    },
}
