"""Built-in hardware descriptions (data, same schema as a hardware YAML file).

Peaks, bandwidths and memory sizes are vendor datasheet figures (dense, no sparsity; per device;
interconnect bandwidth is per direction). The cost-model coefficients here are NOT calibrated:
the roofline multipliers are 1 (ideal datasheet roofline) and the fixed overheads are rough
placeholders. `servetwin.sim.calibration` fits real coefficients from measured steps; save those as a YAML
file (`base: <preset>` plus `coefficients` and `provenance`) and load it by path.
"""
from __future__ import annotations

from typing import Any

_UNCALIBRATED_GPU = {
    "source": "vendor datasheet (peak FLOP/s, memory bandwidth, memory size, interconnect); "
              "cost coefficients are uncalibrated placeholders (roofline multipliers 1.0, "
              "overheads guessed)",
    "calibrated": False,
    "date": None,
    "device": None,
    "versions": {},
    "samples": 0,
    "residuals": None,
}

# Placeholder overheads for a CUDA GPU: ~0.5 ms per step (schedule, prepare inputs, sample,
# detokenize), 10 us per request, ~20 us per layer when the step runs eagerly (kernel launches).
_GPU_PLACEHOLDER_COEFFICIENTS = {
    "c_step": 5.0e-4, "c_req": 1.0e-5, "c_token": 0.0, "c_layer": 2.0e-5,
    "c_linear": 1.0, "c_attn_prefill": 1.0, "c_attn_decode": 1.0, "c_attn_shared": 1.0, "c_lm_head": 1.0, "c_comm": 1.0,
    "c_ipc_step": 0.0, "c_ipc_req": 0.0,
}

HARDWARE_PRESETS: dict[str, dict[str, Any]] = {
    "h100-sxm": {
        "name": "h100-sxm", "device_type": "cuda",
        "peak_flops_bf16": 989.4e12, "peak_flops_fp32": 66.9e12,
        "memory_bandwidth": 3.35e12, "memory_bytes": 81559 * 2**20,
        "interconnect_bandwidth": 450e9, "interconnect_latency_s": 8e-6,  # NVLink 4, 900 GB/s bidir.
        "coefficients": dict(_GPU_PLACEHOLDER_COEFFICIENTS),
        "provenance": dict(_UNCALIBRATED_GPU),
    },
    "h200": {
        "name": "h200", "device_type": "cuda",
        "peak_flops_bf16": 989.4e12, "peak_flops_fp32": 66.9e12,
        "memory_bandwidth": 4.8e12, "memory_bytes": 143771 * 2**20,
        "interconnect_bandwidth": 450e9, "interconnect_latency_s": 8e-6,
        "coefficients": dict(_GPU_PLACEHOLDER_COEFFICIENTS),
        "provenance": dict(_UNCALIBRATED_GPU),
    },
    "a100-80g": {
        "name": "a100-80g", "device_type": "cuda",
        "peak_flops_bf16": 312e12, "peak_flops_fp32": 19.5e12,
        "memory_bandwidth": 2.039e12, "memory_bytes": 81920 * 2**20,
        "interconnect_bandwidth": 300e9, "interconnect_latency_s": 10e-6,  # NVLink 3, 600 GB/s bidir.
        "coefficients": dict(_GPU_PLACEHOLDER_COEFFICIENTS),
        "provenance": dict(_UNCALIBRATED_GPU),
    },
    "l40s": {
        "name": "l40s", "device_type": "cuda",
        "peak_flops_bf16": 362.05e12, "peak_flops_fp32": 91.6e12,
        "memory_bandwidth": 864e9, "memory_bytes": 46068 * 2**20,
        "interconnect_bandwidth": 32e9, "interconnect_latency_s": 15e-6,  # PCIe 4.0 x16, no NVLink
        "coefficients": dict(_GPU_PLACEHOLDER_COEFFICIENTS),
        "provenance": dict(_UNCALIBRATED_GPU),
    },
    "cpu": {
        # The 2-core development machine class (Xeon with AVX-512/AMX, ~24 GiB RAM).
        "name": "cpu", "device_type": "cpu",
        "peak_flops_bf16": 3.2e11, "peak_flops_fp32": 3.2e11,
        "memory_bandwidth": 2.4e10, "memory_bytes": 24 * 2**30,
        "interconnect_bandwidth": 0.0, "interconnect_latency_s": 0.0,
        "coefficients": {
            "c_step": 1.0e-3, "c_req": 5.0e-5, "c_token": 1.0e-6, "c_layer": 1.5e-4,
            "c_linear": 1.0, "c_attn_prefill": 1.0, "c_attn_decode": 1.0, "c_attn_shared": 1.0, "c_lm_head": 1.0,
            "c_comm": 1.0, "c_ipc_step": 0.0, "c_ipc_req": 0.0,
        },
        "provenance": {
            "source": "uncalibrated placeholder: fp32 peak and copy bandwidth from a one-off numpy "
                      "probe on the 2-core dev machine (2048^2 sgemm ~319 GFLOP/s, memcpy ~24 GB/s); "
                      "bf16 peak set equal to fp32 (unmeasured); overheads guessed",
            "calibrated": False,
            "date": None,
            "device": "2-core Intel Xeon (AVX-512, AMX), 24 GiB",
            "versions": {},
            "samples": 0,
            "residuals": None,
        },
    },
}
