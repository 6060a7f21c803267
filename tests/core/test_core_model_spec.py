"""ModelSpec for MoE and per-layer attention: parameter counts against the published figures, the
fields read from each family's config.json, and typed errors for impossible shapes."""
import json
from pathlib import Path

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.model_spec import (FULL_ATTENTION, SLIDING_ATTENTION, ModelSpec, weight_bits)

# The published config.json fields that matter (Hugging Face model pages; gpt-oss-120b's is in
# tests/core/data/gpt-oss-120b.config.json whole).
GPT_OSS_120B = json.loads((Path(__file__).parent / "data" / "gpt-oss-120b.config.json").read_text())
GPT_OSS_20B = {**GPT_OSS_120B, "num_hidden_layers": 24, "num_local_experts": 32,
               "layer_types": GPT_OSS_120B["layer_types"][:24]}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "tie_word_embeddings": False, "use_sliding_window": False,
                 "sliding_window": None, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                "tie_word_embeddings": False, "sliding_window": None,
                "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
MISTRAL_7B_V01 = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "vocab_size": 32000, "sliding_window": 4096, "tie_word_embeddings": False,
                  "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}


# (config, published total, published active, whether the publisher counts the embedding as active)
@pytest.mark.parametrize("cfg, total, active, with_embedding", [
    (GPT_OSS_120B, 116.83e9, 5.13e9, False),  # OpenAI model card: 116.83B total, 5.13B active
    (GPT_OSS_20B, 20.91e9, 3.61e9, False),    # 20.91B / 3.61B
    (QWEN3_30B_A3B, 30.5e9, 3.3e9, True),     # Qwen3 model card: 30.5B / 3.3B
    (MIXTRAL_8X7B, 46.7e9, 12.9e9, True),     # Mistral AI: 46.7B / 12.9B
], ids=["gpt-oss-120b", "gpt-oss-20b", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_parameter_counts_match_published(cfg, total, active, with_embedding):
    m = ModelSpec.from_hf_config(cfg)
    assert m.num_parameters == pytest.approx(total, rel=0.01)
    # published figures carry two or three significant digits (3.3B is 3.25-3.35B): within 2%
    assert m.num_active_parameters(include_embedding=with_embedding) == pytest.approx(active, rel=0.02)


def test_gpt_oss_fields():
    m = ModelSpec.from_hf_config(GPT_OSS_120B)
    assert m.is_moe and (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (128, 4, 2880)
    assert m.attention_types[:2] == (SLIDING_ATTENTION, FULL_ATTENTION) and m.sliding_window == 128
    assert m.attention_sinks and m.qkv_bias and m.o_bias and m.router_bias and m.expert_bias
    assert m.swiglu_limit == 7.0 and m.expert_dtype == "mxfp4" and m.num_moe_layers == 36
    # MXFP4 experts (4.25 bits) + bf16 rest: about 4.25/16 of the all-bf16 bytes for the experts
    experts = m.num_expert_parameters
    assert m.weight_bytes == int((m.num_parameters - experts) * 2 + experts * 4.25 / 8)


def test_qwen3_moe_dense_layers_and_router_normalisation():
    m = ModelSpec.from_hf_config({**QWEN3_30B_A3B, "mlp_only_layers": [0, 5], "norm_topk_prob": False})
    assert m.dense_layers == (0, 5) and m.num_moe_layers == 46 and not m.router_renormalize
    assert m.qk_norm and m.layer_types is None
    sparse2 = ModelSpec.from_hf_config({**QWEN3_30B_A3B, "decoder_sparse_step": 2})
    assert sparse2.moe_layers == tuple(range(1, 48, 2))
    with pytest.raises(ConfigError, match="model.use_sliding_window"):
        ModelSpec.from_hf_config({**QWEN3_30B_A3B, "use_sliding_window": True})


def test_mistral_with_a_sliding_window_slides_every_layer():
    m = ModelSpec.from_hf_config(MISTRAL_7B_V01)
    assert m.attention_types == (SLIDING_ATTENTION,) * 32 and m.sliding_window == 4096 and not m.is_moe
    assert ModelSpec.from_hf_config({**MISTRAL_7B_V01, "sliding_window": None}).layer_types is None


def test_dense_model_is_unchanged_and_moe_refuses_a_dense_matmul_size():
    dense = ModelSpec.from_hf_config({**MISTRAL_7B_V01, "sliding_window": None})
    assert dense.layer_matmul_params == dense.attention_matmul_params + dense.dense_mlp_matmul_params
    assert dense.num_active_parameters(include_embedding=True) == dense.num_parameters
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        ModelSpec.from_hf_config(MIXTRAL_8X7B).layer_matmul_params


@pytest.mark.parametrize("change, field", [
    ({"layer_types": ("full_attention",)}, "model.layer_types"),
    ({"layer_types": ("full_attention", "banded")}, r"model.layer_types\[1\]"),
    ({"layer_types": ("sliding_attention", "full_attention")}, "model.sliding_window"),
    ({"layer_types": ("chunked_attention", "full_attention")}, "model.attention_chunk_size"),
    ({"num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8}, "model.num_experts_per_tok"),
    ({"num_experts": 4, "num_experts_per_tok": 1}, "model.moe_intermediate_size"),
    ({"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8, "dense_layers": (2,)},
     "model.dense_layers"),
    ({"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8, "expert_dtype": "fp3"},
     "dtype"),
])
def test_impossible_shapes_are_typed_errors(change, field):
    base = dict(name="t", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                intermediate_size=16, vocab_size=32, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=field):
        ModelSpec(**base, **change)


def test_weight_bits_of_block_scaled_formats():
    assert weight_bits("mxfp4") == 4.25 and weight_bits("nvfp4") == 4.5
    assert weight_bits("fp8") == 8 and weight_bits("bfloat16") == 16
