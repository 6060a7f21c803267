"""Pipeline parallelism in simulated time: the stages' step times and the activation sends between them.

At `pipeline_parallel_size` = PP the model's layers are split as vLLM splits them (`stage_layers`, vLLM
0.33 distributed/utils.py:198 `get_pp_indices`) and each stage is one device. The cost model prices the
whole model's step (`CostModel.predict`); a stage runs the input preparation (`prepare_s`, every worker
builds its own inputs) and its share of the forward (`forward_s` x its layers / all layers: every
forward term is per layer); the last stage also runs the LM head and the sampler (`sample_s`). Between
two stages the hidden states ([tokens, hidden] in the activation dtype) cross the interconnect: one
send of `latency + bytes / bandwidth` (`HardwareSpec.interconnect_*`).

`PipelineStages.launch(t, timing, num_tokens)` books one batch: it enters stage k when stage k-1 has
sent it and stage k is free, and ends when the last stage is done; the engine's batch queue
(`SchedulerConfig.max_concurrent_batches` = PP, core/engine/engine_core.py) keeps PP batches in flight,
so the stages work on different batches at once. Nothing here reads the host clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from servetwin.core.outputs import StepTiming


def stage_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage (vLLM's `get_pp_indices` partition): equal parts, the remainder one layer each to
    the stages before the last, counted back from it."""
    parts = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        parts[-i] += 1
    return parts


@dataclass(slots=True)
class PipelineStages:
    """The PP stages of one engine and when each is free again."""
    layers: list[int]  # per stage
    hidden_bytes_per_token: int  # one token's hidden state in the activation dtype
    link_bandwidth: float  # bytes/s, one direction
    link_latency_s: float
    free_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.layers) < 2:
            raise ValueError(f"layers: a pipeline has 2 or more stages, got {self.layers!r}")
        if self.link_bandwidth <= 0:
            raise ValueError("link_bandwidth: pipeline parallelism needs an interconnect (hardware "
                             "interconnect_bandwidth is 0)")
        self.free_at = [0.0] * len(self.layers)

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def send_s(self, num_tokens: int) -> float:
        """One stage-to-stage send of `num_tokens` hidden states."""
        return self.link_latency_s + num_tokens * self.hidden_bytes_per_token / self.link_bandwidth

    def stage_s(self, timing: StepTiming) -> list[float]:
        """Each stage's time for a step the cost model priced as `timing` (the whole model)."""
        total = sum(self.layers)
        out = [timing.prepare_s + timing.forward_s * n / total for n in self.layers]
        out[-1] += timing.sample_s
        return out

    def launch(self, t: float, timing: StepTiming, num_tokens: int) -> float:
        """Book a batch launched at `t`: when its last stage is done."""
        ready = t
        hop = self.send_s(num_tokens)
        for k, s in enumerate(self.stage_s(timing)):
            start = max(ready, self.free_at[k])
            self.free_at[k] = start + s
            ready = self.free_at[k] + (hop if k < self.num_stages - 1 else 0.0)
        return self.free_at[-1]

    def reset(self) -> None:
        self.free_at = [0.0] * self.num_stages


__all__ = ["PipelineStages", "stage_layers"]
