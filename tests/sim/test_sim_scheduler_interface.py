"""The simulator's scheduler subclass stays on the core scheduler's documented interface, and the
core scheduler holds no simulator code path (the shortcuts' exactness: test_sim_lazy_decode.py,
test_sim_fast_forward.py, test_sim_scheduler_fast_forward.py)."""
import ast
import inspect

import pytest

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.sched import scheduler as core_scheduler
from servetwin.core.sched.scheduler import Scheduler
from servetwin.sim.scheduler import SimScheduler


def test_sim_scheduler_overrides_only_public_methods():
    private_overrides = [name for name in vars(SimScheduler)
                         if name.startswith("_") and not name.startswith("__") and hasattr(Scheduler, name)]
    assert private_overrides == []


@pytest.mark.pure_python("parses the scheduler module's source")
def test_core_scheduler_has_no_simulator_code_path():
    """No name in the core scheduler's code (docs aside) belongs to a shortcut."""
    tree = ast.parse(inspect.getsource(core_scheduler))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.name for alias in node.names)
            names.add(getattr(node, "module", None) or "")
    words = ("lazy", "fast_forward", "steady", "implicit", "sim.")
    assert sorted(n for n in names if any(w in n.lower() for w in words)) == []


def test_the_sim_backend_builds_the_sim_scheduler_and_others_the_core_one():
    sim, _ = create_engine_core(EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="cpu",
                                                       skip_tokenizer_init=True))
    fake, _ = create_engine_core(EngineArgs.from_kwargs(model="tiny-llama", backend="fake", skip_tokenizer_init=True))
    assert type(sim.scheduler) is SimScheduler and sim.scheduler.lazy is None  # shortcuts off until a Simulation
    assert type(fake.scheduler) is Scheduler
