"""Built-in front-end coefficient sets (data, same schema as a front-end YAML file).

`servetwin.sim.frontend.FrontendCoefficients` documents every coefficient; docs/frontend_model.md
says how each set was obtained. Each set carries its provenance.
"""
from __future__ import annotations

from typing import Any

FRONTEND_PRESETS: dict[str, dict[str, Any]] = {
    # vLLM's OpenAI-compatible API server (`vllm serve`, V1, one API-server process) on the host of a
    # GPU server. First magnitudes, to be refitted with the GPU cost model on the published cases.
    "vllm": {
        "name": "vllm",
        "coefficients": {
            "c_req_s": 4.0e-3, "c_chat_s": 6.0e-3, "c_prompt_token_s": 2.0e-6,
            "c_hop_s": 5.0e-4, "c_hop_token_s": 2.0e-8,
            "c_step_s": 1.0e-4, "c_token_out_s": 5.0e-5, "c_chunk_s": 1.0e-4, "c_finish_s": 3.0e-4,
            "latency_in_s": 2.5e-2, "latency_out_s": 5.0e-4,
        },
        "provenance": {
            "source": "first estimate from published vLLM 0.11 runs on 1x H100 (shared gpu_reference "
                      "cases B5, B1; docs/frontend_model.md): a burst of 1000 chat requests of 128 "
                      "tokens is admitted at ~45 requests/s with the GPU busy about half of the run "
                      "-> ~11 ms of API-server CPU per short chat request (split over HTTP/validation, "
                      "chat template, tokenisation and the engine hop by the proportions measured on "
                      "servetwin's own server); the low-load TTFT residual of ~50 ms minus that CPU "
                      "time -> latency_in_s; per-token (50 us) + per-chunk (100 us) output costs of the "
                      "order of servetwin's measured 109 us per streamed token",
            "calibrated": False,
            "date": "2026-12-01",
            "engine_version": "vLLM 0.11.0 (V1)",
            "fit": None,
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
