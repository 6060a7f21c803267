"""Built-in hardware descriptions (data, same schema as a hardware YAML file).

Peaks, bandwidths and interconnects are vendor datasheet figures (dense, no sparsity; per device;
interconnect bandwidth is per direction). `memory_bytes` is the total the CUDA driver reports (what
vLLM's `gpu_memory_utilization` multiplies), not the datasheet's round number.

The GPU presets are calibrated (`servetwin.sim.gpu_calibration` holds the fit and its sources):
`efficiency` comes from public per-kernel measurements (matmul, FlashAttention, NCCL, memory copy),
the engine's CPU-time coefficients and the remaining GPU-side magnitudes are fitted on the published
end-to-end vLLM runs (`servetwin validate`). One set per GPU, no per-case tuning. Every value's origin
is in `provenance["coefficients"]`. The `cpu` preset stays an uncalibrated placeholder:
`servetwin calibrate` fits real coefficients from measured steps.
"""
from __future__ import annotations

from typing import Any

from servetwin.sim.gpu_calibration import GPU_CALIBRATION

GiB = 2**30
MiB = 2**20


def _gpu(name: str, peak_bf16: float, peak_fp32: float, peak_fp8: float, bandwidth: float,
         memory_bytes: int, link: float, link_latency: float, peak_fp4: float = 0.0) -> dict[str, Any]:
    cal = GPU_CALIBRATION[name]
    return {
        "name": name, "device_type": "cuda",
        "peak_flops_bf16": peak_bf16, "peak_flops_fp32": peak_fp32, "peak_flops_fp8": peak_fp8,
        "peak_flops_fp4": peak_fp4,
        "memory_bandwidth": bandwidth, "memory_bytes": memory_bytes,
        "interconnect_bandwidth": link, "interconnect_latency_s": link_latency,
        "efficiency": dict(cal["efficiency"]),
        "coefficients": dict(cal["coefficients"]),
        "provenance": dict(cal["provenance"]),
    }


HARDWARE_PRESETS: dict[str, dict[str, Any]] = {
    # H100 SXM5 80GB: 989.4 TFLOP/s bf16 / 1978.9 fp8 dense, 3.35 TB/s HBM3, NVLink 4 (900 GB/s
    # bidirectional); CUDA reports 79.11 GiB (vLLM's log: "total_gpu_memory (79.11GiB)").
    "h100-sxm": _gpu("h100-sxm", 989.4e12, 66.9e12, 1978.9e12, 3.35e12, 81008 * MiB, 450e9, 8e-6),
    # H200 SXM 141GB: H100's compute, 4.8 TB/s HBM3e; CUDA reports 139.81 GiB.
    "h200": _gpu("h200", 989.4e12, 66.9e12, 1978.9e12, 4.8e12, 143166 * MiB, 450e9, 8e-6),
    # B200 (HGX, 1000 W): 2250 TFLOP/s bf16 / 4500 fp8 / 9000 fp4 dense, 80 fp32 (NVIDIA's HGX B200 figures
    # as tabulated at glennklockwood.com/garden/processors/B200); 8 TB/s HBM3e; NVLink 5, 1.8 TB/s
    # bidirectional (900 GB/s per direction). Memory: nvidia-smi shows 183,359 MiB (NVIDIA/TensorRT-LLM
    # issue #10278); CUDA reports less by what the driver reserves, taken as the H100's 551 MiB
    # (nvidia-smi 81,559 vs CUDA 81,008 MiB): 182,808 MiB = 178.5 GiB (an estimate, no B200 vLLM log found).
    "b200": _gpu("b200", 2250e12, 80e12, 4500e12, 8.0e12, 182808 * MiB, 900e9, 8e-6, peak_fp4=9000e12),
    # A100 SXM4 80GB: 312 TFLOP/s bf16, no fp8, 2.039 TB/s HBM2e, NVLink 3 (600 GB/s bidirectional);
    # CUDA reports 79.15 GiB.
    "a100-80g": _gpu("a100-80g", 312e12, 19.5e12, 0.0, 2.039e12, 81050 * MiB, 300e9, 10e-6),
    # L40S 48GB: 362.05 TFLOP/s bf16 / 733 fp8 dense, 864 GB/s GDDR6, PCIe 4.0 x16 only;
    # CUDA reports 44.52 GiB.
    "l40s": _gpu("l40s", 362.05e12, 91.6e12, 733e12, 864e9, 45588 * MiB, 32e9, 15e-6),
    "cpu": {
        # The 2-core development machine class (Xeon with AVX-512/AMX, ~24 GiB RAM).
        "name": "cpu", "device_type": "cpu",
        "peak_flops_bf16": 3.2e11, "peak_flops_fp32": 3.2e11,
        "memory_bandwidth": 2.4e10, "memory_bytes": 24 * GiB,
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
