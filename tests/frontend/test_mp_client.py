"""The multi-process engine-core client behind `LLM`: same outputs as in-process, clean start-up errors,
a dead engine is noticed at once, and no engine process outlives its front end."""
from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.core_client import make_client
from servetwin.core.engine.engine_client import EngineCoreClient, EngineDeadError, InprocClient
from servetwin.core.engine.llm import LLM
from servetwin.core.engine.mp_client import AsyncMPClient, SyncMPClient
from servetwin.core.sampling_params import SamplingParams
from frontend_utils import backend_available, pid_alive, run_script, wait_gone

FAKE = dict(model="fake-model", backend="fake", skip_tokenizer_init=True)


def _engine_pid(llm: LLM) -> int:
    return llm.llm_engine.client.engine_pid


def _summary(outputs):
    return [(o.request_id.split("-")[-1], o.prompt_token_ids, o.num_cached_tokens,
             [(c.index, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]) for o in outputs]


def _workload():
    shared = list(range(100, 140))
    prompts = [shared + [i] * (i + 1) for i in range(6)] + [[5, 6, 7]]
    params = [SamplingParams(max_tokens=3 + i, temperature=0.0) for i in range(6)]
    params.append(SamplingParams(max_tokens=40, temperature=0.8, n=3, seed=4, stop_token_ids=[55]))
    return prompts, params


def test_make_client_picks_like_vllm():
    args = EngineArgs.from_kwargs(**FAKE)
    inproc = make_client(False, False, args)
    assert isinstance(inproc, InprocClient)
    with pytest.raises(NotImplementedError):
        make_client(False, True, args)
    client = make_client(True, False, args)
    try:
        assert isinstance(client, SyncMPClient)
        for name in ("num_gpu_blocks", "max_model_len", "vocab_size", "eos_token_ids", "model_path"):
            assert getattr(client.config, name) == getattr(inproc.config, name), name
        assert client.config.pid == client.engine_pid != os.getpid()
    finally:
        client.shutdown()
    assert issubclass(AsyncMPClient, EngineCoreClient)


def test_llm_is_multiprocess_by_default(monkeypatch):
    with LLM(**FAKE) as llm:
        assert isinstance(llm.llm_engine.client, SyncMPClient)
    monkeypatch.setenv("SERVETWIN_ENABLE_MULTIPROCESSING", "0")
    with LLM(**FAKE) as llm:
        assert isinstance(llm.llm_engine.client, InprocClient)


def test_multiprocess_and_inprocess_outputs_are_identical():
    prompts, params = _workload()
    with LLM(multiprocess=False, **FAKE) as a, LLM(multiprocess=True, **FAKE) as b:
        out_a = _summary(a.generate(prompts, params))
        out_b = _summary(b.generate(prompts, params))
        assert out_a == out_b
        # the shared prefix was served from the prefix cache, and the stop token fired, in both modes
        assert any(o[2] > 0 for o in out_a)
        assert any(c[2] == "stop" and c[3] == 55 for o in out_a for c in o[3])
        # a second round (prefix cache warm, later step numbers) still matches
        assert _summary(a.generate(prompts, params)) == _summary(b.generate(prompts, params))
        assert a.reset_prefix_cache() is True and b.reset_prefix_cache() is True
        stats = b.get_stats()
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_steps"] > 0


@pytest.mark.skipif(not backend_available("sim"), reason="sim backend (servetwin.sim.kv_pool) not importable")
def test_sim_backend_identical_across_modes():
    prompts, params = _workload()
    kw = dict(model="tiny-llama", backend="sim", skip_tokenizer_init=True, num_gpu_blocks=1024)
    with LLM(multiprocess=False, **kw) as a, LLM(multiprocess=True, **kw) as b:
        assert _summary(a.generate(prompts, params)) == _summary(b.generate(prompts, params))


@pytest.mark.skipif(not backend_available("torch"), reason="torch backend (servetwin.gpu.executor) not importable")
def test_torch_tiny_llama_greedy_identical_across_modes():
    prompts = ["The capital of France is", "Hello! How are you", "The quick brown fox"]
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    kw = dict(model="tiny-llama", backend="torch", num_gpu_blocks=256, max_model_len=512)
    with LLM(multiprocess=False, **kw) as a, LLM(multiprocess=True, **kw) as b:
        out_a, out_b = a.generate(prompts, sp), b.generate(prompts, sp)
        assert [o.outputs[0].text for o in out_a] == [o.outputs[0].text for o in out_b]
        assert [o.outputs[0].token_ids for o in out_a] == [o.outputs[0].token_ids for o in out_b]
        for x, y in zip(out_a, out_b):
            assert len(x.outputs[0].logprobs) == 12
            for da, db in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert da.keys() == db.keys()
                assert all(abs(da[k] - db[k]) < 1e-5 for k in da)
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        assert a.chat(chat, sp)[0].outputs[0].token_ids == b.chat(chat, sp)[0].outputs[0].token_ids


def test_logits_processors_are_rejected_in_mp_mode_and_llm_stays_usable():
    with LLM(**FAKE) as llm:
        bad = SamplingParams(max_tokens=2, logits_processors=[lambda ids, logits: logits])
        with pytest.raises(ValueError, match=r"^logits_processors: .*multiprocess=False"):
            llm.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=2), bad])
        assert not llm.llm_engine.has_unfinished_requests()
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4


