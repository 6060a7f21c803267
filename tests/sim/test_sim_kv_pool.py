"""KV pool sizing against vLLM's own memory-profile logs (sim/kv_pool.py's docstring cites them)."""
import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_sizing import check_or_fit_max_model_len
from servetwin.sim.hardware import load_hardware
from servetwin.sim.kv_pool import size_kv_pool
from servetwin.sim.model_spec import ModelSpec, load_model_spec

GiB = 2**30
QWEN2_7B = ModelSpec("qwen2-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
                     intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, qkv_bias=True,
                     max_position_embeddings=32768)
QWEN3_32B = ModelSpec("qwen3-32b", num_layers=64, hidden_size=5120, num_heads=64, num_kv_heads=8, head_dim=128,
                      intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False, qk_norm=True,
                      max_position_embeddings=40960)


def test_llama_8b_on_h100_matches_vllm_v1_log():
    # vLLM V1: total 79.11 GiB x 0.90; weights 14.99 GiB, activation peak 1.21 GiB, non-torch 0.32 GiB,
    # KV 54.68 GiB -> "GPU KV cache size: 447,776 tokens" (8192 batched tokens, 256 sequences)
    pool = size_kv_pool(load_model_spec("llama-3.1-8b"), load_hardware("h100-sxm"), 16, 0.9, 8192, 256)
    assert pool.weight_bytes / GiB == pytest.approx(14.99, abs=0.05)
    assert pool.activation_peak_bytes / GiB == pytest.approx(1.21, abs=0.1)
    assert pool.num_gpu_blocks * 16 == pytest.approx(447_776, rel=0.01)


def test_qwen2_7b_on_a100_matches_vllm_log():
    # vLLM's log at gpu_memory_utilization 0.5 on an A100-80GB: 29,053 blocks (2048 tokens, 256 sequences)
    pool = size_kv_pool(QWEN2_7B, load_hardware("a100-80g"), 16, 0.5, 2048, 256)
    assert pool.num_gpu_blocks == pytest.approx(29_053, rel=0.01)


def test_qwen3_32b_on_one_h100():
    # vLLM v0.26 on 1x H100 80GB at 0.90, max_model_len 8192: 61.03 GiB of weights, 8.52 GiB of KV cache
    pool = size_kv_pool(QWEN3_32B, load_hardware("h100-sxm"), 16, 0.9, 8192, 1024)
    assert pool.weight_bytes / GiB == pytest.approx(61.03, abs=0.05)
    assert pool.available_kv_bytes / GiB == pytest.approx(8.52, rel=0.05)
    # max_model_len 40960 needs 2,560 blocks (10 GiB): vLLM's check refuses it as well, naming what fits
    with pytest.raises(ValueError, match=r"max_model_len: 40960 tokens need 2560 blocks .* largest max_model_len"):
        check_or_fit_max_model_len(pool.num_gpu_blocks, pool.kv_spec, 40960, 40960)
    assert 30_000 < check_or_fit_max_model_len(pool.num_gpu_blocks, pool.kv_spec, -1, 40960) < 40_960


def test_fp8_weights_and_kv_cache_enlarge_the_pool():
    hw = load_hardware("h100-sxm")
    bf16 = size_kv_pool(QWEN3_32B, hw, 16, 0.9, 8192, 1024)
    fp8 = size_kv_pool(QWEN3_32B, hw, 16, 0.9, 8192, 1024, quantization="fp8", kv_dtype="fp8")
    # 1 byte per weight but the embedding, the untied LM head and the norms, which fp8 leaves in bf16
    kept = 2 * 151936 * 5120 + (2 * 64 + 1) * 5120
    assert fp8.weight_bytes == QWEN3_32B.num_parameters - kept + 2 * kept
    assert fp8.kv_spec.bytes_per_block == bf16.kv_spec.bytes_per_block // 2
    assert fp8.num_gpu_blocks > 7 * bf16.num_gpu_blocks  # 30.5 GiB freed, blocks half the size


def _gpt_oss_like():
    from dataclasses import dataclass

    @dataclass(slots=True, frozen=True)
    class HybridSpec(ModelSpec):  # the fields core/model_spec.py's ModelSpec is getting
        layer_types: tuple = None
        sliding_window: int = None

    kw = dict(num_layers=24, hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64,
              intermediate_size=2880, vocab_size=201088, tie_word_embeddings=False, max_position_embeddings=8192)
    return ModelSpec("all-full", **kw), HybridSpec("gpt-oss-like", **kw, sliding_window=128,
                                                   layer_types=("sliding_attention", "full_attention") * 12)


