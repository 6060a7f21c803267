"""The GPU presets' calibrated efficiencies and coefficients, each with where its value comes from.

Two kinds of evidence, kept apart:
- per-kernel public measurements fix the physical efficiencies (`Efficiency`): how close dense
  matmuls, FlashAttention and NCCL collectives get to the datasheet, and how that depends on shape;
- the published end-to-end vLLM runs under `servetwin validate`'s case directory (H100, vLLM 0.11
  and the 2024 dashboard) fit what no kernel benchmark shows: the engine's CPU time per step and
  per request, the bandwidth fraction decode reaches inside vLLM, the GEMM half-saturation size.
One set per GPU, transferred across models, lengths and load; nothing is tuned per case. The A100
set fits its two kernel rates (GEMM, vLLM's paged FlashAttention-2) on one model's published A100
runs (Qwen3-14B) and is judged on another's (Qwen3-32B). GPUs without an end-to-end case (H200,
L40S) take the engine's CPU terms from the H100 fit (same software on a comparable host) and their
efficiencies from their own kernel measurements or stated assumptions.
"""
from __future__ import annotations

from typing import Any

# -- sources (cited by the provenance records below) ------------------------------------------------
MAMF = ("stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS "
        "comparison table' (bf16 torch.matmul, best shape): H100 SXM 792.1 of 989 TFLOPS (80.1%), "
        "H100/H200 SXM 794.5 (80.3%), A100 SXM 267.9 of 312 (85.9%); fp8 (float8_e4m3fn, same table, "
        "torch 2.7): H100 SXM 1402.6 of 1979 (70.9%), H200 SXM 1453.4 (73.4%)")
MAMF_FP8 = (f"{MAMF}: fp8 GEMMs reach 70.9 / 80.3 = 0.883 of the bf16 fraction on an H100 SXM (H200: "
            f"73.4 / 80.3 = 0.914); the in-engine fraction is assumed to scale the same way")
FA3 = ("FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608), forward speed, head dim 128, H100 80GB SXM5, "
       "bf16: 467/565/625/638/646/648 TFLOPS at sequence 512/1k/2k/4k/8k/16k; least-squares fit of "
       "e*x/(x+h) with x = keys per query: e = 0.66, h = 215")
FA2 = ("FlashAttention-2 (Dao 2023, arXiv:2307.08691): forward reaches up to ~73% of A100's 312 TFLOPS "
       "at long sequences (head dim 128), ~50% at 512; on H100 FA2 reaches 309-370 TFLOPS (FA3 paper, "
       "same figure)")
NCCL = ("nccl-tests all_reduce_perf reference bus bandwidth at large messages (docs.alayanew.com, "
        "'NCCL-tests in practice'): 8xH100 SXM5 NVLink 460-480 GB/s, 8xA100 SXM4 230-250 GB/s, "
        "H100 PCIe without NVLink 35-45 GB/s; fewer GPUs and mid-size messages reach less")
HBM = ("sustained H100 HBM3 bandwidth: 3.02 TB/s device-to-device copy, 3.09 TB/s STREAM triad "
       "(0.90-0.92 of 3.35 TB/s), public measurement log; weight streaming inside GEMMs reaches less")
E2E = ("fitted on the published vLLM H100 runs (servetwin validate, cases A_latency_llama8b_tp1_h100, "
       "A_throughput_llama8b_tp1_h100, B1_qwen3_8b_h100_sharegpt_c4, B3_qwen3_14b_h100_random_2k, "
       "B5_qwen3_14b_h100_random_128; GPUStack performance lab and vLLM's 2024 performance dashboard)")
FA2_PAGED = ("vllm-project/flash-attention (the FlashAttention-2 build vLLM runs on sm80/sm89), "
             "csrc/flash_attn/flash_api.cpp mha_varlen_fwd: a paged-KV call runs the split-KV kernel "
             "(flash_fwd_launch_template.h run_mha_fwd_splitkv_dispatch and its num_splits == 1 variant "
             "run_mha_fwd_splitkv_align: kBlockM = 64 in both); the GQA swap that packs a KV head's query heads into the tile "
             "(seqlenq_ngroups_swapped) needs max_seqlen_q == 1, i.e. a decode-only call. vLLM V1's "
             "FlashAttention backend sends a step's chunks and decodes in one varlen call, so beside a chunk "
             "each decode row pays a 64-row query tile per query head")