def test_startup_error_text_reaches_the_parent():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"policy: must be 'fcfs' or 'priority'"):
        LLM(policy="bogus", **FAKE)
    assert time.monotonic() - t0 < 30


@pytest.mark.skipif(not backend_available("sim"), reason="sim backend (servetwin.sim.kv_pool) not importable")
def test_bad_model_name_error_reaches_the_parent():
    with pytest.raises(ValueError) as info:
        LLM(model="no-such-model-xyz", backend="sim", skip_tokenizer_init=True)
    assert "no-such-model-xyz" in str(info.value)


def test_unservable_request_is_a_value_error_in_both_modes():
    kw = dict(FAKE, num_gpu_blocks=5, block_size=16)  # 4 usable blocks = 64 tokens
    messages = []
    for mp in (False, True):
        with LLM(multiprocess=mp, **kw) as llm:
            with pytest.raises(ValueError) as info:
                llm.generate([[1] * 10, [2] * 100], SamplingParams(max_tokens=4))
            messages.append(str(info.value))
            assert not llm.llm_engine.has_unfinished_requests()
            assert llm.generate([[3] * 10], SamplingParams(max_tokens=4))[0].outputs[0].finish_reason == "length"
    assert messages[0] == messages[1] and messages[0].startswith("prompt: ")


def test_killed_engine_raises_engine_dead_quickly_and_a_new_llm_starts():
    llm = LLM(**FAKE)
    pid = _engine_pid(llm)
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(0.3)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=kill)
    t.start()
    # ~12k engine steps of 96 requests: far longer than 0.3 s
    prompts = [[i + 1] * 8 for i in range(96)]
    with pytest.raises(EngineDeadError):
        llm.generate(prompts, SamplingParams(max_tokens=4000, ignore_eos=True))
    raised_at = time.monotonic()
    t.join()
    assert killed_at and raised_at - killed_at[0] < 1.5
    with pytest.raises(EngineDeadError):  # later calls fail the same way, at once
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    llm.close()
    with LLM(**FAKE) as fresh:
        assert fresh.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids == [10, 17, 24]


def test_close_context_exit_and_gc_stop_the_engine_process():
    llm = LLM(**FAKE)
    pid = _engine_pid(llm)
    assert pid_alive(pid)
    llm.close()
    assert not pid_alive(pid)
    llm.close()  # idempotent

    with LLM(**FAKE) as llm2:
        pid2 = _engine_pid(llm2)
    assert not pid_alive(pid2)

    llm3 = LLM(**FAKE)
    llm3.generate([[1, 2]], SamplingParams(max_tokens=2))
    pid3 = _engine_pid(llm3)
    del llm3
    gc.collect()
    assert wait_gone(pid3, 5.0)


_SCRIPT = """
import os, sys, time
from servetwin.core.engine.llm import LLM
from servetwin.core.sampling_params import SamplingParams
if __name__ == "__main__":
    llm = LLM(model="m", backend="fake", skip_tokenizer_init=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    print(llm.llm_engine.client.engine_pid, flush=True)
    {tail}
"""


def test_script_exiting_without_close_leaves_no_engine_process(tmp_path):
    script = tmp_path / "no_close.py"
    script.write_text(_SCRIPT.format(tail="pass  # exits without close()"))
    res = run_script(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout.split()[0])
    assert wait_gone(pid, 5.0)


def test_engine_exits_when_its_parent_is_killed(tmp_path):
    import subprocess

    from frontend_utils import PY, REPO

    script = tmp_path / "killed_parent.py"
    script.write_text(_SCRIPT.format(tail="time.sleep(60)"))
    proc = subprocess.Popen([PY, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline().split()[0])
        assert pid_alive(pid)
        proc.kill()
        proc.wait(5)
        assert wait_gone(pid, 5.0), "engine process outlived its killed parent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()


def test_ctrl_c_during_generate_aborts_in_the_engine_and_llm_stays_usable(tmp_path):
    script = tmp_path / "ctrl_c.py"
    script.write_text("""
import os, signal, threading, time
from servetwin.core.engine.llm import LLM
from servetwin.core.sampling_params import SamplingParams
if __name__ == "__main__":
    llm = LLM(model="m", backend="fake", skip_tokenizer_init=True)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        llm.generate([[i + 1] * 8 for i in range(64)], SamplingParams(max_tokens=4000, ignore_eos=True))
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted")
    stats = llm.get_stats()
    print(stats["num_running"] + stats["num_waiting"], llm.llm_engine.has_unfinished_requests())
    print(len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids))
""")
    res = run_script(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == ["interrupted", "0 False", "3"]
