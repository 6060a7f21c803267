"""Layering rules: core/ never imports torch or simpy; sim/ never imports torch; gpu/ and sim/ never
import each other."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imported_modules(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_importing_core_loads_neither_torch_nor_simpy():
    code = ("import sys, servetwin.core, servetwin.core.engine.llm, servetwin.core.testbed.replay, servetwin.core.testbed.trace, servetwin.core.engine.engine_factory; "
            "import servetwin.core.engine.engine_client; "
            "bad = [m for m in ('torch', 'simpy', 'gpu', 'sim') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


def test_core_source_has_no_torch_or_simpy_imports_at_module_level():
    for path in (ROOT / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; lazy imports inside functions are allowed
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module.split(".")[0]]
            assert not {"torch", "simpy", "gpu", "sim"} & set(mods), f"{path} imports {mods}"


def test_sim_never_imports_torch_or_gpu():
    assert not {"torch", "gpu"} & _imported_modules("sim")


def test_gpu_never_imports_sim():
    assert "sim" not in _imported_modules("gpu")
