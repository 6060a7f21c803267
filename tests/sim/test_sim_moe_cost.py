"""The MoE terms of the cost model: touched experts, TP sharding, kernels by storage format, refusals,
sliding-window attention, async scheduling."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from servetwin.core.config_error import ConfigError
from servetwin.sim.coefficients import Efficiency, MoEKernel
from servetwin.sim.cost_model import CostModel, StepSummary
from servetwin.sim.hardware import hardware_from_dict, load_hardware
from servetwin.sim.model_spec import PRESETS
from servetwin.sim.moe_cost import MoECost, expected_touched_experts, moe_kernel

GPT_OSS = PRESETS["gpt-oss-120b"]


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 4), (4, 128, 4), (16, 128, 8), (64, 32, 4), (3, 8, 2)])
def test_expected_touched_experts_matches_a_sampled_count(tokens, experts, top_k):
    rng = np.random.default_rng(0)
    trials = 2000
    counts = []
    for _ in range(trials):  # each token picks top_k distinct experts uniformly
        picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
        counts.append(len(np.unique(picks)))
    sampled, sem = np.mean(counts), np.std(counts) / np.sqrt(trials)
    assert abs(expected_touched_experts(tokens, experts, top_k) - sampled) < 4 * sem + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 256), st.data(), st.floats(0.0, 0.95))
def test_touched_experts_bounds_and_skew(tokens, experts, data, skew):
    k = data.draw(st.integers(1, experts))
    n = expected_touched_experts(tokens, experts, k)
    assert k - 1e-9 <= n <= min(experts, tokens * k) + 1e-9
    assert expected_touched_experts(tokens, experts, k, skew) <= n + 1e-9  # skew: fewer experts touched
    assert expected_touched_experts(tokens + 1, experts, k) >= n - 1e-9


def test_tensor_parallel_shards_the_experts_but_not_the_router():
    unpadded = hardware_from_dict({"base": "h100-sxm", "efficiency": {"moe_kernels": {
        "mxfp4": {"kernel": "k", "peak": "bf16", "compute": 0.4, "half_rows": 16, "bandwidth": 0.8}}}})
    one, two = MoECost.build(GPT_OSS, unpadded, 1, None), MoECost.build(GPT_OSS, unpadded, 2, None)
    assert two.expert_flop == pytest.approx(one.expert_flop / 2)
    assert two.expert_weight == pytest.approx(one.expert_weight / 2)
    assert two.router_flop == one.router_flop and two.router_bytes == one.router_bytes
    # MXFP4: one expert's weights at 4.25 bits (gate, up, down + biases), all 36 layers, at the kernel's bandwidth
    assert one.expert_weight == pytest.approx(36 * GPT_OSS.expert_params * 4.25 / 8 / (unpadded.memory_bandwidth * 0.8))


def test_the_kernels_weight_layout_pads_hidden_and_each_ranks_width():
    marlin = load_hardware("h100-sxm")  # Marlin: hidden to 256 (2880 -> 3072), width / tp to 128 (360 -> 384)
    kernel = marlin.efficiency.moe_kernels["mxfp4"]
    tp8 = MoECost.build(GPT_OSS, marlin, 8, None)
    assert tp8.expert_flop == pytest.approx(36 * 2 * 3 * 3072 * 384 / (marlin.peak_flops_bf16 * kernel.compute))
    trtllm = load_hardware("b200")  # FlashInfer TRT-LLM: width / tp to 256 (360 -> 512)
    ratio = MoECost.build(GPT_OSS, trtllm, 8, None).expert_weight / MoECost.build(GPT_OSS, trtllm, 1, None).expert_weight
    assert ratio == pytest.approx(512 / 3072)  # 2880 -> 3072 at TP 1


def test_a_decode_step_reads_the_touched_experts_not_a_dense_mlp():
    cm = CostModel(GPT_OSS, "h100-sxm", tp=1)
    basis = cm.basis(StepSummary.from_lists([1] * 4, [1000] * 4, 4))
    # the dense GEMMs are attention only: the experts are their own term
    attention_bytes = 36 * (GPT_OSS.attention_params + 2 * GPT_OSS.hidden_size) * 2
    e = cm.hw.efficiency
    assert basis["linear"] == pytest.approx(attention_bytes / (cm.hw.memory_bandwidth * e.gemm_bandwidth))
    touched = expected_touched_experts(4, 128, 4)
    assert basis["moe"] >= cm.moe.expert_weight * touched  # ~15 experts x 36 layers of MXFP4 weights
    assert basis["moe_layer"] == 36


def test_moe_seconds_grow_with_tokens():
    cm = CostModel(GPT_OSS, "h100-sxm", tp=2)
    values = [cm.moe.seconds(t) for t in (1, 2, 8, 64, 512, 8192)]
    assert values == sorted(values) and cm.moe.seconds(0) == 0.0


def test_expert_kernel_by_storage_format_and_gpu():
    assert moe_kernel(GPT_OSS, load_hardware("h100-sxm"), None)[0].kernel == "marlin_w4a16_moe"
    kernel, peak = moe_kernel(GPT_OSS, load_hardware("b200"), None)
    assert kernel.peak == "fp8" and peak == 4500e12  # MXFP4 x MXFP8 on Blackwell
    nvfp4 = dataclasses.replace(GPT_OSS, expert_dtype="nvfp4")
    assert moe_kernel(nvfp4, load_hardware("b200"), None)[1] == 9000e12
    qwen = PRESETS["qwen3-30b-a3b"]
    assert moe_kernel(qwen, load_hardware("h100-sxm"), None)[0].kernel == "triton_fused_moe"
    assert moe_kernel(qwen, load_hardware("h100-sxm"), "fp8")[0].peak == "fp8"


def test_a_format_without_a_kernel_or_a_peak_is_refused_naming_the_field():
    nvfp4 = dataclasses.replace(GPT_OSS, expert_dtype="nvfp4")
    with pytest.raises(ConfigError) as e:  # Hopper has no NVFP4 MoE kernel rate in the preset
        CostModel(nvfp4, "h100-sxm")
    assert e.value.path == "hardware.efficiency.moe_kernels.nvfp4"
    with pytest.raises(ConfigError) as e:  # an fp4 kernel on a GPU without fp4 tensor cores
        hw = hardware_from_dict({"base": "h100-sxm", "efficiency": {"moe_kernels": {
            "nvfp4": {"kernel": "x", "peak": "fp4", "compute": 0.5, "half_rows": 8, "bandwidth": 0.7}}}})
        CostModel(nvfp4, hw)
    assert e.value.path == "hardware.efficiency.moe_kernels.nvfp4.peak"
    with pytest.raises(ConfigError) as e:  # fp8 experts on an A100 (no fp8 tensor cores)
        CostModel(PRESETS["qwen3-30b-a3b"], "a100-80g", quantization="fp8")
    assert e.value.path == "hardware.efficiency.moe_kernels.fp8.peak"
    with pytest.raises(ConfigError) as e:  # the CPU preset prices no expert kernel at all
        CostModel(GPT_OSS, "cpu")
    assert e.value.path.startswith("hardware.efficiency.moe_kernels")
    with pytest.raises(ConfigError) as e:
        CostModel(dataclasses.replace(GPT_OSS, expert_dtype="float32"), "h100-sxm")
    assert e.value.path == "model.expert_dtype"


def test_moe_kernel_entries_are_validated():
    with pytest.raises(ConfigError) as e:
        Efficiency(moe_kernels={"mxfp4": {"kernel": "k", "peak": "fp8", "compute": 0.5, "half_rows": 8}})
    assert e.value.path == "efficiency.moe_kernels.mxfp4.bandwidth"
    with pytest.raises(ConfigError) as e:
        Efficiency(moe_kernels={"mxfp4": {"kernel": "k", "peak": "fp6", "compute": 0.5, "half_rows": 8,
                                          "bandwidth": 0.5}})
    assert e.value.path == "efficiency.moe_kernels.mxfp4.peak"
    eff = Efficiency(moe_kernels={"bf16": MoEKernel("k", "bf16", 0.5, 8.0, 0.7)})
    assert Efficiency.from_dict(eff.to_dict()).moe_kernels == eff.moe_kernels  # round trip


def test_sliding_layers_read_at_most_the_window():
    full = dataclasses.replace(GPT_OSS, layer_types=None, sliding_window=None)
    slid, dense_attn = CostModel(GPT_OSS, "h100-sxm"), CostModel(full, "h100-sxm")
    short = StepSummary.from_lists([1] * 8, [100] * 8, 8)  # inside the 128-token window: no difference
    assert slid.basis(short)["attn_decode"] == pytest.approx(dense_attn.basis(short)["attn_decode"])
    long = StepSummary.from_lists([1] * 8, [20000] * 8, 8)
    half = dense_attn.basis(long)["attn_decode"] / 2  # 18 full layers read everything
    window = 18 * 2 * 8 * 64 * 2 * (128 + 1) * 8 / (slid.hw.memory_bandwidth * slid.hw.efficiency.attn_decode_bandwidth)
    assert slid.basis(long)["attn_decode"] == pytest.approx(half + window)
    chunk = StepSummary.from_lists([4096], [8192], 1)
    assert slid.basis(chunk)["attn_prefill"] < dense_attn.basis(chunk)["attn_prefill"] / 1.9


def test_async_scheduling_overlaps_the_engine_cpu_with_the_gpu():
    step = StepSummary.from_lists([1] * 4, [500] * 4, 4)
    sync = CostModel(GPT_OSS, "h100-sxm", tp=8).predict(step)
    asyn = CostModel(GPT_OSS, "h100-sxm", tp=8, async_scheduling=True).predict(step)
    assert sync.duration_s == pytest.approx(sync.prepare_s + sync.forward_s + sync.sample_s)
    assert asyn.duration_s == pytest.approx(max(asyn.prepare_s, asyn.forward_s + asyn.sample_s))


def test_routing_skew_is_checked():
    with pytest.raises(ConfigError) as e:
        CostModel(GPT_OSS, "h100-sxm", routing_skew=1.0)
    assert e.value.path == "routing_skew"


def test_pool_sizing_takes_the_padded_expert_weights():
    dense = CostModel("llama-3.1-8b", "h100-sxm")
    assert dense.weight_bytes_per_rank == PRESETS["llama-3.1-8b"].num_parameters * 2  # unchanged for dense
    tp2 = CostModel(GPT_OSS, "h100-sxm", tp=2)  # Marlin's layout: 3072 x 1536 per expert matrix on a rank
    rest = (GPT_OSS.num_parameters - GPT_OSS.num_expert_parameters) * 2 / 2
    experts = 128 * 36 * GPT_OSS.expert_params * (3072 * 1536) / (2880 * 2880) * 4.25 / 8
    assert tp2.weight_bytes_per_rank == pytest.approx(rest + experts, rel=1e-9)


def test_fused_allreduce_rms_removes_the_norm_pass_at_tp_above_one_only():
    decode = StepSummary.from_lists([1] * 32, [1000] * 32, 32)
    for hw in ("h100-sxm", "b200"):
        plain, fused = (CostModel(GPT_OSS, hw, tp=4, fuse_allreduce_rms=f) for f in (False, True))
        saved = 32 * 2 * 36 * 4 * 2880 / (plain.hw.memory_bandwidth * plain.hw.efficiency.gemm_bandwidth)
        assert plain.basis(decode)["elementwise"] - fused.basis(decode)["elementwise"] == pytest.approx(saved)
        assert fused.predict(decode).forward_s < plain.predict(decode).forward_s
        one, one_fused = (CostModel(GPT_OSS, hw, tp=1, fuse_allreduce_rms=f) for f in (False, True))
        assert one_fused.basis(decode) == one.basis(decode)  # no all-reduce to fuse with
    # above vLLM's size limit (H100, TP 8: 0.5 MiB = 91 tokens of 2880 bf16) the step runs unfused
    big = StepSummary.from_lists([512], [0], 1)
    plain, fused = (CostModel(GPT_OSS, "h100-sxm", tp=8, fuse_allreduce_rms=f) for f in (False, True))
    assert fused.basis(big) == plain.basis(big)
    with pytest.raises(ConfigError) as e:
        CostModel(GPT_OSS, "a100-80g", tp=2, fuse_allreduce_rms=True)
    assert e.value.path == "fuse_allreduce_rms"


def test_the_engine_setting_reaches_the_cost_model_under_both_vllm_names():
    from servetwin.core.engine.engine_args import EngineArgs
    from servetwin.sim.kv_pool import build_sim_executor
    for name in ("fuse_allreduce_rms", "enable_fi_allreduce_fusion"):  # 0.12+ and 0.11's pass_config names
        args = EngineArgs.from_kwargs(model="gpt-oss-120b", backend="sim", hardware="h100-sxm",
                                      tensor_parallel_size=2, **{name: True})
        assert build_sim_executor(args).executor.cost_model.fuse_allreduce_rms


def test_moe_backend_picks_the_named_kernel_and_its_weight_layout():
    h100 = load_hardware("h100-sxm")
    auto = MoECost.build(GPT_OSS, h100, 1, None)
    marlin = MoECost.build(GPT_OSS, h100, 1, None, backend="marlin")
    triton = MoECost.build(GPT_OSS, h100, 1, None, backend="triton")
    assert auto == marlin and marlin.kernel.kernel.startswith("marlin")  # the format's own entry is Marlin's
    assert triton.kernel == h100.efficiency.moe_kernels["mxfp4_triton"]
    # Marlin pads 2880 x 2880 to 3072 x 2944 (hidden to 256, width to 128); the Triton layout pads the width to
    # 64 only (2880 already is): weights and FLOPs per expert shrink by that ratio
    assert marlin.expert_bytes / triton.expert_bytes == pytest.approx(2944 / 2880)
    assert triton.expert_flop == pytest.approx(36 * 6 * 3072 * 2880 / (h100.peak_flops_bf16 * triton.kernel.compute))
    for tokens in (1, 64, 8192):  # the Triton entry is no slower at any step size (smaller layout, >= compute)
        assert triton.seconds(tokens) < marlin.seconds(tokens)
    assert CostModel("gpt-oss-120b", "h200", moe_backend="triton").moe.kernel.kernel == "oai_triton_matmul_ogs"


def test_a_moe_backend_the_gpu_has_no_kernel_for_is_refused_naming_the_setting():
    with pytest.raises(ConfigError) as err:  # vLLM's OpenAI Triton MoE kernels need SM 9.0+: no A100 entry
        CostModel("gpt-oss-120b", "a100-80g", moe_backend="triton")
    assert err.value.path == "engine.moe_backend" and "a100" in str(err.value)
    with pytest.raises(ConfigError) as err:  # bf16 experts run Triton fused_moe: no Marlin kernel
        CostModel("qwen3-30b-a3b", "h100-sxm", moe_backend="marlin")
    assert err.value.path == "engine.moe_backend"


def test_the_moe_backend_setting_is_checked_and_reaches_the_cost_model():
    from servetwin.core.engine.engine_args import EngineArgs
    from servetwin.sim.kv_pool import build_sim_executor
    args = EngineArgs.from_kwargs(model="gpt-oss-120b", backend="sim", hardware="h200", moe_backend="triton")
    assert build_sim_executor(args).executor.cost_model.moe.kernel.kernel == "oai_triton_matmul_ogs"
    with pytest.raises(ConfigError) as err:
        EngineArgs.from_kwargs(model="gpt-oss-120b", backend="sim", moe_backend="cutlass")
    assert err.value.path == "moe_backend"