FA3_PACK = ("vllm-project/flash-attention hopper/flash_api.cpp get_pack_gqa: FlashAttention-3 packs GQA heads "
            "for paged KV without TMA and for every varlen call (should_pack_gqa), so a decode row beside a "
            "chunk costs what it costs in a decode-only step: 0")
E2E_A100 = ("fitted on the published vLLM 0.11 A100 80GB runs of Qwen3-14B (GPUStack performance lab, "
            "qwen3-14b/a100.md: ShareGPT 1000 and random 128/2k/4k/32k; benchmarks/published_cases, "
            "benchmarks/fit_gpu_presets.py --preset a100-80g): a grid over gemm_compute x "
            "attn_prefill_compute, optimum 0.80 / 0.50. The same lab's Qwen3-32B A100 runs stay held out")
MARLIN = ("MARLIN (Frantar et al., PPoPP 2025; IST-DASLab/marlin README): the W4A16 kernel stays within 5% of "
          "the ideal 3.87x weight-streaming speedup up to batch 16-32 and is ~10% slower than FP16 at large "
          "(compute-bound) batches; built on Ampere mma.sync, not Hopper's wgmma")
E2E_MOE = ("fitted on the nine published vLLM 0.13 gpt-oss-120b H100 runs (benchmarks/published_moe: "
           "InferenceMAX run 20667906037, TP 2/4/8 x 4/16/64 clients, 1k/1k; benchmarks/fit_gpu_presets.py "
           "benchmarks/published_moe --grid c_moe_layer=... --grid mxfp4_bandwidth=...)")
MXFP4_PAD = ("vllm-project/vllm model_executor/layers/quantization/mxfp4.py "
             "(mxfp4_round_up_hidden_size_and_intermediate_size): Marlin pads the hidden size to 256 and each "
             "rank's expert width to 128 (n % 256, k % 128), FlashInfer TRT-LLM both to 256, CUTLASS both to 128")
ASSUMED_MOE = ("compute assumed (no public compute-bound figure used): vLLM's Triton fused_moe with its tuned H100 "
               "configs, a little above the fitted dense in-engine fraction; BLOCK_SIZE_M 16-128 in vLLM's tuned "
               "configs (vllm-project/vllm PR #3389), about half a 64-row tile padded per touched expert")
TRITON_MOE = ("bandwidth: vllm-project/vllm PR #39902/#39904 ('Add tuned triton fused_moe configs on H100 for "
              "gpt-oss'): tuned bf16 fused_moe kernel times for gpt-oss-120b's experts (E=128, top-4, 2880 x 2880) "
              "at batch 1 / 8 / 256 / 512 / 1024: 85 / 502 / 2130 / 2200 / 2314 us, i.e. 0.70 / 0.85 / 0.90 / "
              "0.87 / 0.84 of the H100's 3.35 TB/s for the touched experts' bytes (n(T) as in moe_cost): median "
              "0.85")
TRITON_MXFP4_DEFAULT = ("vllm model_executor/layers/fused_moe/oracle/mxfp4.py _get_priority_backends_for_gpt_oss: "
                        "FLASHINFER_TRTLLM (Blackwell only) ... TRITON before MARLIN; experts/gpt_oss_triton_kernels_"
                        "moe.py admits SM 9.0-12.x. vllm-project/vllm PR #25488: Marlin 'worse TTFT and TPOT' than "
                        "OAITritonExperts")
# The one rate fitted for this kernel (docs/cost_model.md, "gpt-oss-120b in the llm-d runs"): its large-M compute
# fraction, from the two public prefill figures of default-backend gpt-oss deployments (both training cases)
TRITON_MXFP4_COMPUTE = 0.69
TRITON_MXFP4_FIT = ("compute: fitted (benchmarks/published_cluster/calibrate_prefill.py --fit) so that llm-d's "
                    "calibrate.sh, replayed on the simulated deployments, measures what it measured on the real "
                    "ones: peakPrefillThroughput = 8,192 / median TTFT of 8,192-token random prompts sent one at "
                    "a time through the router (llm-d guides/recipes/router/calibration/README.md): 39,065 tok/s "
                    "on H100 TP1 aggregated (configuration-matrix.md, row gpu/vllm/gpt-oss, vLLM v0.22.0; the "
                    "routing arms' servers) and 33,821 through the full P/D path on H200 (8 prefill pods TP1, the "
                    "P/D guide's router values; the P/D arm). 0.69 gives 39,440 (+1.0%) and 33,510 (-0.9%); the "
                    "earlier 0.405 read 33,821 as a bare 5,000-token prefill rate and was 24% slow on both "
                    "(Marlin: 0.35)")
