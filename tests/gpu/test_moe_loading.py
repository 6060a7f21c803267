"""MoE checkpoints in every layout the loader accepts load the same weights: Qwen3-MoE / Mixtral per-expert
(the names HF 5 saves) and HF 5's fused 3-D experts; gpt-oss's bf16 interleaved gate_up and its MXFP4
blocks/scales (dequantised at load, checked against transformers' own dequantiser). Configs the torch
backend cannot run exactly are refused."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from servetwin.core.config_error import ConfigError
from servetwin.gpu.loader import load_model
from servetwin.gpu.models.config import DecoderConfig
from servetwin.gpu.models.registry import resolve_model


def _hf_model(name):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(resolve_model(name).path), dtype=torch.float32,
                                                local_files_only=True)


def _write(tmp_path, name, tensors):
    info = resolve_model(name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((info.path / "config.json").read_text())
    return load_model(str(tmp_path))


def _same(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_fused_expert_checkpoint_loads_like_per_expert(tmp_path, name):
    sd = _hf_model(name).state_dict()  # HF 5 in memory: experts fused as gate_up_proj [E, 2I, H]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    if resolve_model(name).decoder_config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    _same(_write(tmp_path, name, sd), load_model(name))


def test_gpt_oss_mxfp4_experts_dequantise_like_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    cfg = resolve_model("tiny-gpt-oss").decoder_config
    E, I, Hd = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    sd = dict(_hf_model("tiny-gpt-oss").state_dict())
    bf16_layout = dict(sd)
    for layer in range(cfg.num_layers):
        for proj, rows, cols in (("gate_up_proj", 2 * I, Hd), ("down_proj", Hd, I)):
            blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(120, 131, (E, rows, cols // 32), dtype=torch.uint8, generator=g)
            key = f"model.layers.{layer}.mlp.experts.{proj}"
            del sd[key]
            sd[f"{key}_blocks"], sd[f"{key}_scales"] = blocks, scales
            bf16_layout[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _same(_write(tmp_path / "a", "tiny-gpt-oss", sd), _write(tmp_path / "b", "tiny-gpt-oss", bf16_layout))


def test_expert_tensor_missing_is_named(tmp_path):
    from safetensors.torch import load_file
    sd = load_file(str(resolve_model("tiny-mixtral").path / "model.safetensors"))
    sd.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.w13\[\(3, 1\)\]"):
        _write(tmp_path, "tiny-mixtral", sd)


def test_unsupported_attention_configs_are_refused():
    from transformers import MistralConfig, Qwen3MoeConfig
    with pytest.raises(ConfigError, match="use_sliding_window"):
        DecoderConfig.from_hf(Qwen3MoeConfig(use_sliding_window=True, num_hidden_layers=2))
    # Mistral's window is honoured (it used to be ignored), a window of None means full attention
    assert DecoderConfig.from_hf(MistralConfig(num_hidden_layers=2, sliding_window=None)).layer_windows == ()
    assert DecoderConfig.from_hf(MistralConfig(num_hidden_layers=2)).window(1).sliding_window == 4096
