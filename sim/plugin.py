"""The simulator's executor plugin (entry point `sim` of the group `servetwin.executors`)."""
from __future__ import annotations

from typing import Any, Optional

from servetwin.core.engine.engine_args import vllm_default_batch_limits
from servetwin.core.engine.executor import ExecutorBackend
from servetwin.sim.executor import SimExecutor
from servetwin.sim.hardware import load_hardware
from servetwin.sim.kv_pool import DEFAULT_HARDWARE, build_sim_executor


def vllm_batch_defaults(hardware: Any, api_server: bool) -> Optional[tuple[int, int]]:
    """vLLM's step budget and running cap on the simulated device (None on a CPU: servetwin's own)."""
    hw = load_hardware(hardware if hardware is not None else DEFAULT_HARDWARE)
    if hw.device_type != "cuda":
        return None
    return vllm_default_batch_limits(hw.name, hw.memory_bytes, api_server)


BACKEND = ExecutorBackend("sim", SimExecutor, build_sim_executor, batch_defaults=vllm_batch_defaults)