B200_SPEC = ("NVIDIA HGX B200 (1000 W) dense peaks, 8 TB/s HBM3e, NVLink 5 (1.8 TB/s bidirectional): "
             "glennklockwood.com/garden/processors/B200 and NVIDIA's HGX B200 figures")
FI_TRTLLM_MOE = ("flashinfer-ai/flashinfer PR #1475 ('Trtllm-gen Fp4 MoE Autotunner', 2025-08-12), B200 with the clock "
                 "locked at 1500 MHz, mxfp4 x mxfp8, benchmarks/bench_trtllm_gen_fused_moe_autotuner.py's default "
                 "shape (128 experts, top-4, hidden 3072 x intermediate 3072: gpt-oss-120b at TP1 as the TRT-LLM "
                 "layout pads it): one trtllm_fp4_block_scale_moe call (routing, both grouped GEMMs, finalize) "
                 "42 / 57 / 81 / 105 / 183 / 246 / 348 us at 1 / 2 / 4 / 8 / 16 / 32 / 64 tokens (tuned; 64 "
                 "untuned). Least squares of a + n(T) x one expert's 15.06 MB / (8 TB/s x bandwidth), n(T) as in "
                 "moe_cost: bandwidth 0.68 (0.68-0.71 over row subsets; residuals -8..+8%), a = 33 us. Measured "
                 "under a locked clock with FlashInfer of 2025-08 (vLLM 0.13 ships later tactics), so a lower "
                 "bound on what the kernel streams in the runs modelled")
B200_FLOOR = (f"the H100's 75 us carried. Public kernel latencies do not support a lower B200 floor: the MoE call's fixed "
              f"part on B200 (a = 33 us, {FI_TRTLLM_MOE.split(': one')[0]}) is not below a Hopper fused-MoE chain's "
              f"(vLLM PR #39902's H100 fused_topk + fused_experts for gpt-oss's bf16 experts at batch 1 / 8 / 256 / 512 "
              f"/ 1024: 85 / 502 / 2130 / 2200 / 2314 us, least squares 12-24 us fixed; + ~6 us router GEMM at batch 1 "
              f"with cuBLAS, vLLM PR #37205), and the rest of the fitted floor is the layer's other small kernels "
              f"(attention, norms, rope/KV write, all-reduces) under the graph, for which no B200 figure was found")
ASSUMED_B200 = ("no B200 end-to-end case in the training set and no public per-kernel fraction used: the H100's "
                "fractions of the datasheet (in-engine GEMM, FlashAttention-3-class attention, NCCL, the fitted "
                "MoE kernel fractions) are transferred to the B200's own peaks and bandwidth")
ASSUMED_L40S = ("no public MAMF/FlashAttention figure found for L40S: Ada-generation fractions assumed "
                "(power-limited 350 W part: in-engine matmul ~45% of peak, FlashAttention-2 ~55%)")

# Fitted by benchmarks/fit_gpu_presets.py (2 rounds, loss 0.1235 = mean |log error| per case):
# gemm_compute 0.3867, gemm_half_m 38.05, gemm_bandwidth 0.80, attn_decode_bandwidth 0.4673,
# c_step 1.5e-3, c_req 1e-6 (the search's lower bound: per-request CPU is not resolved by these cases).
_H100_EFF = {
    "gemm_compute": 0.387, "gemm_half_m": 38.0, "gemm_bandwidth": 0.80, "gemm_fp8_relative": 0.883,
    "attn_prefill_compute": 0.66, "attn_prefill_half_kv": 215.0, "attn_prefill_bandwidth": 0.80,
    "attn_decode_compute": 0.30, "attn_decode_bandwidth": 0.467, "comm_bandwidth": 0.80,
}
# MoE grouped GEMMs on Hopper, per expert storage format (servetwin.sim.coefficients.MoEKernel)
_H100_MOE = {
    # VLLM_MXFP4_USE_MARLIN=1 (the published runs): Marlin W4A16, MXFP4 weights dequantised to bf16 in registers
    "mxfp4": {"kernel": "marlin_w4a16_moe", "peak": "bf16", "compute": 0.35, "half_rows": 16.0, "bandwidth": 0.90,
              "align_hidden": 256, "align_intermediate": 128},
    "bf16": {"kernel": "triton_fused_moe", "peak": "bf16", "compute": 0.55, "half_rows": 32.0, "bandwidth": 0.85},
    "fp8": {"kernel": "triton_fused_moe_fp8_block", "peak": "fp8", "compute": 0.45, "half_rows": 32.0,
            "bandwidth": 0.75},
}
_H100_EFF["moe_kernels"] = _H100_MOE
# Hopper only (vLLM's device gate for the OpenAI Triton MoE kernels is SM 9.0-12.x): `moe_backend: triton`
_HOPPER_MOE = {**_H100_MOE, "mxfp4_triton": {
    "kernel": "oai_triton_matmul_ogs", "peak": "bf16", "compute": TRITON_MXFP4_COMPUTE, "half_rows": 16.0,
    "bandwidth": 0.90, "align_hidden": 256, "align_intermediate": 64}}
