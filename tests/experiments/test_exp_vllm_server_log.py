"""vLLM server logs: the facts read from real log excerpts (tests/data/vllm_logs, public threads), the
engine settings an imported case takes from them, and servetwin's KV sizing next to vLLM's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from servetwin.core.config_error import ConfigError
from servetwin.experiments.cli import main
from servetwin.experiments.vllm_import.server_log import (
    engine_settings, kv_check, parse_server_log, read_server_log)

LOGS = Path(__file__).resolve().parents[1] / "data" / "vllm_logs"
BENCH = Path(__file__).resolve().parents[1] / "data" / "vllm_bench"


def test_real_log_excerpts():
    v010 = read_server_log(LOGS / "pr24162_v0.10.2dev_qwen2.5-0.5b_tp2.log")
    assert v010.vllm_version == "0.10.2.dev378+g4d7fe40fc.d20250829" and v010.tensor_parallel_size == 2
    assert v010.model == "/data/datasets/models-hf/Qwen2.5-0.5B/" and v010.max_model_len == 32768
    assert v010.max_num_batched_tokens == 2048
    graphs = read_server_log(LOGS / "pr39471_gguf_kv_and_graphs.log")
    assert graphs.kv_cache_tokens == 189_408 and graphs.max_model_len == 40_960
    assert graphs.cuda_graph_captures == {"mixed prefill-decode, PIECEWISE": 51, "decode, FULL": 35}
    early_v1 = read_server_log(LOGS / "pr12569_v1_llama31-70b-w8a8.log")
    assert early_v1.num_gpu_blocks == 1381 and early_v1.model_loading_gib == pytest.approx(67.7229)
    v0 = read_server_log(LOGS / "mellea-pr416_v0_worker_memory.log")
    assert v0.num_gpu_blocks == 36184 and v0.gpu_memory_utilization == 0.8 and v0.kv_cache_gib == pytest.approx(61.84)
    both = read_server_log(LOGS / "pr20707_v1_kv_blocks.log")
    assert both.kv_cache_tokens == 922_496 and both.num_gpu_blocks == 57_656 and both.block_size == 16
    assert read_server_log(LOGS / "issue38820_model_loading_tp.log").model_loading_gib == pytest.approx(12.66)


def test_lines_built_from_vllm_format_strings():
    # Built here (not from a real log) from vLLM's logger format strings: "non-default args: %s",
    # "GPU KV cache size: %s tokens", "Maximum concurrency for %s tokens per request: %.2fx", and the
    # engine config line's compilation_config; a max_model_len smaller than the one asked for was reduced.
    text = "\n".join([
        "INFO 01-01 00:00:00 [utils.py:1] non-default args: {'model': 'Qwen/Qwen3-8B', 'max_model_len': 131072, "
        "'max_num_seqs': 128, 'enable_prefix_caching': False, 'gpu_memory_utilization': 0.85}",
        "INFO 01-01 00:00:01 [core.py:2] Initializing a V1 LLM engine (v0.11.0) with config: model='Qwen/Qwen3-8B', "
        "tensor_parallel_size=1, compilation_config={'cudagraph_capture_sizes': [16, 8, 4, 2, 1]}",
        "INFO 01-01 00:00:02 [kv_cache_utils.py:3] GPU KV cache size: 65,536 tokens",
        "INFO 01-01 00:00:02 [kv_cache_utils.py:4] Maximum concurrency for 65,536 tokens per request: 1.00x"])
    log = parse_server_log(text)
    assert log.vllm_version == "0.11.0" and log.cuda_graph_sizes == [16, 8, 4, 2, 1]
    assert log.reduced_max_model_len and log.requested_max_model_len == 131072 and log.max_model_len == 65536
    settings = engine_settings(log)
    assert settings["max_num_seqs"][0] == 128 and settings["enable_prefix_caching"][0] is False
    assert "reduced from the requested 131072" in settings["max_model_len"][1]
    assert settings["max_cudagraph_capture_size"][0] == 16  # the simulator pads steps up to it
    with pytest.raises(ConfigError, match=":1: the non-default args are not a readable dict"):
        parse_server_log("non-default args: {'model': <object at 0x1>}")


def test_kv_sizing_check_prints_the_difference(capsys):
    log = read_server_log(LOGS / "mellea-pr416_v0_worker_memory.log")
    # the model is not in the excerpt: qwen3-0.6b is the preset whose weights (1.1 GiB) and KV per token
    # (112 KiB: 61.84 GiB / 578,944 tokens) match the log's lines - the test's assumption, not the log's
    check = kv_check(log, "qwen3-0.6b", "h100-sxm")
    assert check["vllm_kv_tokens"] == 36184 * 16 and abs(check["difference"]) < 0.02
    assert main(["import", "vllm-log", str(LOGS / "mellea-pr416_v0_worker_memory.log"), "--hardware", "h100-sxm",
                 "--model", "qwen3-0.6b"]) == 0
    assert "KV cache: vLLM 578,944 tokens, servetwin" in capsys.readouterr().out


def test_import_takes_engine_settings_from_the_log(tmp_path, capsys):
    # a log and a bench file of different runs: the plumbing, not a matched pair
    assert main(["import", "vllm-bench", str(BENCH / "er0080_vllm0.25.1_sweep_opt125m_c2_p8_run0.json"),
                 "--server-log", str(LOGS / "pr24162_v0.10.2dev_qwen2.5-0.5b_tp2.log"), "--model", "llama-3.1-8b",
                 "--hardware", "h100-sxm", "-o", str(tmp_path)]) == 0
    name = "er0080_vllm0.25.1_sweep_opt125m_c2_p8_run0"
    case = yaml.safe_load((tmp_path / "cases" / f"{name}.yaml").read_text())
    assert case["engine"]["tensor_parallel_size"] == 2 and case["engine"]["max_model_len"] == 32768
    assert case["engine"]["max_num_batched_tokens"] == 2048
    published = json.loads((tmp_path / "published.json").read_text())[name]
    assert published["engine_version"] == "vLLM 0.10.2.dev378+g4d7fe40fc.d20250829"
    assert any("from the log" in n for n in published["notes"])
    assert main(["import", "vllm-log", str(BENCH / "manifest.json")]) == 2
    assert "not a vLLM server log" in capsys.readouterr().err


# The presets' weights on one rank (`CostModel.weight_bytes_per_rank`: the experts in the layout their
# kernel pads them to, fp8's unquantised embedding/LM head/routers in bf16) against the `Model loading took
# X GiB` that public vLLM start-up logs state for that model, TP and GPU (tests/data/vllm_logs/README.md
# names each thread). A preset or padding rule that drifts by more than the stated tolerance fails here.
PRESET_LOGS = [
    # (log, preset, GPU preset, TP, quantization, relative tolerance)
    # Marlin W4A16 MoE on an H100, the layout servetwin prices H100 MXFP4 with: 65.84 vs 65.97 GiB (-0.19%);
    # the rest is kernel workspace and the RoPE cache, which the preset does not count
    ("issue23278_v1_gpt-oss-120b_h100_marlin.log", "gpt-oss-120b", "h100-sxm", 1, None, 0.005),
    # vLLM 0.14.1 picked its Triton MXFP4 backend on the H100, whose layout is 1.46 GiB smaller than
    # Marlin's: servetwin keeps pricing the Marlin layout, 2.3% over this log (the unpadded 60.71 GiB is 5.7% under)
    ("issue33155_v0.14.1_gpt-oss-120b_h100_triton.log", "gpt-oss-120b", "h100-sxm", 1, None, 0.03),
    # Marlin on an A100 80GB (vLLM 0.19.0): 13.66 vs 13.72 GiB (-0.42%), the same unpriced workspace/RoPE cache
    ("myoceane_v0.19.0_gpt-oss-20b_a100.log", "gpt-oss-20b", "a100-80g", 1, None, 0.01),
    # bf16 experts on 4 x A10 (world size 4 in the log); bf16 fused-MoE weights are not padded, so the GPU
    # preset (a100-80g, the same Ampere kernels) does not change them. 14.22 vs 14.25 GiB (-0.21%): the
    # router gate (48 x 128 x 2048 bf16, 25 MB) and the RoPE cos/sin cache (40,960 x 128 bf16, 10 MB) are
    # whole on every rank, the preset divides them by TP
    ("issue17469_v0.8.5_qwen3-30b-a3b_tp4_a10.log", "qwen3-30b-a3b", "a100-80g", 4, None, 0.005),
    # the FP8 checkpoint (Qwen3-30B-A3B-Instruct-2507-FP8, one GPU): 29.03 vs 29.10 GiB (-0.24%), with the
    # embedding, LM head and routers in bf16 as vLLM keeps them (1 byte for every weight: 28.44, -2.3%)
    ("issue25928_v1_qwen3-30b-a3b-instruct-2507-fp8.log", "qwen3-30b-a3b", "h100-sxm", 1, "fp8", 0.005),
    # Qwen3-235B-A22B-Instruct-2507-FP8 on 4 x RTX PRO 6000 Blackwell (vLLM 0.27.1): 55.04 vs 55.19 GiB (-0.27%);
    # fp8 block-scaled experts are not padded (the b200 preset stands in for the GPU). The rest is the router
    # (94 x 128 x 4096 bf16, 99 MB) whole on every rank, the RoPE cache and the block scales
    ("kubesimplify_v0.27.1_qwen3-235b-a22b-fp8_tp4_rtxpro6000.log", "qwen3-235b-a22b", "b200", 4, "fp8", 0.005),
    # a dense int8 w8a8 checkpoint, 1 byte per quantised weight as fp8: 67.67 vs 67.72 GiB (-0.08%; 65.71, -3.0%,
    # with the embedding and LM head at 1 byte)
    ("pr12569_v1_llama31-70b-w8a8.log", "llama-3.1-70b", "h100-sxm", 1, "fp8", 0.005),
]


@pytest.mark.parametrize("name,preset,gpu,tp,quantization,tolerance", PRESET_LOGS)
def test_preset_weights_per_rank_match_vllm_startup_logs(name, preset, gpu, tp, quantization, tolerance):
    from servetwin.sim.cost_model import CostModel  # noqa: PLC0415
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415
    from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

    logged = read_server_log(LOGS / name).model_loading_gib
    ours = CostModel(load_model_spec(preset), load_hardware(gpu), tp=tp,
                     quantization=quantization).weight_bytes_per_rank / 2**30
    assert ours == pytest.approx(logged, rel=tolerance)


def test_gpt_oss_20b_kv_pool_matches_the_a100_startup_log():
    from servetwin.core.engine.engine_args import vllm_default_batch_limits  # noqa: PLC0415
    from servetwin.sim.cost_model import CostModel  # noqa: PLC0415
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415
    from servetwin.sim.kv_pool import size_kv_pool  # noqa: PLC0415
    from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

    log = read_server_log(LOGS / "myoceane_v0.19.0_gpt-oss-20b_a100.log")
    model, hw = load_model_spec("gpt-oss-20b"), load_hardware("a100-80g")
    # vllm serve's defaults on an A100 (the log's non-default args give neither): 2048 tokens, 256 sequences
    tokens, seqs = vllm_default_batch_limits(hw.name, hw.memory_bytes, api_server=True)
    pool = size_kv_pool(model, hw, 16, log.gpu_memory_utilization, tokens, seqs, 1,
                        weight_bytes=CostModel(model, hw).weight_bytes_per_rank)
    # 37.01 vs 36.56 GiB (+1.2%): vLLM 0.19 keeps 1.17 GiB beside the weights (0.65 x 79.15 - 13.72 - 36.56),
    # servetwin's activation + non-torch estimates (fitted on dense models' logs) 0.77 GiB; the excerpt does not
    # split vLLM's figure (recent versions also set aside an estimate of the CUDA-graph pool, not modelled here).
    # 3% of the pool (1.1 GiB) is the size of those profiled terms
    assert pool.available_kv_bytes / 2**30 == pytest.approx(log.kv_cache_gib, rel=0.03)
    assert pool.kv_plan.group_size == 12  # the hybrid pool: a block pages 12 layers of one group (sliding or full)


def test_qwen3_235b_kv_per_token_and_pool_match_the_tp4_startup_log():
    from dataclasses import replace  # noqa: PLC0415

    from servetwin.sim.cost_model import CostModel  # noqa: PLC0415
    from servetwin.sim.hardware import load_hardware  # noqa: PLC0415
    from servetwin.sim.kv_pool import size_kv_pool  # noqa: PLC0415
    from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

    log = read_server_log(LOGS / "kubesimplify_v0.27.1_qwen3-235b-a22b-fp8_tp4_rtxpro6000.log")
    assert log.kv_cache_tokens == 621_392 and log.kv_cache_gib == 27.85 and log.gpu_memory_utilization == 0.9
    model = load_model_spec("qwen3-235b-a22b")
    # the RTX PRO 6000 is not a preset: the pool needs only its memory (95.01 GiB, the log's line)
    hw = replace(load_hardware("b200"), name="rtx-pro-6000", memory_bytes=int(95.01 * 2**30))
    pool = size_kv_pool(model, hw, 16, log.gpu_memory_utilization, 8192, 32, 4, quantization="fp8",
                        weight_bytes=CostModel(model, hw, tp=4, quantization="fp8").weight_bytes_per_rank)
    # KV per token on a rank: 94 layers x 1 of the 4 KV heads x 128 x K,V x bf16 = 48,128 B; the log's
    # 27.85 GiB / 621,392 tokens is 48,124 B (its GiB rounded to 2 decimals: 0.02%)
    per_token = pool.bytes_per_block / 16
    assert per_token == 48_128 and log.kv_cache_tokens * per_token / 2**30 == pytest.approx(log.kv_cache_gib, rel=2e-4)
    # the pool: 28.53 vs 27.85 GiB (+2.4%). vLLM keeps 2.78 GiB beside the weights on a rank (1.70 non-torch at
    # TP 4 over PCIe, 0.76 activation peak, 0.32 CUDA-graph pool); servetwin 1.94 (1.04 non-torch, 0.90
    # activation, no graph pool). 3%: those profiled terms, fitted on NVLink H100 logs, not this machine
    assert pool.available_kv_bytes / 2**30 == pytest.approx(log.kv_cache_gib, rel=0.03)
