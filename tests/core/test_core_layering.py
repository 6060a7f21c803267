"""Layering rules, read from the source (every import: module level, inside functions, and the module
strings given to `__import__` / `importlib.import_module`):

- core/ imports neither servetwin.sim, servetwin.gpu, torch nor simpy (backends are entry-point plugins);
- sim/ imports neither servetwin.gpu nor torch; gpu/ never imports servetwin.sim;
- no import cycle between the package's files;
- no code sets a private attribute of another object (`other._x = ...`).
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "servetwin"
SOURCE_DIRS = ("core", "sim", "gpu", "experiments")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGE, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files() -> dict[str, pathlib.Path]:
    """Module name -> file, for every source file of the package (tests, benchmarks, scripts excluded)."""
    out = {PACKAGE: ROOT / "__init__.py"}
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            out[_module_name(path)] = path
    return out


FILES = _files()


def _string_imports(node: ast.Call) -> list[str]:
    """`__import__("x")`, `importlib.import_module("x")`, `import_module("x")` with a literal name."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if name in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return [node.args[0].value]
    return []


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (read by type checkers only, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(path: pathlib.Path, runtime_only: bool = False) -> list[tuple[str, int]]:
    """Every module `path` imports, anywhere in the file: (absolute dotted name, line).
    `runtime_only`: without the imports under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    skip = _type_checking_nodes(tree) if runtime_only else set()
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            # `from pkg import submodule` imports the submodule's file
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names if f"{mod}.{a.name}" in FILES]
        elif isinstance(node, ast.Call):
            out += [(name, node.lineno) for name in _string_imports(node)]
    return out


def _forbidden(dirname: str, banned: tuple[str, ...]) -> list[str]:
    bad = []
    for mod, path in FILES.items():
        if not mod.startswith(f"{PACKAGE}.{dirname}.") and mod != f"{PACKAGE}.{dirname}":
            continue
        for name, line in imports_of(path):
            if any(name == b or name.startswith(b + ".") for b in banned):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


def test_the_scan_sees_function_level_and_string_imports(tmp_path):
    probe = ROOT / "core" / "_layering_probe.py"
    probe.write_text("def f():\n    import servetwin.sim.engine\n    __import__('torch')\n"
                     "    import importlib\n    importlib.import_module('simpy')\n")
    try:
        assert {n for n, _ in imports_of(probe)} >= {"servetwin.sim.engine", "torch", "simpy"}
    finally:
        probe.unlink()


def test_core_imports_no_backend_and_neither_torch_nor_simpy():
    assert _forbidden("core", ("servetwin.sim", "servetwin.gpu", "torch", "simpy")) == []


def test_sim_never_imports_gpu_or_torch():
    assert _forbidden("sim", ("servetwin.gpu", "torch")) == []


def test_gpu_never_imports_sim():
    assert _forbidden("gpu", ("servetwin.sim",)) == []


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in FILES}
    for mod, path in FILES.items():
        for name, _ in imports_of(path, runtime_only=True):
            while name and name not in FILES:  # `from a.b import func`: the file a/b.py
                name = name.rpartition(".")[0]
            # importing one's own parent package (`import servetwin` to read its __file__) adds nothing:
            # a package is always initialised before its submodules
            if name and name != mod and name.startswith(PACKAGE) and not mod.startswith(name + "."):
                graph[mod].add(name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_files():
    """Package `__init__` files count as files; every import that runs counts, also those inside functions
    (only the `if TYPE_CHECKING:` ones, which never run, are left out)."""
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_experiments_subpackages_form_layers_under_their_clis():
    """experiments/ holds one subpackage per command over shared ones (docs/architecture.md): apart from
    the `*_cli.py` argument-parsing modules, no two of its subpackages import each other, even through
    others."""
    top = f"{PACKAGE}.experiments."
    def subpackage(mod: str) -> str:
        return mod[len(top):].split(".")[0] if mod.startswith(top) and mod.count(".") >= 3 else ""
    graph: dict[str, set[str]] = {}
    for mod, deps in _graph().items():
        if subpackage(mod) and not mod.endswith("_cli"):
            graph.setdefault(subpackage(mod), set()).update(
                subpackage(d) for d in deps if subpackage(d) not in ("", subpackage(mod)))
    assert {"run", "sweep", "config", "common"} <= graph.keys() and graph["sweep"] >= {"run"}
    cycles = _cycles({k: v & graph.keys() for k, v in graph.items()})
    assert cycles == [], "subpackage cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _assigned_attributes(tree: ast.AST) -> list[ast.Attribute]:
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        out += [t for t in targets if isinstance(t, ast.Attribute)]
    return out


def _own_private_names(tree: ast.AST) -> set[str]:
    """Private attributes the file's own classes declare (class-body fields, `self._x = ...`)."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        names.update(t.attr for t in _assigned_attributes(cls)
                     if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
    return {n for n in names if n.startswith("_")}


def test_no_private_attribute_of_another_object_is_set():
    """`obj._x = ...` only where obj's class is defined (e.g. a `clone()` filling its copy); never on a
    library's object (SimPy's `event._ok`) or another module's class."""
    bad = []
    for path in FILES.values():
        tree = ast.parse(path.read_text())
        own = _own_private_names(tree)
        for t in _assigned_attributes(tree):
            if t.attr.startswith("_") and not t.attr.startswith("__") and t.attr not in own \
                    and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                bad.append(f"{path.relative_to(ROOT)}:{t.lineno} sets {ast.unparse(t)}")
    assert bad == []


def test_importing_core_loads_neither_torch_nor_simpy_nor_a_backend():
    code = ("import sys, servetwin.core, servetwin.core.engine.llm, servetwin.core.testbed.replay, "
            "servetwin.core.testbed.trace, servetwin.core.engine.engine_factory, servetwin.core.engine.engine_client, "
            "servetwin.core.entrypoints.openai.api_server; "
            "from servetwin.core.engine.engine_args import EngineArgs; "
            "from servetwin.core.engine.engine_factory import create_engine_core; "
            "create_engine_core(EngineArgs(backend='fake')); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'simpy') "
            "or m.startswith(('servetwin.sim', 'servetwin.gpu'))]; print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == ""
