"""The switch between the pure-Python source and the optional compiled build (servetwin/__init__.py,
docs/compiled_build.md): SERVETWIN_PURE_PYTHON's source-only path hook and the stale-build check, on a
throw-away package whose "extension module" cannot even load (no compiler needed)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES

import servetwin

SUFFIX = EXTENSION_SUFFIXES[0]


def _package(tmp_path):
    """pkg/core/mod.py with a `.so` of the same name next to it (the one the interpreter prefers)."""
    pkg = tmp_path / "pkg"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "mod.py").write_text("WHERE = 'source'\n")
    (pkg / "core" / f"mod{SUFFIX}").write_bytes(b"not an extension module")
    (pkg / f"_native__mypyc{SUFFIX}").write_bytes(b"")
    return pkg


def _import_mod(tmp_path, before: str) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import servetwin; {before}"
            "import pkg.core.mod as m; import numpy; print(m.WHERE, m.__file__)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, SERVETWIN_PURE_PYTHON="0"))


def test_the_source_only_hook_loads_the_py_next_to_a_so_and_leaves_other_packages(tmp_path):
    pkg = _package(tmp_path)
    plain = _import_mod(tmp_path, "")
    assert plain.returncode != 0 and "ImportError" in plain.stderr  # the .so goes first (and fails here)
    hooked = _import_mod(tmp_path, f"servetwin._import_from_source({str(pkg)!r}); ")
    assert hooked.returncode == 0, hooked.stderr  # numpy's own extension modules still load
    assert hooked.stdout.split() == ["source", str(pkg / "core" / "mod.py")]


def test_extension_modules_kept_inside_the_checkout_still_load(tmp_path):
    # a virtual environment inside the repository (`make setup`'s .venv): its packages' extension
    # modules are not servetwin's and must load with the hook on (a copy of msgspec stands for them)
    import msgspec

    pkg = _package(tmp_path)
    site = pkg / ".venv" / "lib" / "site-packages"
    shutil.copytree(os.path.dirname(msgspec.__file__), site / "extpkg")
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); import servetwin; "
            f"servetwin._import_from_source({str(pkg)!r}); import extpkg; print(extpkg._core.__file__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, SERVETWIN_PURE_PYTHON="0"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith(SUFFIX)


def test_a_source_edited_after_the_build_is_reported(tmp_path):
    pkg = _package(tmp_path)
    source, build = pkg / "core" / "mod.py", pkg / f"_native__mypyc{SUFFIX}"
    os.utime(source, (1_000, 1_000))
    os.utime(build, (2_000, 2_000))
    assert servetwin._edited_since_build(str(pkg)) == []
    os.utime(source, (3_000, 3_000))
    assert servetwin._edited_since_build(str(pkg)) == [os.path.join("core", "mod.py")]
    build.unlink()
    assert servetwin._edited_since_build(str(pkg)) == []  # no build: nothing is stale
