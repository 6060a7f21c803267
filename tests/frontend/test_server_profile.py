"""vLLM's POST /start_profile and /stop_profile on `servetwin serve --backend sim`: the predicted steps in
between come back as the Chrome trace vLLM's profiler writes, readable by `import vllm-trace`. Issue 38
item 5: the routes are guarded by --api-key, replies name the file (not the server's path), the trace is
written off the step loop and capped, an unwritable directory is found at start-up and at /start_profile."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx

from frontend_utils import PY, REPO, ServerProcess, free_port
from servetwin.experiments.vllm_import.profiler_trace import read_profiler_traces
from servetwin.sim import predicted_profile
from servetwin.sim.predicted_profile import PredictedProfile


def wait_for(path, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not path.exists():  # written in the background, renamed into place complete
        assert time.monotonic() < deadline, f"{path} not written"
        time.sleep(0.05)
    return path


def test_sim_server_writes_predicted_steps_between_start_and_stop(tmp_path):
    srv = ServerProcess("--model", "llama-3.1-8b", "--backend", "sim", "--max-model-len", "4096",
                        "--profiler-dir", str(tmp_path / "prof"), "--api-key", "k")
    auth = {"Authorization": "Bearer k"}
    try:
        for route in ("/start_profile", "/stop_profile"):  # they write to disk: the key guards them
            assert httpx.post(srv.url + route, timeout=10).status_code == 401
        assert httpx.post(srv.url + "/start_profile", headers=auth, timeout=10).status_code == 200
        for prompt in ("one two three", "four five six seven"):
            r = httpx.post(srv.url + "/v1/completions", timeout=30, headers=auth,
                           json={"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 5})
            assert r.status_code == 200
        resp = httpx.post(srv.url + "/stop_profile", headers=auth, timeout=10)
        assert resp.status_code == 200
        name = resp.json()["trace"]
        assert name == os.path.basename(name) and str(tmp_path) not in resp.text  # no server path
        steps = read_profiler_traces([wait_for(tmp_path / "prof" / name)])
        assert len(steps) >= 2 * 5 - 1  # every request: a prefill and its decodes (some may share steps)
        assert steps.num_context_reqs.sum() >= 2 and (steps.duration_s > 0).all()
        assert steps.gpu_duration_s.notna().all()  # the predicted device time, as a GPU annotation
        assert httpx.post(srv.url + "/stop_profile", headers=auth, timeout=10).json() == {"trace": None}
        shutil.rmtree(tmp_path / "prof")
        (tmp_path / "prof").write_text("a file now")  # no folder: /start_profile says so, starts nothing
        r = httpx.post(srv.url + "/start_profile", headers=auth, timeout=10)
        assert r.status_code == 500 and "--profiler-dir" in r.text and str(tmp_path) not in r.text
        assert httpx.post(srv.url + "/stop_profile", headers=auth, timeout=10).json() == {"trace": None}
    finally:
        srv.stop()


def test_an_unwritable_profiler_dir_stops_serve_at_start_up(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = subprocess.run([PY, "-m", "servetwin.experiments.cli", "serve", "--model", "llama-3.1-8b", "--backend", "sim",
                        "--port", str(free_port()), "--profiler-dir", str(blocker / "prof")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--profiler-dir" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_profile_keeps_at_most_its_cap_and_writes_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setattr(predicted_profile, "MAX_PROFILE_STEPS", 50)
    prof = PredictedProfile(tmp_path, 3)
    for _ in range(80):
        prof.record("execute_context_1(4)_generation_0(0)", 0.01)
    assert len(prof.steps) == 50 and prof.dropped == 30
    path, thread = prof.write_in_background()
    thread.join(30)
    assert path.name == "servetwin-sim.3.pt.trace.json" and len(read_profiler_traces([path])) == 50
