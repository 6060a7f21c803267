"""servetwin: a vLLM-v1-identical scheduler shared by a SimPy simulator and a real torch backend.

The repository's folders are this package's subpackages: `servetwin.core` (scheduler, KV cache, engine,
entry points, testbed drivers), `servetwin.sim`, `servetwin.gpu`, `servetwin.experiments`.
"""
import os as _os
import sys as _sys
from importlib.machinery import EXTENSION_SUFFIXES, SOURCE_SUFFIXES, FileFinder, SourceFileLoader


_ROOT = _os.path.dirname(_os.path.abspath(__file__))
_SUBPACKAGES = ("core", "sim", "gpu", "experiments")  # the folders that are this package's modules


def _import_from_source(root: str = _ROOT) -> None:
    """SERVETWIN_PURE_PYTHON=1: the modules of the package at `root` load from their `.py` files even
    where the optional compiled build (scripts/build_compiled.py) put a `.so` next to them (the
    interpreter prefers the `.so`). A path hook for that package's folders only (the root and its
    subpackages: not a virtual environment or anything else kept inside the checkout, whose extension
    modules must still load); every other package is untouched."""
    root = _os.path.abspath(root)

    def source_only(path: str) -> FileFinder:
        path = _os.path.abspath(path)
        top = _os.path.relpath(path, root).split(_os.sep)[0]
        if path != root and (not path.startswith(root + _os.sep) or top not in _SUBPACKAGES):
            raise ImportError("not a servetwin folder")  # (the next path hook takes it)
        return FileFinder(path, (SourceFileLoader, SOURCE_SUFFIXES))

    _sys.path_hooks.insert(0, source_only)
    _sys.path_importer_cache.clear()


def _edited_since_build(root: str = _ROOT) -> list[str]:
    """The compiled modules' sources changed after the compiled build was made ([] without a build):
    a stale `.so` would run the old code, so the whole package then runs from source."""
    suffixes = tuple(EXTENSION_SUFFIXES)
    native = [f for f in _os.listdir(root) if f.startswith("_native__mypyc") and f.endswith(suffixes)]
    if not native:
        return []
    built_at = _os.path.getmtime(_os.path.join(root, native[0]))
    edited = []
    for sub in ("core", "sim"):  # (where scripts/build_compiled.py compiles from)
        for folder, _, files in _os.walk(_os.path.join(root, sub)):
            for f in files:
                stem = f.partition(".")[0]
                if f.endswith(suffixes) and stem + ".py" in files \
                        and _os.path.getmtime(_os.path.join(folder, stem + ".py")) > built_at:
                    edited.append(_os.path.relpath(_os.path.join(folder, stem + ".py"), root))
    return edited


if _os.environ.get("SERVETWIN_PURE_PYTHON") == "1":
    _import_from_source()
elif _edited := _edited_since_build():
    import warnings as _warnings

    _warnings.warn(f"servetwin: {', '.join(_edited)} changed after the compiled build: running pure Python "
                   "(rebuild: make build-compiled; remove: make clean-compiled)", RuntimeWarning, stacklevel=2)
    _import_from_source()

from servetwin.core.request import FinishReason, Request, RequestStatus  # noqa: E402
from servetwin.core.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "Request", "RequestStatus", "FinishReason", "compiled_modules"]


def compiled_modules() -> list[str]:
    """The servetwin modules this process has imported compiled (the optional mypyc build,
    scripts/build_compiled.py); [] when it runs the pure-Python source, the reference."""
    return sorted(name for name, mod in list(_sys.modules.items())
                  if name.startswith("servetwin.") and "__mypyc" not in name  # (not the shared library)
                  and (getattr(mod, "__file__", None) or "").endswith(tuple(EXTENSION_SUFFIXES)))


def __getattr__(name: str):
    # LLM pulls in the engine clients (zmq, msgspec): loaded on first use so `import servetwin.sim` stays light.
    if name == "LLM":
        from servetwin.core.engine.llm import LLM  # noqa: PLC0415
        return LLM
    raise AttributeError(f"module 'servetwin' has no attribute {name!r}")
