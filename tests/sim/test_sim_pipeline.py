"""Pipeline parallelism in the simulator: stage times from the cost model, activation sends on the link,
and the engine's batch queue of PP batches (decisions identical to the core engine's at PP=2)."""
from __future__ import annotations

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.engine_factory import create_executor
from servetwin.core.engine.executor import FakeExecutor
from servetwin.core.outputs import StepTiming
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.sim.arrivals import Offline
from servetwin.sim.coefficients import CostCoefficients
from servetwin.sim.cost_model import CostModel
from servetwin.sim.engine import simulate
from servetwin.sim.executor import SimExecutor
from servetwin.sim.pipeline import PipelineStages, stage_layers
from servetwin.sim.workload import WorkloadRequest

HOP_S = 0.01  # the link's latency; its bandwidth makes the bytes free


def test_stage_layers_is_vllms_partition():
    assert stage_layers(30, 2) == [15, 15] and stage_layers(10, 4) == [2, 3, 3, 2]
    assert stage_layers(5, 3) == [2, 2, 1] and stage_layers(7, 4) == [2, 2, 2, 1]


def test_a_batch_takes_every_stage_and_the_stages_overlap_batches():
    pipe = PipelineStages([2, 2], hidden_bytes_per_token=1000, link_bandwidth=1e6, link_latency_s=0.001)
    one = StepTiming(duration_s=1.4, prepare_s=0.1, forward_s=1.0, sample_s=0.3)
    assert pipe.stage_s(one) == pytest.approx([0.6, 0.9])  # prepare + half the forward; the last samples
    hop = 0.001 + 10 * 1000 / 1e6
    assert pipe.launch(0.0, one, 10) == pytest.approx(0.6 + hop + 0.9)
    # the next batch enters stage 0 when it is free and waits for stage 1
    assert pipe.launch(0.0, one, 10) == pytest.approx(0.6 + hop + 0.9 + 0.9)
    with pytest.raises(ValueError, match="interconnect"):
        PipelineStages([1, 1], 2, 0.0, 0.0)


def _coefficients(num_layers: int) -> CostCoefficients:
    """Every step's forward lasts 1 s (one launch term per layer), nothing else costs."""
    return CostCoefficients(c_step=0.0, c_linear=0.0, c_attn_prefill=0.0, c_attn_decode=0.0, c_lm_head=0.0,
                            c_comm=0.0, c_layer=1.0 / num_layers)


class Recording:
    """The executor with every scheduler output's decisions recorded."""

    def __init__(self, inner) -> None:
        self.inner, self.decisions = inner, []

    def __getattr__(self, name: str):  # scheduler_cls, pipeline, ...: the executor's own
        return getattr(self.inner, name)

    def execute_model(self, so):
        if so.total_num_scheduled_tokens:
            self.decisions.append(dict(so.num_scheduled_tokens))
        return self.inner.execute_model(so)


PROMPTS = [[1 + i] + list(range(10 + 3 * i)) for i in range(12)]


def _config(pp: int) -> tuple[SchedulerConfig, CacheConfig]:
    return (SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, max_model_len=512, pipeline_parallel_size=pp),
            CacheConfig(num_gpu_blocks=200, block_size=16))


def _simulate(pp: int):
    layers = CostModel("tiny-llama", "cpu").model.num_layers
    cm = CostModel("tiny-llama", "cpu", coefficients=_coefficients(layers))
    ex = SimExecutor(cost_model=cm)
    if pp > 1:
        ex.pipeline = PipelineStages(stage_layers(cm.model.num_layers, pp), 1, 1e30, HOP_S)
    rec = Recording(ex)
    reqs = [WorkloadRequest(f"r{i}", 0.0, p, 5) for i, p in enumerate(PROMPTS)]
    res = simulate(EngineCore(*_config(pp), rec), reqs, Offline())
    return res, rec.decisions


def test_sim_pp2_decisions_equal_the_core_engine_and_batches_overlap():
    res, decisions = _simulate(2)
    # the core engine at PP=2 over the fake executor: the same batch queue, the same decisions
    rec = Recording(FakeExecutor())
    eng = EngineCore(*_config(2), rec)
    for i, p in enumerate(PROMPTS):
        eng.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=5, ignore_eos=True)))
    while eng.has_work():
        eng.step()
    assert decisions == rec.decisions
    steps = res.recorder.frames()["steps"]
    # a batch: two stages of 0.5 s and one send, after waiting for stage 0 when it is busy with the
    # previous batch (the second batch, launched with the first at t=0)
    span = (steps.t_end_s - steps.t_start_s).round(9)
    assert span.iloc[0] == span.min() == round(1.0 + HOP_S, 9) and span.iloc[1] == round(1.5 + HOP_S, 9)
    # two batches in flight: the next starts before the previous ends
    assert (steps.t_start_s.iloc[1:].to_numpy() < steps.t_end_s.iloc[:-1].to_numpy()).any()
    one, _ = _simulate(1)
    assert res.end_time_s < one.end_time_s
    assert len(res.completion_s) == len(PROMPTS)


def test_sim_backend_takes_pipeline_parallel_size():
    args = EngineArgs.from_kwargs(model="llama-3.1-70b", backend="sim", hardware="h100-sxm",
                                  tensor_parallel_size=4, pipeline_parallel_size=2)
    info = create_executor(args)
    assert info.executor.pipeline is not None and info.executor.pipeline.layers == [40, 40]
    one = create_executor(EngineArgs.from_kwargs(model="llama-3.1-70b", backend="sim", hardware="h100-sxm",
                                                 tensor_parallel_size=4))
    assert one.executor.pipeline is None
    assert info.num_gpu_blocks > 2 * one.num_gpu_blocks  # half the layers and weights per device
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        create_executor(EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm",
                                               pipeline_parallel_size=64))
    with pytest.raises(ConfigError, match="interconnect"):
        create_executor(EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="cpu",
                                               pipeline_parallel_size=2, num_gpu_blocks=64))
