"""The notebooks run top to bottom on a small run (real Jupyter kernel, nbclient) and are committed clean."""
from __future__ import annotations

import json
import sys

import nbformat
import pandas as pd
import pytest
from cmptest_helpers import CALIBRATIONS, NOTEBOOKS, ROOT, tiny_config

from servetwin.experiments.cli import main

NOTEBOOK_NAMES = ("trace_analysis.ipynb", "predicted_vs_measured.ipynb")
KERNEL = "servetwin-test-venv"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec whose python is this interpreter (the venv's), found through JUPYTER_PATH."""
    base = tmp_path_factory.mktemp("jupyter")
    spec = base / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "servetwin test (venv)", "language": "python"}))
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(base))
    mp.setenv("MPLBACKEND", "Agg")
    from jupyter_client.kernelspec import KernelSpecManager  # noqa: PLC0415

    assert KernelSpecManager().get_kernel_spec(KERNEL).argv[0] == sys.executable
    yield KERNEL
    mp.undo()


def _execute(name: str, params: dict, kernel: str, tmp_path) -> nbformat.NotebookNode:
    from nbclient import NotebookClient  # noqa: PLC0415

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    assert "parameters" in cell.metadata.get("tags", []), f"{name}: first code cell must be tagged parameters"
    cell.source += "\n# injected by the test\n" + "\n".join(f"{k} = {v!r}" for k, v in params.items())
    NotebookClient(nb, kernel_name=kernel, timeout=180, resources={"metadata": {"path": str(ROOT)}}).execute()
    nbformat.write(nb, tmp_path / name)  # for inspection after a failure
    return nb


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_notebooks_are_committed_without_outputs():
    for name in NOTEBOOK_NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and "parameters" in code[0].metadata.get("tags", [])
        for c in code:
            assert c.outputs == [] and c.execution_count is None, f"{name} has outputs"


def test_trace_analysis_notebook_runs_on_a_small_run(tmp_path, kernel_name):
    # shared prefixes (prefix hits) and a KV pool too small for the batch (preemptions)
    workload = {"arrival": {"type": "offline"}, "output_tokens": 24,
                "shared_prefix": {"groups": 2, "per_group": 5, "prefix_tokens": 48, "suffix_tokens": 8}}
    cfg = tiny_config(tmp_path / "run.yaml", hardware=str(CALIBRATIONS / "cpu_tiny-llama.yaml"),
                      engine__num_gpu_blocks=12, engine__max_model_len=128, workload=workload)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "-o", str(run), "--no-progress", "--no-plots"]) == 0
    steps = pd.read_parquet(run / "torch" / "steps.parquet")
    assert steps.num_preempted.sum() > 0 and steps.prefix_hits.sum() > 0
    nb = _execute("trace_analysis.ipynb", {"RUN_DIR": str(run)}, kernel_name, tmp_path)
    assert _images(nb) >= 4
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for c in nb.cells
                   if c.cell_type == "code" for o in c.outputs)
    assert "torch" in text and "sim" in text and "preemptions (steps)" in text and "hit rate" in text


def test_predicted_vs_measured_notebook_runs_on_a_small_comparison(tmp_path, kernel_name):
    cfg = tiny_config(tmp_path / "cmp.yaml")
    out = tmp_path / "cmp"
    assert main(["compare", str(cfg), "-o", str(out), "--repeats", "2", "--no-plots"]) == 0
    nb = _execute("predicted_vs_measured.ipynb", {"COMPARE_DIR": str(out)}, kernel_name, tmp_path)
    assert _images(nb) >= 4


@pytest.fixture(scope="module")
def made_run(tmp_path_factory):
    """A checkout after `make run`: the Makefile's two commands, outputs under a copy of the layout."""
    import shutil

    root = tmp_path_factory.mktemp("checkout")
    (root / "pyproject.toml").write_text("")  # what the notebooks look for to find the repo root
    shutil.copytree(NOTEBOOKS, root / "notebooks")
    default = ROOT / "experiments" / "configs" / "default.yaml"
    # the first 12 of its 42 prompts: the notebooks need the outputs' shape, not a long measurement
    assert main(["run", str(default), "-o", str(root / "runs" / "default"), "--no-progress", "--no-plots",
                 "--requests", "12"]) == 0
    assert main(["compare", str(default), "-o", str(root / "runs" / "compare-default"), "--no-plots",
                 "--requests", "12"]) == 0
    return root


@pytest.mark.parametrize("cwd", [".", "notebooks"])
@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebooks_run_as_shipped_with_nbconvert_after_make_run(made_run, kernel_name, name, cwd, tmp_path):
    import subprocess

    cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
           f"--ExecutePreprocessor.kernel_name={kernel_name}", "--ExecutePreprocessor.timeout=180",
           "--output-dir", str(tmp_path), str(made_run / "notebooks" / name)]
    res = subprocess.run(cmd, cwd=made_run / cwd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _images(nbformat.read(tmp_path / name, as_version=4)) >= 4


def test_the_documented_notebook_command_writes_outside_the_tracked_files(tmp_path):
    # the README's command left notebooks/*.nbconvert.ipynb in the repo; its copies now go to runs/notebooks
    import re
    import shlex
    import subprocess

    readme = (ROOT / "README.md").read_text()
    command = re.search(r"`(jupyter nbconvert [^`]*)`", readme).group(1)
    assert "--output-dir runs/notebooks" in command
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "runs/" in ignored and "*.nbconvert.ipynb" in ignored
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "notebooks" / "a.ipynb")
    args = [a for a in shlex.split(command) if a != "--execute"]  # the paths and names, without a kernel
    jupyter = [sys.executable, "-m", "jupyter"] + args[1:]
    subprocess.run(jupyter, cwd=tmp_path, check=True, capture_output=True, timeout=120)
    assert [p.name for p in (tmp_path / "notebooks").iterdir()] == ["a.ipynb"]
    assert (tmp_path / "runs" / "notebooks" / "a.ipynb").is_file()