def test_gpt_oss_like_layers_give_two_groups_and_twice_the_blocks():
    """Alternating sliding-window (128) / full layers: vLLM's groups [sliding 128, full] of 12 layers
    each share one pool whose block is one page of 12 layers, so the pool has 2x the blocks of the
    same model with every layer full attention."""
    from servetwin.core.kv_cache.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    dense, hybrid = _gpt_oss_like()
    hw = load_hardware("h100-sxm")
    full_pool = size_kv_pool(dense, hw, 16, 0.9, 8192, 256)
    pool = size_kv_pool(hybrid, hw, 16, 0.9, 8192, 256)
    assert full_pool.kv_cache_groups is None  # one full-attention group: the scheduler's default
    assert pool.kv_cache_groups == (SlidingWindowSpec(128), FullAttentionSpec())
    assert pool.num_gpu_blocks == pytest.approx(2 * full_pool.num_gpu_blocks, abs=1)
    assert pool.bytes_per_block * 2 == full_pool.bytes_per_block == full_pool.kv_spec.bytes_per_block
    off = size_kv_pool(hybrid, hw, 16, 0.9, 8192, 256, disable_hybrid_kv_cache_manager=True)
    assert off.kv_cache_groups is None and off.num_gpu_blocks == full_pool.num_gpu_blocks


@pytest.mark.parametrize("disable", [False, True])
def test_the_sim_engine_schedules_with_the_models_groups(monkeypatch, disable):
    import servetwin.sim.kv_pool as kv_pool
    from servetwin.core.engine.engine_args import EngineArgs
    from servetwin.core.engine.engine_factory import create_engine_core

    _, hybrid = _gpt_oss_like()
    monkeypatch.setattr(kv_pool, "load_model_spec", lambda name, dtype=None: hybrid)
    engine, info = create_engine_core(EngineArgs.from_kwargs(
        model="gpt-oss-like", backend="sim", hardware="h100-sxm", max_num_seqs=256,
        disable_hybrid_kv_cache_manager=disable))
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.num_gpu_blocks == info.num_gpu_blocks and info.max_model_len == 8192
    assert [type(m).__name__ for m in kv.coordinator.single_type_managers] == (
        ["FullAttentionManager"] if disable else ["SlidingWindowManager", "FullAttentionManager"])


def test_the_cuda_graph_capture_sizes_follow_vllm_and_the_engine_setting():
    from servetwin.core.engine.engine_args import EngineArgs
    from servetwin.sim.kv_pool import build_sim_executor

    def sizes(**kw):
        args = EngineArgs.from_kwargs(model="llama-3.1-8b", backend="sim", hardware="h100-sxm", **kw)
        return build_sim_executor(args).executor.cost_model.graph_sizes

    assert sizes(max_num_seqs=256)[-1] == sizes(max_num_seqs=1024)[-1] == 512  # min(2 x sequences, 512)
    assert sizes(max_num_seqs=16)[-1] == 32
    assert sizes(max_num_seqs=16, max_cudagraph_capture_size=2048)[-1] == 2048
    assert sizes(max_num_batched_tokens=256)[-1] == 256  # never above the step's token budget
    assert sizes(enforce_eager=True) == []


@pytest.mark.parametrize("block_size", [16, 128])
def test_gpt_oss_120b_on_one_h100_fits_128k_at_0_95_not_at_0_9(block_size):
    """The llm-d guide's gpt-oss-120b model servers (optimized-baseline, `patch-vllm-gpt120b.yaml`) raise
    `--gpu-memory-utilization` to 0.95 because at vLLM's 0.9 the KV cache left on an 80 GB H100 after the
    MXFP4 weights is short of one 131,072-token request "by ~0.01 GiB". That request needs 18 full-attention
    layers x 131,072 tokens + 18 sliding-window layers x (127 + 8,192 batched tokens), at 2,048 B a layer and
    token: 4.79 GiB. So the engine's pool at 0.9 is just under it: the simulated pool (Triton MXFP4 layout)
    is at most 10% under, and the same start-up check refuses 128k at 0.9 and accepts it at 0.95."""
    from servetwin.sim.cost_model import CostModel

    model, hw = load_model_spec("gpt-oss-120b"), load_hardware("h100-sxm")
    weights = CostModel(model, hw, tp=1, moe_backend="triton").weight_bytes_per_rank
    one_128k_request = 18 * 2048 * (131_072 + block_size * (-(-(127 + 8192) // block_size) + 1))
    pools = {util: size_kv_pool(model, hw, block_size, util, 8192, 1024, weight_bytes=weights)
             for util in (0.9, 0.95)}
    assert 0.9 * one_128k_request < pools[0.9].available_kv_bytes < one_128k_request
    def fit(util):
        pool = pools[util]
        return pool.kv_plan.fit_max_model_len(pool.num_gpu_blocks, pool.kv_spec, 131_072, 131_072, 8192)
    assert fit(0.95) == 131_072
    with pytest.raises(ConfigError, match="131072 tokens need"):
        fit(0.9)