_H100_COEF = {
    "c_step": 1.5e-3, "c_req": 1.0e-6, "c_token": 0.0, "c_layer": 4.0e-5, "c_layer_piecewise": 1.0e-5,
    "c_linear": 1.0, "c_elementwise": 1.0, "c_attn_prefill": 1.0, "c_attn_decode": 1.0, "c_attn_shared": 1.0,
    "c_lm_head": 1.0, "c_sampler": 1.0, "c_comm": 1.0, "c_tp_step": 5.0e-4, "c_ipc_step": 0.0, "c_ipc_req": 0.0,
    "c_moe": 1.0, "c_moe_layer": 7.5e-5,
}
_H100_SOURCES = {
    "efficiency.gemm_compute": (f"{E2E}: the compute-bound 8192-token steps of B3 (ITL p99 642 ms, TPOT "
                                f"206 ms) need 38.7% of the dense peak inside vLLM 0.11, half of what an "
                                f"isolated matmul reaches ({MAMF}); the gap (sustained clocks under load, "
                                f"the GEMM shapes of 5120-wide models, unfused epilogues) is not resolved "
                                f"per kernel by the data"),
    "efficiency.gemm_half_m": f"{E2E}: small-chunk steps of B1 and A_throughput",
    "efficiency.gemm_bandwidth": f"{E2E}; bounded by {HBM}",
    "efficiency.gemm_fp8_relative": MAMF_FP8,
    "efficiency.attn_prefill_compute": FA3,
    "efficiency.attn_prefill_half_kv": FA3,
    "efficiency.attn_prefill_bandwidth": "as gemm_bandwidth",
    "efficiency.attn_decode_compute": "decode attention is bandwidth-bound for GQA models; placeholder",
    "efficiency.attn_decode_bandwidth": E2E,
    "efficiency.attn_mixed_decode_rows": FA3_PACK,
    "efficiency.comm_bandwidth": NCCL,
    "coefficients.c_step": E2E, "coefficients.c_req": E2E, "coefficients.c_token": E2E,
    "coefficients.c_layer": "eager launches: ~10 kernels per layer at a few us each (enforce_eager)",
    "coefficients.c_layer_piecewise": "vLLM V1 piecewise graphs: attention launched per layer",
    "coefficients.c_tp_step": "vLLM's multiproc executor: SchedulerOutput broadcast to the workers per step",
    "coefficients.roofline terms (c_linear .. c_comm)": "1.0: the physics as stated by the efficiencies",
    "coefficients.c_moe": "1.0: the physics as stated by efficiency.moe_kernels",
    "coefficients.c_moe_layer": (f"{E2E_MOE}: the per-step time the rooflines leave unexplained at 4 clients is "
                                 f"the same at TP 2, 4 and 8 (~2.4 ms over 36 MoE layers): the floor of the MoE "
                                 f"block's small kernels (router, top-k, align/sort, two grouped GEMMs, "
                                 f"activation, combine) under the CUDA graph"),
    "efficiency.moe_kernels": {
        "mxfp4": (f"Marlin W4A16 MoE (VLLM_MXFP4_USE_MARLIN=1): compute = 0.9 x the fitted dense in-engine "
                  f"fraction ({MARLIN}); bandwidth {E2E_MOE}; half_rows: Marlin's MoE block of 8-64 rows per "
                  f"expert, about half a 32-row tile padded per touched expert; alignments {MXFP4_PAD}"),
        "bf16": f"{TRITON_MOE}; {ASSUMED_MOE}",
        "fp8": f"{ASSUMED_MOE}; at the fp8 peak x gemm_fp8_relative's ratio ({MAMF_FP8}); bandwidth assumed",
    },
}


