"""The `Executor` protocol that backends implement, the one registry of backends, and the fake executor.

A backend is a plugin: an `ExecutorBackend` object named by an entry point of the group
`servetwin.executors` (pyproject.toml registers `sim`, `torch` and `fake`; another package can add
its own). `executor_backend(name)` loads it by name, so core never imports `sim/` or `gpu/`.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

from servetwin.core.config_error import ConfigError
from servetwin.core.outputs import ModelRunnerOutput, StepTiming
from servetwin.core.sched.output import SchedulerOutput
from servetwin.core.engine.runner_state import RunnerState

if TYPE_CHECKING:
    from servetwin.core.engine.engine_args import EngineArgs


@runtime_checkable
class Executor(Protocol):
    """Executes one `SchedulerOutput` and returns the sampled tokens (and the step's timing).

    A backend that drafts for speculative decoding also has `take_draft_token_ids() ->
    Optional[DraftTokenIds]` (vLLM's executor method): the drafts of the step just executed, which
    `EngineCore.post_step` hands to the scheduler (sync scheduling)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class ExecutorInfo:
    """An executor with the final KV pool size and `max_model_len` (what the scheduler is built for)."""
    executor: Any
    num_gpu_blocks: int
    max_model_len: int
    vocab_size: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_path: Optional[str] = None
    # the model's KV cache groups (core/kv_cache/kv_cache_planning.py); None: one full-attention group
    kv_cache_groups: Optional[tuple] = None
    # an MoE model: its data-parallel ranks step in lockstep (vLLM's DPEngineCoreProc, core.py:1546-1555)
    is_moe: bool = False


@dataclass(frozen=True, slots=True)
class ExecutorBackend:
    """What a backend plugin registers: its executor class and how to build one from `EngineArgs`
    (sizing the KV pool and `max_model_len` the way that backend does).

    `executor_class` may be named as "module:Class", imported on first use, so that the plugin itself
    loads without the executor's heavy imports (torch) and `check_args` stays cheap. `check_args(args)`
    (optional) validates the arguments against what the backend knows without loading anything (e.g.
    the model's config on disk) and raises `ConfigError` naming the argument: experiment configs call
    it when they are parsed, before any model load. `batch_defaults(hardware, api_server)` (optional)
    gives the (max_num_batched_tokens, max_num_seqs) that vLLM would pick on the backend's device for
    an API server or the offline `LLM` (vLLM's defaults depend on the GPU), or None where the
    `EngineArgs` defaults stand; `apply_batch_defaults` fills them where the caller left them out.
    `init_dp_group(info: DPRankInfo) -> DPGroup` (optional) joins the data-parallel group an MoE model's
    ranks step in lockstep with (core/engine/dp_lockstep.py); a backend without it runs every DP rank
    independently, as for a dense model. Executors of such a backend have `execute_dummy_batch()`."""
    name: str
    executor_class: type | str
    from_engine_args: Callable[["EngineArgs"], ExecutorInfo]
    check_args: Optional[Callable[["EngineArgs"], None]] = None
    batch_defaults: Optional[Callable[[Any, bool], Optional[tuple[int, int]]]] = None
    init_dp_group: Optional[Callable[[Any], Any]] = None

    def load_executor_class(self) -> type:
        if not isinstance(self.executor_class, str):
            return self.executor_class
        module, _, attr = self.executor_class.partition(":")
        return getattr(importlib.import_module(module), attr)


class FakeExecutor:
    """Deterministic tokens, never EOS: row r of step s samples `(s*7 + r) % 1000 + 10`.

    This is the token rule of the recorded vLLM oracle. `step_time_s` is the (constant) duration
    reported per step. `token_fn(req_id, base_token) -> token`, when given, may replace a row's token
    (scenario replay's scripted EOS / stop tokens); it is called once per sampled token, in row order.
    """

    def __init__(self, step_time_s: float = 0.0,
                 token_fn: Optional[Callable[[str, int], int]] = None) -> None:
        self.state = RunnerState()
        self.step_time_s = step_time_s
        self.token_fn = token_fn

    def reset(self) -> None:
        """Forget every request (a new engine over this executor starts from an empty runner state)."""
        self.state = RunnerState()

    def take_draft_token_ids(self) -> None:
        """No drafter: a speculative config schedules no drafts here (the replay's worker drafts)."""
        return None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        rows = self.state.update(scheduler_output)
        step = scheduler_output.step
        sampled: list[list[int]] = []
        for r, row in enumerate(rows):
            if row.samples:
                tok = (step * 7 + r) % 1000 + 10
                if self.token_fn is not None:
                    tok = self.token_fn(row.req_id, tok)
                sampled.append([tok])
                self.state.append_sampled(row.req_id, [tok])
            else:
                sampled.append([])
        ids = [row.req_id for row in rows]
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
            timing=StepTiming(duration_s=self.step_time_s),
        )


def build_fake_executor(args: "EngineArgs") -> ExecutorInfo:
    max_len = args.max_model_len if args.max_model_len not in (None, -1) else 4096
    return ExecutorInfo(FakeExecutor(), args.num_gpu_blocks or 8192, max_len)


FAKE_BACKEND = ExecutorBackend("fake", FakeExecutor, build_fake_executor)


# -- the registry ---------------------------------------------------------------------------------
ENTRY_POINT_GROUP = "servetwin.executors"
NO_BACKENDS = ("none: the servetwin.executors entry points are missing - install the project "
               "(`python -m pip install --no-deps -e .`, again after pyproject.toml changes)")


class BackendUnavailableError(ConfigError):
    """A backend that is not registered, or whose plugin module fails to import (e.g. torch missing)."""


def _entry_points() -> dict[str, Any]:
    return dict(_scan_entry_points(tuple(sys.path)))


@functools.lru_cache(maxsize=4)
def _scan_entry_points(search_path: tuple[str, ...]) -> dict[str, Any]:
    """One scan per import path: a scan reads every installed distribution's metadata (~10 ms in the dev
    venv) and configs and engines look their backend up often (twice per config validated: a sweep's every
    point); vLLM too reads its plugins' entry points once per process (vllm/plugins/__init__.py:77-85)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def registered_backends() -> list[str]:
    """The names of the executor backends installed (entry points of group `servetwin.executors`)."""
    return sorted(_entry_points())


def executor_backend(name: str) -> ExecutorBackend:
    """Load a backend by name from its entry point, as vLLM loads its plugins (`entry_points(group=...)`,
    then `load()`); core never imports a backend package itself."""
    eps = _entry_points()
    if name not in eps:
        found = ", ".join(map(repr, sorted(eps))) or NO_BACKENDS
        raise BackendUnavailableError("backend", f"unknown executor backend {name!r}; registered: {found}")
    ep = eps[name]
    try:
        backend = ep.load()
    except ImportError as e:
        raise BackendUnavailableError("backend", f"executor backend {name!r} ({ep.value}) is registered but "
                                                 f"cannot be imported: {e}") from e
    if not isinstance(backend, ExecutorBackend):
        raise BackendUnavailableError("backend", f"entry point {name!r} ({ep.value}) is a "
                                                 f"{type(backend).__name__}, not an ExecutorBackend")
    return backend


def make_executor(name: str, **kwargs: Any) -> Executor:
    """An executor of a registered backend, built from its constructor's keyword arguments."""
    return executor_backend(name).load_executor_class()(**kwargs)


def check_engine_args(args: "EngineArgs") -> None:
    """The backend's cheap checks of `args` (`ExecutorBackend.check_args`), before any executor is built."""
    check = executor_backend(args.backend).check_args
    if check is not None:
        check(args)


__all__ = ["Executor", "ExecutorBackend", "ExecutorInfo", "FakeExecutor", "BackendUnavailableError", "NO_BACKENDS",
           "check_engine_args", "executor_backend", "make_executor", "registered_backends"]
