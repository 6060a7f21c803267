"""`LLM` with the odd inputs a first-time user tries: each is a `ValueError` naming the field (or works),
never a `TypeError` / `AttributeError` / `ZeroDivisionError` from deep inside, and never a crash later."""
from __future__ import annotations

import subprocess

import pytest

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.llm import LLM
from servetwin.core.engine.output_processor import OutputProcessor
from servetwin.core.outputs import EngineCoreOutput, Logprobs
from servetwin.core.sampling_params import SamplingParams
from frontend_utils import PY, REPO, backend_available, free_port

FAKE = dict(model="fake-model", backend="fake", multiprocess=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size: must be an integer >= 1, got 0"),  # was ZeroDivisionError in the executor
    (dict(block_size=-16), "block_size: must be an integer >= 1, got -16"),
    (dict(num_gpu_blocks=0), "num_gpu_blocks: must be an integer >= 2, got 0"),  # was "no available memory"
    (dict(num_gpu_blocks_override=1), "num_gpu_blocks: must be an integer >= 2, got 1"),
    (dict(device="tpu"), "device: must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),  # was a torch RuntimeError
    (dict(max_logprobs=-5), "max_logprobs: must be an integer >= -1"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization: must be in (0, 1]"),
])
def test_bad_engine_arguments_fail_before_any_engine_starts(kwargs, message):
    with pytest.raises(ValueError) as info:
        EngineArgs.from_kwargs(model="tiny-llama", backend="torch", **kwargs)
    assert str(info.value).startswith(message)
    with pytest.raises(ValueError, match="^" + message.split(":")[0] + ":"):
        LLM(**dict(FAKE, multiprocess=True, **kwargs))  # the parent refuses; no engine process is started


def test_output_processor_takes_the_sampled_tokens_logprob_not_the_rank_index():
    """`Logprobs.sampled_rank` is the sampled token's 1-based rank in the vocabulary (servetwin.gpu.sampler): with
    random sampling it is often larger than the top-k list, which raised IndexError in the front end."""
    op = OutputProcessor(None)
    op.add_request("r", None, [1, 2], [("r", SamplingParams(max_tokens=2, logprobs=1))])
    lp1 = Logprobs(token_ids=[42, 7], logprobs=[-5.0, -0.5], sampled_rank=57)  # sampled first, then top-1
    lp2 = Logprobs(token_ids=[7], logprobs=[-0.25], sampled_rank=1)  # the sampled token is the top one
    results, _ = op.process_outputs([EngineCoreOutput("r", [42], new_logprobs=[lp1])])
    results, _ = op.process_outputs([EngineCoreOutput("r", [7], finish_reason=1, new_logprobs=[lp2])])
    out = results[0].outputs[0]
    assert out.logprobs == [{42: -5.0, 7: -0.5}, {7: -0.25}]
    assert out.cumulative_logprob == pytest.approx(-5.25)


def test_llm_rejects_prompts_and_params_of_the_wrong_type():
    with LLM(skip_tokenizer_init=True, **FAKE) as llm:
        for bad in (5, None, 3.5):
            with pytest.raises(ValueError, match="^prompts: must be a string, a list of token ids"):
                llm.generate(bad, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="^sampling_params: must be a SamplingParams or a list"):
            llm.generate([[1, 2]], {"max_tokens": 2})
        with pytest.raises(ValueError, match=r"^sampling_params\[1\]: must be a SamplingParams, got dict"):
            llm.generate([[1, 2], [3]], [SamplingParams(max_tokens=2), {"max_tokens": 2}])
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.generate((1, 2, 3), SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"
        assert llm.generate([], SamplingParams(max_tokens=2)) == []


@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_closed_llm_refuses_work_in_both_modes(multiprocess):
    llm = LLM(skip_tokenizer_init=True, **dict(FAKE, multiprocess=multiprocess))
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    llm.close()
    llm.close()
    with pytest.raises(EngineDeadError):  # in-process it used to keep generating after close()
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    with pytest.raises(EngineDeadError):
        llm.get_stats()


@pytest.mark.skipif(not backend_available("sim"), reason="sim backend (servetwin.sim.kv_pool) not importable")
def test_sim_llm_answers_text_prompts_and_chat_with_the_toy_tokenizer():
    # was: "text prompts need a tokenizer (skip_tokenizer_init=True ...)" although it was not given
    with LLM(model="tiny-llama", backend="sim", hardware="cpu", multiprocess=False, num_gpu_blocks=64,
             max_model_len=128) as llm:
        out = llm.generate(["Hello world", {"prompt": "a b c"}], SamplingParams(max_tokens=3))
        assert [len(o.prompt_token_ids) for o in out] == [2, 3]
        assert out[0].outputs[0].text == "".join(f" {t}" for t in out[0].outputs[0].token_ids)
        chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
        assert len(chat[0].outputs[0].token_ids) == 2
        stopped = llm.generate("x", SamplingParams(max_tokens=20, stop=[" "]))[0].outputs[0]
        assert stopped.finish_reason == "stop" and stopped.text == ""
        for name in ("logprobs", "prompt_logprobs"):  # no logits: refused, not answered with []
            with pytest.raises(ValueError, match=f"^{name}: the sim backend .* computes no logprobs"):
                llm.generate("x", SamplingParams(max_tokens=2, **{name: 1}))
        assert not llm.llm_engine.has_unfinished_requests()
    with LLM(model="tiny-llama", backend="sim", hardware="cpu", multiprocess=False, num_gpu_blocks=64,
             max_model_len=128, skip_tokenizer_init=True) as llm:
        assert llm.get_tokenizer() is None
        with pytest.raises(ValueError, match="^prompt: text prompts need a tokenizer"):
            llm.generate("Hello")


@pytest.mark.skipif(not backend_available("torch"), reason="torch backend (servetwin.gpu.executor) not importable")
def test_torch_llm_sampled_logprobs_and_cumulative_logprob():
    with LLM(model="tiny-llama", backend="torch", multiprocess=False, num_gpu_blocks=64, max_model_len=128) as llm:
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=1, n=3)
        for out in llm.generate(["Hello", "The capital of France is"], params):
            for c in out.outputs:
                assert len(c.logprobs) == len(c.token_ids)
                picked = [d[t] for t, d in zip(c.token_ids, c.logprobs)]  # the sampled token is always there
                assert c.cumulative_logprob == pytest.approx(sum(picked))


@pytest.mark.skipif(not backend_available("torch"), reason="torch backend (servetwin.gpu.executor) not importable")
def test_unknown_torch_model_is_a_file_not_found_error_in_both_modes():
    for mp in (False, True):
        with pytest.raises(FileNotFoundError, match="^model: 'no-such-model-xyz' is neither a built-in model"):
            LLM(model="no-such-model-xyz", backend="torch", multiprocess=mp)


@pytest.mark.skipif(not backend_available("torch"), reason="torch backend (servetwin.gpu.executor) not importable")
def test_serve_with_an_unknown_model_exits_with_the_message():
    res = subprocess.run([PY, "-m", "servetwin.experiments.cli", "serve", "--backend", "torch", "--model", "no-such-model-xyz",
                          "--port", str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "servetwin serve: error: model: 'no-such-model-xyz' is neither a built-in model" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_priority_needs_the_priority_policy():
    with LLM(skip_tokenizer_init=True, **FAKE) as llm:
        with pytest.raises(ValueError, match="^priority: got 2 but the engine schedules 'fcfs'"):
            llm.llm_engine.add_request("a", [1, 2], SamplingParams(max_tokens=2), priority=2)
        assert not llm.llm_engine.has_unfinished_requests()
    with LLM(skip_tokenizer_init=True, policy="priority", **FAKE) as llm:
        llm.llm_engine.add_request("a", [1, 2], SamplingParams(max_tokens=2), priority=2)
        assert llm.llm_engine.has_unfinished_requests()
