"""Executor backends are entry-point plugins (group `servetwin.executors`), found by name."""
import importlib.metadata
import subprocess
import sys

import pytest

import servetwin.core.engine.executor as executor_mod
from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.core.engine.executor import (BackendUnavailableError, ExecutorBackend, FakeExecutor,
                                            executor_backend, make_executor, registered_backends)


def test_the_three_backends_are_registered_as_entry_points():
    assert {"sim", "torch", "fake"} <= set(registered_backends())
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="servetwin.executors")}
    assert eps["sim"] == "servetwin.sim.plugin:BACKEND" and eps["torch"] == "servetwin.gpu.plugin:BACKEND"
    sim = executor_backend("sim")
    assert isinstance(sim, ExecutorBackend) and sim.name == "sim" and sim.executor_class.__name__ == "SimExecutor"
    assert isinstance(make_executor("fake"), FakeExecutor)


def test_engines_are_built_through_the_registry():
    engine, info = create_engine_core(EngineArgs(backend="sim", model="tiny-llama", hardware="cpu",
                                                 num_gpu_blocks=32, max_model_len=256))
    assert type(info.executor).__name__ == "SimExecutor" and info.num_gpu_blocks == 32
    assert engine.executor is info.executor


def test_an_unknown_backend_lists_the_registered_ones():
    with pytest.raises(BackendUnavailableError) as exc:
        executor_backend("tpu")
    assert exc.value.path == "backend" and "'tpu'" in exc.value.message
    assert all(f"'{name}'" in exc.value.message for name in ("fake", "sim", "torch"))
    with pytest.raises(ConfigError, match=r"^backend: must be a registered executor backend \('fake', 'sim', 'torch'"):
        EngineArgs.from_kwargs(backend="tpu")


def test_without_installed_entry_points_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setattr(executor_mod, "_entry_points", lambda: {})
    for call in (lambda: executor_backend("sim"), lambda: EngineArgs.from_kwargs(backend="sim")):
        with pytest.raises(ConfigError, match=r"entry points are missing.*pip install --no-deps -e \."):
            call()


def test_a_registered_backend_that_fails_to_import_says_so(monkeypatch):
    broken = importlib.metadata.EntryPoint("broken", "servetwin_no_such_plugin_module:BACKEND",
                                           "servetwin.executors")
    real = executor_mod._entry_points
    monkeypatch.setattr(executor_mod, "_entry_points", lambda: {**real(), "broken": broken})
    with pytest.raises(BackendUnavailableError) as exc:
        executor_backend("broken")
    msg = str(exc.value)
    assert msg.startswith("backend: executor backend 'broken' (servetwin_no_such_plugin_module:BACKEND) is "
                          "registered but cannot be imported") and "servetwin_no_such_plugin_module" in msg


def test_torch_missing_is_a_clear_error_and_the_sim_still_works():
    code = ("import sys; sys.modules['torch'] = None\n"  # what an environment without torch sees
            "from servetwin.core.engine.executor import executor_backend, BackendUnavailableError\n"
            "assert executor_backend('sim').name == 'sim'\n"
            "try:\n    executor_backend('torch')\nexcept BackendUnavailableError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.startswith("backend: executor backend 'torch' (servetwin.gpu.plugin:BACKEND) is registered "
                                 "but cannot be imported") and "torch" in out.stdout.split("imported:")[1]


def test_the_torch_plugin_loads_without_torch_and_checks_args_cheaply():
    code = ("import sys\nfrom servetwin.core.engine.executor import executor_backend, check_engine_args\n"
            "from servetwin.core.engine.engine_args import EngineArgs\n"
            "b = executor_backend('torch')\nassert b.check_args is not None and 'torch' not in sys.modules\n"
            "check_engine_args(EngineArgs(backend='torch', model='/no/such/model', max_model_len=10**9))\n"
            "assert 'torch' not in sys.modules\n"  # a model not on disk is checked when it loads
            "print(b.load_executor_class().__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "TorchExecutor"
    assert executor_backend("sim").check_args is None  # the sim checks when its (cheap) executor is built


def test_engines_run_the_backend_checks_before_building(tmp_path):
    # a model folder with only a config.json: building would fail on the missing weights, the check comes first
    (tmp_path / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 64}')
    code = ("import sys\nfrom servetwin.core.config_error import ConfigError\n"
            "from servetwin.core.engine.engine_args import EngineArgs\n"
            "from servetwin.core.engine.engine_factory import create_engine_core\n"
            f"try:\n    create_engine_core(EngineArgs(backend='torch', model={str(tmp_path)!r}, max_model_len=65))\n"
            "except ConfigError as e:\n    print(e)\nprint('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.splitlines() == ["max_model_len: 65 exceeds the model's max_position_embeddings (64)", "False"]
