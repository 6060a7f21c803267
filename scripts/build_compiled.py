"""The optional compiled build: mypyc compiles the simulator's hot modules in place (a `.so` next to
each `.py`, git-ignored). The pure-Python source stays the reference: the same files, unchanged
behaviour, and `SERVETWIN_PURE_PYTHON=1` (or `--clean`) runs them even where the build exists.
`servetwin.compiled_modules()` says which modules a process runs compiled.

Needs mypy (it ships mypyc; `pip install -e ".[compiled]"`) and a C compiler. `make build-compiled`
runs this, `make test-compiled` tests the build, `make clean-compiled` removes it.

Usage: python scripts/build_compiled.py [--clean] [--check]
  --check   type-check the modules as the build does, compile nothing (what a source edit must pass)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The simulator's hot path (benchmarks/sim_speed.py --compiled measures the gain). Left out:
# core/sched/request_queue.py (mypyc 2.4.1 builds its deque subclass into a segfault),
# core/sampling_params.py (its checks of a caller's value types would become TypeErrors),
# core/testbed/trace.py (its pickling reads `__dict__`, which a compiled class lacks) and sim/frontend.py:
# compiled, they ran byte-identically but a 30k-request bench run peaked at +22 MB and +54 MB of RSS
# (docs/compiled_build.md), and
# the modules whose time is small (workload generation, experiments, gpu/).
COMPILED_MODULES = (
    "servetwin.core.request", "servetwin.core.kv_cache.hashing", "servetwin.core.kv_cache.block_pool",
    "servetwin.core.kv_cache.single_type_kv_cache_manager", "servetwin.core.kv_cache.kv_cache_coordinator",
    "servetwin.core.kv_cache.kv_cache_manager", "servetwin.core.sched.output", "servetwin.core.sched.scheduler",
    "servetwin.core.engine.engine_core", "servetwin.core.testbed.step_table",
    "servetwin.core.testbed.iteration",
    "servetwin.sim.lazy_decode", "servetwin.sim.scheduler", "servetwin.sim.cost_model",
    "servetwin.sim.executor", "servetwin.sim.engine",
)

# What mypy may report without the compiled code behaving differently from the source: mypyc runs
# these operations generically, as the interpreter does (attributes of Optional values, operators
# on them, lists built of mixed items). Everything else stays an error: a mismatch of a declared
# type (assignment, argument, return) becomes a TypeError at run time in compiled code.
IGNORED_ERROR_CODES = ("union-attr", "operator", "index", "misc", "attr-defined", "type-var",
                       "annotation-unchecked", "list-item")
# Third-party packages are not analysed (--no-site-packages): their values are plain Python objects to
# the compiled code, and the build stays about a minute and 1 GB whatever the venv holds (torch...).
MYPY_FLAGS = ["--no-site-packages", "--ignore-missing-imports", "--follow-imports=silent",
              *(f"--disable-error-code={code}" for code in IGNORED_ERROR_CODES)]
SUBPACKAGES = ("core", "sim", "gpu", "experiments")  # where modules live (never .venv/ or build folders)
# mypyc links every module into one shared library (calls between them stay native); it lives in
# the package as servetwin/_native__mypyc*.so
GROUP = "servetwin._native"


def module_files() -> list[str]:
    """The modules as paths under the package folder `servetwin/` (how mypyc names them)."""
    return ["servetwin/" + m.removeprefix("servetwin.").replace(".", "/") + ".py" for m in COMPILED_MODULES]


def built_files() -> list[Path]:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    names = [m.removeprefix("servetwin.").split(".") for m in COMPILED_MODULES] + [["_native__mypyc"]]
    return [ROOT.joinpath(*parts[:-1], parts[-1] + suffix) for parts in names]


def stale_files() -> list[Path]:
    """Every module this build may have left in the package folders (of this or an earlier module
    list): a `.so` next to a `.py` of the same name, and the group's shared library."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    found = set(ROOT.glob("*__mypyc*.so"))
    for sub in SUBPACKAGES:
        found |= {f for f in (ROOT / sub).rglob("*" + suffix) if f.with_name(f.name[:-len(suffix)] + ".py").exists()}
    return sorted(found)


def clean() -> None:
    for f in stale_files():
        f.unlink()
        print(f"removed {f.relative_to(ROOT)}")


def _package_view(tmp: str) -> str:
    """A folder holding `servetwin` -> the checkout (the repository root is the package, whatever
    the clone's folder is called): mypyc names modules by their path, and writes through the link."""
    os.symlink(ROOT, os.path.join(tmp, "servetwin"))
    return tmp


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        return subprocess.run([sys.executable, "-m", "mypy", *MYPY_FLAGS, *module_files()],
                              cwd=_package_view(tmp)).returncode


_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
flags, files, group = sys.argv[1].split("\\n"), sys.argv[2].split("\\n"), sys.argv[3]
sys.argv = [sys.argv[0], "build_ext", "--inplace"]
setup(name="servetwin-compiled", ext_modules=mypycify(flags + files, group_name=group), script_args=sys.argv[1:])
"""


def build() -> int:
    try:
        import mypyc  # noqa: F401, PLC0415
    except ImportError:
        print("build_compiled: mypyc is missing: pip install -e '.[compiled]' (it ships with mypy)", file=sys.stderr)
        return 2
    clean()  # a stale module of an earlier list must not shadow its source
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", _SETUP, "\n".join(MYPY_FLAGS), "\n".join(module_files()), GROUP],
                             cwd=_package_view(tmp), capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stdout[-6000:], out.stderr[-6000:], sep="\n", file=sys.stderr)
        print("build_compiled: failed (above); the pure-Python modules are unaffected", file=sys.stderr)
        clean()
        return 1
    missing = [f for f in built_files() if not f.exists()]
    if missing:
        print(f"build_compiled: not built: {[str(f) for f in missing]}", file=sys.stderr)
        return 1
    print(f"build_compiled: {len(COMPILED_MODULES)} modules compiled in place: {', '.join(COMPILED_MODULES)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clean", action="store_true", help="remove the compiled modules")
    ap.add_argument("--check", action="store_true", help="type-check as the build does, compile nothing")
    args = ap.parse_args(argv)
    if args.clean:
        clean()
        return 0
    return check() if args.check else build()


if __name__ == "__main__":
    sys.exit(main())
