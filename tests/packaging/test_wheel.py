"""One import name: the wheel holds `servetwin` only, and an install of it imports as `servetwin` (never
as `core`). Built offline from a copy of the tracked files (setuptools, no build isolation)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True)
    (whl,) = out.glob("servetwin-*.whl")
    return whl


def test_the_wheel_has_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"servetwin"}, sorted(tops)
    (info,) = dist_info
    top_level = f"{info}/top_level.txt"
    if top_level in names:
        assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["servetwin"]
    for must in ("servetwin/__init__.py", "servetwin/core/sched/scheduler.py", "servetwin/sim/engine.py",
                 "servetwin/sim/plugin.py", "servetwin/gpu/plugin.py", "servetwin/gpu/executor.py",
                 "servetwin/experiments/configs/default.yaml",
                 "servetwin/experiments/configs/prompts/default_chat.jsonl"):  # default.yaml's workload
        assert must in names
    assert not any(n.startswith("servetwin/tests/") for n in names)
    # every subpackage ships (pyproject's `packages` lists each by name: a new folder left out of it is
    # silently missing from an install)
    for d in ("core", "sim", "gpu", "experiments"):
        for init in (ROOT / d).rglob("__init__.py"):
            assert f"servetwin/{init.relative_to(ROOT).as_posix()}" in names, init
    eps = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "[console_scripts]" in eps and "servetwin = servetwin.experiments.cli:main" in eps
    assert "[servetwin.executors]" in eps and "sim = servetwin.sim.plugin:BACKEND" in eps


def test_an_install_imports_as_servetwin_and_not_as_core(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the dependencies (msgspec, ...) from where this interpreter has them; the folder is put on sys.path
    # by a .pth line, which processes none of that folder's own .pth files (no editable finder of ours)
    import msgspec

    (next((venv / "lib").glob("python3*")) / "site-packages" / "deps.pth").write_text(
        str(pathlib.Path(msgspec.__file__).parents[1]) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True)
    away = tmp_path / "elsewhere"  # not the repository: nothing but the install can be found
    away.mkdir()
    code = ("import importlib.util, servetwin, servetwin.core.sched.scheduler, servetwin.sim.engine\n"
            "import servetwin.core.config_error\n"
            "print(servetwin.__file__)\n"
            "print([importlib.util.find_spec(m) is None for m in ('core', 'sim', 'gpu', 'experiments')])\n")
    out = subprocess.run([str(py), "-c", code], cwd=away, capture_output=True, text=True, env={"PATH": "/usr/bin"})
    assert out.returncode == 0, out.stderr
    where, missing = out.stdout.split("\n")[:2]
    assert where.startswith(str(venv)) and missing == "[True, True, True, True]"
    fail = subprocess.run([str(py), "-c", "import core"], cwd=away, capture_output=True, text=True,
                          env={"PATH": "/usr/bin"})
    assert fail.returncode != 0 and "No module named 'core'" in fail.stderr
    assert (venv / "bin" / "servetwin").is_file()  # the console script