_HOPPER_SOURCES = {**_H100_SOURCES, "efficiency.moe_kernels": {
    **_H100_SOURCES["efficiency.moe_kernels"],
    "mxfp4_triton": (f"the OpenAI Triton kernels (OAITritonExperts, triton_kernels.matmul_ogs), vLLM's default MXFP4 "
                     f"MoE on Hopper (--moe-backend auto: {TRITON_MXFP4_DEFAULT}); {TRITON_MXFP4_FIT}; half_rows and "
                     f"bandwidth: Marlin's (no public small-batch timing of matmul_ogs on Hopper found); alignments: "
                     f"each rank's expert width to 64 (vLLM 0.33 mxfp4_round_up_hidden_size_and_intermediate_size, "
                     f"CUDA TRITON branch), the hidden size to 256 as the weights' footprint says: vllm-project/"
                     f"vllm issue #33155 (vLLM 0.14.1, 'Using Triton backend', one H100) logs 'Model loading took "
                     f"64.38 GiB', this layout gives 64.50 (unpadded hidden: 60.71; Marlin's layout 65.84 against "
                     f"65.97 logged with Marlin in issue #23278)")}}


def _record(sources: dict[str, str], note: str, validated_on: str, fitted: bool = True) -> dict[str, Any]:
    """`fitted`: the preset's own values were fitted on published runs of that GPU (`calibrated`); a
    preset that only carries another GPU's fit is not calibrated. `validated_on`: the runs it was judged
    on and its error there (docs/published_vllm.md), what `servetwin presets` and a run's report show."""
    return {"source": note, "calibrated": fitted, "date": "2026-12-01", "device": None,
            "versions": {"vllm": "0.11.0 (V1) / 2024 dashboard (V0)"}, "samples": 5 if fitted else 0,
            "residuals": "see docs/published_vllm.md", "validated_on": validated_on, "coefficients": dict(sources)}


# what each preset was judged on, median |error| (docs/published_vllm.md; benchmarks/published_moe_heldout)
VALIDATED_H100 = ("fitted on 5 published H100 vLLM runs (in-sample); held out: 6 GPUStack Qwen3 runs (Qwen3-14B "
                  "throughput 2.9%, TPOT 7.7%; Qwen3-32B 15-20% fast) and 77 gpt-oss-120b runs (throughput 5.5%, "
                  "TPOT 6.6%)")
VALIDATED_H200 = ("not fitted (H100's values); held out: 102 gpt-oss-120b H200 runs, throughput 5.0%, TPOT 5.5% "
                  "(4.9% optimistic)")
VALIDATED_B200 = ("not fitted (datasheet peaks, H100's fractions); held out: 112 gpt-oss-120b B200 runs, "
                  "throughput 16.3%, TPOT 19.6%: predicted ~16-19% slow")
VALIDATED_A100 = ("fitted on 5 GPUStack A100 Qwen3-14B runs; held out: 5 Qwen3-32B runs, throughput 4.9%, TPOT "
                  "4.8%, TTFT 5.5%")
VALIDATED_L40S = "not fitted, no published case: assumed fractions, an estimate never judged on a run"


