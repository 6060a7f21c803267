"""ModelSpec: parameter counts, KV spec numbers, HF config parsing."""
import json

import pytest

from servetwin.core.kv_cache.kv_sizing import num_blocks_for_memory
from servetwin.sim.model_spec import PRESETS, ModelSpec, load_model_spec


@pytest.mark.parametrize("name, params", [
    ("llama-3.1-8b", 8_030_261_248),    # published: 8.03B
    ("llama-3.1-70b", 70_553_706_496),  # published: 70.6B
    ("qwen3-0.6b", 596_049_920),        # published: 0.6B (0.44B non-embedding)
    ("smollm2-135m", 134_515_008),      # published: 135M
])
def test_parameter_counts_match_published_models(name, params):
    assert PRESETS[name].num_parameters == params


def test_llama_8b_kv_block_is_2_mib():
    spec = PRESETS["llama-3.1-8b"].kv_spec(block_size=16, dtype="bfloat16")
    assert spec.page_size_bytes == 64 * 1024
    assert spec.bytes_per_block == 2 * 1024 * 1024
    assert spec.bytes_per_token == 128 * 1024
    assert num_blocks_for_memory(40 * 2**30, spec) == 20480  # docs/scheduler_behaviour.md §5.3 worked example


def test_kv_spec_dtype_defaults_to_model_and_can_be_overridden():
    tiny = PRESETS["tiny-llama"]
    assert tiny.kv_spec(block_size=4).dtype == "float32"
    assert tiny.kv_spec(block_size=4).bytes_per_block == 2 * 4 * 2 * (16 + 16) * 4
    assert tiny.kv_spec(block_size=4, dtype="fp16").bytes_per_block == 2 * 4 * 2 * (16 + 16) * 2


def test_weight_bytes_follow_dtype():
    m = PRESETS["smollm2-135m"]
    assert m.weight_bytes == 2 * m.num_parameters
    assert m.with_dtype("float32").weight_bytes == 4 * m.num_parameters


def test_smollm2_and_tiny_llama_shapes():
    s = PRESETS["smollm2-135m"]
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
            s.intermediate_size, s.vocab_size, s.tie_word_embeddings) == (
        30, 576, 9, 3, 64, 1536, 49152, True)
    t = PRESETS["tiny-llama"]
    assert (t.vocab_size, t.hidden_size, t.intermediate_size, t.num_layers, t.num_heads,
            t.num_kv_heads, t.head_dim, t.dtype, t.tie_word_embeddings) == (
        320, 64, 128, 2, 4, 2, 16, "float32", False)


def test_from_hf_config_directory_matches_preset(tmp_path):
    cfg = {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16", "max_position_embeddings": 40960, "attention_bias": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(tmp_path)
    assert spec.num_parameters == PRESETS["qwen3-0.6b"].num_parameters
    assert spec.qk_norm and not spec.qkv_bias and spec.max_position_embeddings == 40960


def test_from_hf_config_defaults_and_qwen2_bias():
    spec = ModelSpec.from_hf_config({"model_type": "qwen2", "num_hidden_layers": 2,
                                     "hidden_size": 64, "num_attention_heads": 4,
                                     "intermediate_size": 128, "vocab_size": 256}, name="q2")
    assert spec.num_kv_heads == 4 and spec.head_dim == 16 and spec.qkv_bias
    assert spec.layer_params == spec.layer_matmul_params + 2 * 64 + (64 + 2 * 64)


def test_unsupported_model_type_and_missing_field_errors():
    with pytest.raises(ValueError, match="model.model_type"):
        ModelSpec.from_hf_config({"model_type": "falcon"})
    with pytest.raises(ValueError, match="model.vocab_size"):
        ModelSpec.from_hf_config({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                  "num_attention_heads": 4, "intermediate_size": 128})
    with pytest.raises(ValueError, match="model: unknown model 'nope'"):
        load_model_spec("nope")


def test_aliases_resolve_to_presets():
    assert load_model_spec("meta-llama/Llama-3.1-8B-Instruct") == PRESETS["llama-3.1-8b"]
    assert load_model_spec("HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m"


@pytest.mark.parametrize("name,total,active,with_embedding,quant", [
    ("gpt-oss-120b", 116.83e9, 5.13e9, False, "mxfp4"),  # OpenAI model card: 116.83B / 5.13B
    ("gpt-oss-20b", 20.91e9, 3.61e9, False, "mxfp4"),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, True, None),  # Qwen: 30.5B / 3.3B
    ("qwen3-235b-a22b", 235e9, 22e9, True, None),  # 235B / 22B
    ("mixtral-8x7b", 46.7e9, 12.9e9, True, None),  # Mistral AI: 46.7B / 12.9B
])
def test_moe_presets_match_published_parameter_counts(name, total, active, with_embedding, quant):
    spec = load_model_spec(name)
    assert spec.is_moe and spec.expert_dtype == quant
    assert spec.num_parameters == pytest.approx(total, rel=0.01)
    assert spec.num_active_parameters(include_embedding=with_embedding) == pytest.approx(active, rel=0.02)


def test_gpt_oss_preset_is_its_config_json():
    spec = PRESETS["gpt-oss-120b"]
    assert load_model_spec("openai/gpt-oss-120b") is spec
    assert spec.layer_types.count("sliding_attention") == 18 and spec.sliding_window == 128
    assert spec.attention_sinks and spec.o_bias and spec.router_bias and spec.expert_bias
    # MXFP4 experts: 60.7 GiB stored (vLLM's Triton backend logs 64.38 GiB on one H100, its hidden dim padded
    # to 3072 inside the expert tensors; vllm-project/vllm issue #33155)
    assert spec.weight_bytes / 2**30 == pytest.approx(60.7, abs=0.1)
