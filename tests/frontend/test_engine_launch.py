"""The engine process is a fresh interpreter (`python -m servetwin.core.engine.engine_proc`): it never
re-runs the caller's `__main__`, so a script without a main guard, `python -c`, a script on standard input
all work; it gets the parent's environment and honours `sitecustomize`."""
from __future__ import annotations

import os
import subprocess

from frontend_utils import PY, REPO

BODY = """
import os
from servetwin.core.engine.llm import LLM
from servetwin.core.sampling_params import SamplingParams
llm = LLM(model="m", backend="fake", skip_tokenizer_init=True)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
print("tokens", len(out[0].outputs[0].token_ids), "engine", llm.llm_engine.client.engine_pid, flush=True)
llm.close()
"""


def _run(cmd: list[str], stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, input=stdin, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def _ok(res: subprocess.CompletedProcess) -> int:
    assert res.returncode == 0, res.stderr[-3000:]
    words = res.stdout.split()
    assert words[:2] == ["tokens", "3"], res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return int(words[3])


def test_a_script_without_a_main_guard(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(BODY)
    _ok(_run([PY, str(script)]))


def test_python_dash_c_and_a_script_on_standard_input():
    _ok(_run([PY, "-c", BODY]))
    _ok(_run([PY, "-"], stdin=BODY))


def test_the_engine_gets_the_environment_and_sitecustomize(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    marks = tmp_path / "marks.txt"
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "with open(os.environ['SERVETWIN_TEST_MARKS'], 'a') as f:\n"
        "    f.write(f\"{os.getpid()} {os.environ.get('SERVETWIN_TEST_VALUE')}\\n\")\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "SERVETWIN_TEST_MARKS": str(marks), "SERVETWIN_TEST_VALUE": "from-the-parent"}
    engine_pid = _ok(_run([PY, "-"], stdin=BODY, env=env))
    seen = dict(line.split(" ", 1) for line in marks.read_text().splitlines())
    assert seen.get(str(engine_pid)) == "from-the-parent", seen  # the engine ran sitecustomize, saw the env
