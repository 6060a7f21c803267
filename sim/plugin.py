"""The simulator's executor plugin (entry point `sim` of the group `servetwin.executors`)."""
from __future__ import annotations

from servetwin.core.engine.executor import ExecutorBackend
from servetwin.sim.executor import SimExecutor
from servetwin.sim.kv_pool import build_sim_executor

BACKEND = ExecutorBackend("sim", SimExecutor, build_sim_executor)
