"""vLLM's POST /start_profile and /stop_profile on `servetwin serve --backend sim`: the predicted steps in
between come back as the Chrome trace vLLM's profiler writes, readable by `import vllm-trace`."""
from __future__ import annotations

import httpx

from frontend_utils import ServerProcess
from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces


def test_sim_server_writes_predicted_steps_between_start_and_stop(tmp_path):
    srv = ServerProcess("--model", "llama-3.1-8b", "--backend", "sim", "--max-model-len", "4096",
                        "--profiler-dir", str(tmp_path / "prof"))
    try:
        assert httpx.post(srv.url + "/start_profile", timeout=10).status_code == 200
        for prompt in ("one two three", "four five six seven"):
            r = httpx.post(srv.url + "/v1/completions", timeout=30,
                           json={"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 5})
            assert r.status_code == 200
        resp = httpx.post(srv.url + "/stop_profile", timeout=10)
        assert resp.status_code == 200
        path = resp.json()["trace"]
        steps = read_profiler_traces([path])
        assert len(steps) >= 2 * 5 - 1  # every request: a prefill and its decodes (some may share steps)
        assert steps.num_context_reqs.sum() >= 2 and (steps.duration_s > 0).all()
        assert steps.gpu_duration_s.notna().all()  # the predicted device time, as a GPU annotation
        assert httpx.post(srv.url + "/stop_profile", timeout=10).json() == {"trace": None}  # not running
    finally:
        srv.stop()
