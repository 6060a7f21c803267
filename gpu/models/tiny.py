"""Built-in tiny models with seeded random weights: dense `tiny-llama` (and `tiny-llama-wide`, its
architecture at hidden size 1024 for the CPU's TP compare), `tiny-qwen2`, `tiny-qwen3`,
`tiny-mistral-sw` (every layer a 12-token sliding window), and MoE `tiny-mixtral` (8 experts, top-2),
`tiny-qwen3-moe` (16 experts, top-4, a dense first layer; sized for the CPU throughput benchmark) and
`tiny-gpt-oss` (alternating 10-token sliding / full layers, attention sinks, biases, a clamped SwiGLU
with a low limit so the clamp is exercised, YaRN RoPE).

Each is a real transformers config + `save_pretrained` checkpoint plus a tiny byte-level BPE
tokenizer (trained with `tokenizers` on a built-in text, ChatML template), so HF transformers can
load the same directory as an oracle.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

TINY_VOCAB_SIZE = 320
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 0
TINY_BUILD_VERSION = 1

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

_TEXT = """\
The scheduler decides which requests run in each step. A request arrives with a prompt, waits in a
queue, is admitted when blocks of the key-value cache are free, and then produces one token per step
until it reaches its maximum length or emits the end-of-sequence token. Long prompts are split into
chunks so that decodes keep flowing. When memory runs out, the newest request is preempted and its
blocks are freed; later it is resumed and its tokens are computed again. Prefix caching lets a new
request reuse the blocks of an earlier one that shares the same first tokens.
What is the capital of France? The capital of France is Paris. What is the capital of Italy? Rome.
Hello! How are you today? I am fine, thank you. Please write a short poem about the sea and the sky.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?
"""

_COMMON = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
               rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)


# llama3 rope scaling with a short original context so every frequency band is exercised
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _llama() -> Any:
    from transformers import LlamaConfig  # noqa: PLC0415
    return LlamaConfig(**_COMMON, rope_parameters=dict(_LLAMA3_ROPE), tie_word_embeddings=False)


def _llama_wide() -> Any:
    """tiny-llama 16x wider (hidden 1024, 16 heads, 4 KV heads, MLP 4096): at TP=2 on a CPU a step's
    matmuls, not the wake-ups of its 6 collectives, set its time (compare_tiny_llama_wide_tp2.yaml)."""
    from transformers import LlamaConfig  # noqa: PLC0415
    wide = {**_COMMON, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 64}
    return LlamaConfig(**wide, rope_parameters=dict(_LLAMA3_ROPE), tie_word_embeddings=False)


def _qwen2() -> Any:
    from transformers import Qwen2Config  # noqa: PLC0415
    return Qwen2Config(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       tie_word_embeddings=True)


def _qwen3() -> Any:
    from transformers import Qwen3Config  # noqa: PLC0415
    return Qwen3Config(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       tie_word_embeddings=True)


# windows that are no multiple of the 16-token block, so tests cross both window and block edges
TINY_SLIDING_WINDOW = 12
TINY_GPT_OSS_WINDOW = 10


def _mistral_sw() -> Any:
    from transformers import MistralConfig  # noqa: PLC0415
    return MistralConfig(**_COMMON, sliding_window=TINY_SLIDING_WINDOW, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _mixtral() -> Any:
    from transformers import MixtralConfig  # noqa: PLC0415
    return MixtralConfig(**{**_COMMON, "intermediate_size": 64}, num_local_experts=8, num_experts_per_tok=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig  # noqa: PLC0415
    common = {**_COMMON, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "head_dim": 32}
    return Qwen3MoeConfig(**common, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                          norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _gpt_oss() -> Any:
    from transformers import GptOssConfig  # noqa: PLC0415
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64}
    # YaRN's implied factor (max_position_embeddings / original) matches the explicit one
    return GptOssConfig(**{**_COMMON, "intermediate_size": 64, "max_position_embeddings": 512}, num_local_experts=8, num_experts_per_tok=2,
                        sliding_window=TINY_GPT_OSS_WINDOW, swiglu_limit=2.0, rope_parameters=rope,
                        tie_word_embeddings=False)


TINY_MODELS: dict[str, Callable[[], Any]] = {"tiny-llama": _llama, "tiny-qwen2": _qwen2,
                                             "tiny-qwen3": _qwen3, "tiny-mistral-sw": _mistral_sw,
                                             "tiny-mixtral": _mixtral, "tiny-qwen3-moe": _qwen3_moe,
                                             "tiny-gpt-oss": _gpt_oss, "tiny-llama-wide": _llama_wide}
TINY_SEEDS = {"tiny-llama": 0, "tiny-qwen2": 1, "tiny-qwen3": 2, "tiny-mistral-sw": 3, "tiny-mixtral": 4,
              "tiny-qwen3-moe": 5, "tiny-gpt-oss": 6, "tiny-llama-wide": 7}


def train_tiny_tokenizer() -> Any:
    """A byte-level BPE of exactly `TINY_VOCAB_SIZE` tokens wrapped in `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE)
    if len(fast) != TINY_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer: trained {len(fast)} tokens, expected {TINY_VOCAB_SIZE}")
    return fast


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with O(1) activations (HF's 0.02 init gives near-flat logits and greedy ties)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # deterministic order; tied weights appear once
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def build_tiny_model(name: str, out_dir: Path) -> None:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer into out_dir."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.utils import logging as hf_logging  # noqa: PLC0415
    hf_logging.disable_progress_bar()
    cfg = TINY_MODELS[name]()
    cfg.dtype = "float32"
    torch.manual_seed(TINY_SEEDS[name])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, TINY_SEEDS[name])
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    model.save_pretrained(out_dir)
    train_tiny_tokenizer().save_pretrained(out_dir)
    (out_dir / "servetwin_builtin.json").write_text(json.dumps({"name": name, "version": TINY_BUILD_VERSION}))