GPU_CALIBRATION: dict[str, dict[str, Any]] = {
    "h100-sxm": {"efficiency": {**_H100_EFF, "moe_kernels": _HOPPER_MOE}, "coefficients": dict(_H100_COEF),
                 "provenance": _record(_HOPPER_SOURCES, "per-kernel public measurements + fit on the published "
                                                      "vLLM H100 runs", VALIDATED_H100)},
    "h200": {"efficiency": {**_H100_EFF, "gemm_fp8_relative": 0.914, "moe_kernels": _HOPPER_MOE},
             "coefficients": dict(_H100_COEF),
             "provenance": _record({**_HOPPER_SOURCES, "all": "H100's set: same GH100 die and software; only the "
                                    "datasheet bandwidth and memory differ"},
                                   "H100's calibration transferred (same compute die); no H200 run in the fit",
                                   VALIDATED_H200, fitted=False)},
    "b200": {"efficiency": {**_H100_EFF, "moe_kernels": {
        # FlashInfer's TRT-LLM MoE for MXFP4 weights with MXFP8 activations (tcgen05 at the fp8 rate)
        "mxfp4": {**_H100_MOE["mxfp4"], "kernel": "flashinfer_trtllm_mxfp4_mxfp8", "peak": "fp8", "compute": 0.35,
                  "align_hidden": 256, "align_intermediate": 256},
        # NVFP4 x NVFP4 (FlashInfer CUTLASS / TRT-LLM): the fp4 rate
        "nvfp4": {**_H100_MOE["mxfp4"], "kernel": "flashinfer_cutlass_nvfp4", "peak": "fp4", "compute": 0.35,
                  "align_hidden": 128, "align_intermediate": 128},
        "bf16": _H100_MOE["bf16"], "fp8": _H100_MOE["fp8"]}},
             "coefficients": dict(_H100_COEF),
             "provenance": _record({**{k: ASSUMED_B200 for k in _H100_SOURCES if k.startswith("efficiency.")},
                                    **{k: v for k, v in _H100_SOURCES.items() if k.startswith("coefficients.")},
                                    "coefficients.c_moe_layer": B200_FLOOR,
                                    "efficiency.moe_kernels": {
                                        "mxfp4": (f"FlashInfer TRT-LLM MXFP4 x MXFP8 MoE at the fp8 peak; {ASSUMED_B200}; "
                                                  f"{MXFP4_PAD}. Not adopted: {FI_TRTLLM_MOE}; the H100's 0.90 is an "
                                                  f"end-to-end fit that may absorb routing skew (the kernel benchmark "
                                                  f"routes uniformly), so the isolated kernel's figure is not "
                                                  f"transferred alone"),
                                        "nvfp4": (f"FlashInfer CUTLASS NVFP4 MoE at the fp4 peak; {ASSUMED_B200}; "
                                                  f"alignments as CUTLASS MXFP4's ({MXFP4_PAD})"),
                                        "bf16": f"{TRITON_MOE}; {ASSUMED_MOE}", "fp8": ASSUMED_MOE},
                                    "peaks": B200_SPEC},
                                   "B200 datasheet peaks; H100's fractions and engine CPU terms transferred (no "
                                   "B200 case in the training set)", VALIDATED_B200, fitted=False)},
    "a100-80g": {"efficiency": {**_H100_EFF, "gemm_compute": 0.80, "gemm_fp8_relative": 1.0,
                                "attn_prefill_compute": 0.50, "attn_prefill_half_kv": 300.0,
                                "attn_mixed_decode_rows": 64.0, "comm_bandwidth": 0.80},
                 "coefficients": dict(_H100_COEF),
                 "provenance": _record({**_H100_SOURCES,
                                        "efficiency.gemm_compute": f"{E2E_A100}; bounded by {MAMF}",
                                        "efficiency.gemm_fp8_relative": "no fp8 tensor cores: fp8 weights run "
                                                                        "W8A16 at the bf16 peak, so unused",
                                        "efficiency.attn_prefill_compute": f"{E2E_A100}; below {FA2} (a "
                                                                           f"128-row, non-paged kernel)",
                                        "efficiency.attn_prefill_half_kv": FA2,
                                        "efficiency.attn_mixed_decode_rows": FA2_PAGED,
                                        "efficiency.comm_bandwidth": NCCL},
                                       "A100 kernel measurements and structure + fit on the published vLLM "
                                       "A100 Qwen3-14B runs; engine CPU terms and decode bandwidth fractions "
                                       "from the H100 fit", VALIDATED_A100)},
    "l40s": {"efficiency": {**_H100_EFF, "gemm_compute": 0.45, "attn_prefill_compute": 0.38,
                            "attn_prefill_half_kv": 300.0, "attn_mixed_decode_rows": 64.0, "comm_bandwidth": 0.70},
             "coefficients": dict(_H100_COEF),
             "provenance": _record({**_H100_SOURCES, "efficiency.gemm_compute": ASSUMED_L40S,
                                    "efficiency.gemm_fp8_relative": f"assumed the H100's ({MAMF_FP8})",
                                    "efficiency.attn_prefill_compute": (
                                        f"{ASSUMED_L40S}, times A100's ratio of vLLM's paged FlashAttention-2 "
                                        f"kernel to the paper's (0.50 / 0.73): 0.38"),
                                    "efficiency.attn_mixed_decode_rows": FA2_PAGED,
                                    "efficiency.comm_bandwidth": NCCL},
                                   "assumed Ada fractions (see coefficients); engine CPU terms from the H100 fit",
                                   VALIDATED_L40S, fitted=False)},
}
