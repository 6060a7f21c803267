"""The objects the simulator's step loop reads on every step keep their attributes in CPython's compact
layout. CPython 3.11 shares one key table among a class's instances and stores each instance's
attributes inline only up to 29 of them; an instance with more gets a plain dict, and every attribute
read and `self.method()` call on it loses its specialisation (the scheduler reached 49 attributes once
the KV connector and spec-decode state came in: the loop ran ~3% slower; `Scheduler.__slots__` fixed
it). Attributes in __slots__ do not count; a compiled (mypyc) class has no instance dict at all."""
import pytest

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.sim.engine import Simulation
from servetwin.sim.workload import build_workload

COMPACT_MAX_ATTRIBUTES = 29  # CPython 3.11-3.12: past this an instance's attributes move to a plain dict


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_loop_objects_keep_compact_attributes(async_scheduling):
    args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm", skip_tokenizer_init=True,
                                  async_scheduling=async_scheduling, enable_prefix_caching=True)
    engine, info = create_engine_core(args)
    spec, requests = build_workload({"requests": 6, "seed": 3, "prompt_tokens": 40, "output_tokens": 30,
                                     "arrival": {"type": "offline"}}, vocab_size=info.vocab_size)
    sim = Simulation(engine, requests, spec.arrival, record_step_requests=False)
    assert len(sim.run().completion_s) == 6  # attributes set while running count too
    scheduler = engine.scheduler
    hot = {"simulation": sim, "engine core": engine, "scheduler": scheduler, "executor": engine.executor,
           "cost model": engine.executor.cost_model, "KV cache manager": scheduler.kv_cache_manager,
           "block pool": scheduler.kv_cache_manager.block_pool, "trace recorder": sim.recorder}
    if getattr(scheduler, "lazy", None) is not None:
        hot["implicit decodes"] = scheduler.lazy
    for name, obj in hot.items():
        attributes = getattr(obj, "__dict__", {})
        assert len(attributes) <= COMPACT_MAX_ATTRIBUTES, (
            f"{name} ({type(obj).__name__}) has {len(attributes)} instance attributes in its dict: past "
            f"{COMPACT_MAX_ATTRIBUTES} every access to it is slower; put some in __slots__ or in a part object")
