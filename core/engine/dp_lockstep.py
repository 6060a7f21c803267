"""MoE data parallelism in lockstep: one DP rank's wave state (vLLM 0.33 `DPEngineCoreProc`,
`v1/engine/core.py:2281-2572`), driven by `EngineCoreProc.run_lockstep` (core/engine/engine_proc.py).

Rules (the same ones `sim/lockstep.py` models in simulated time):
- while a wave runs (`engines_running`) every rank steps once per loop iteration; a rank that executed
  no forward runs a dummy batch (`core.py:2497-2512`), so every rank runs the same number of steps;
- every step ends with the step barrier: an all-reduce of the ranks' scheduled token counts (vLLM's
  `coordinate_batch_across_dp`, `v1/worker/dp_utils.py:190-224`, which every forward runs, dummy or not);
- `has_global_unfinished` (`_has_global_unfinished_reqs`, `core.py:2554-2572`): the step counter counts
  every step of the wave; the all-reduce of "has unfinished requests" runs on step 1 and every
  `DP_SYNC_INTERVAL` steps, otherwise the wave keeps running; when no rank has one the wave ends on every
  rank at the same step: `current_wave += 1`, `step_counter = 0` (`core.py:2519-2537`);
- wave start: an idle rank that receives a request starts running and announces `start_wave`
  (`core.py:2372-2385`); the front end relays it to the other ranks, which join when the wave is not
  older than theirs (`core.py:2418-2434`).

The collectives go through a `DPGroup`, which the backend creates (`ExecutorBackend.init_dp_group`; the
torch backend's is a gloo group, `servetwin.gpu.dp_group`): core never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

DP_SYNC_INTERVAL = 16  # vLLM config/parallel.py:163 (dp_sync_interval)


class DPGroup(Protocol):
    """The collectives of one DP group, as the backend implements them."""

    rank: int
    world_size: int

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        """The element-wise sum of every rank's `values` (same length on every rank)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class DPRankInfo:
    """What an engine process needs to join its DP group: its rank, the group size and the rendezvous
    file the backend's group is initialised from (the front end owns its directory)."""
    rank: int
    size: int
    init_path: str


class DPLockstep:
    """One rank's wave state and counters (`dummy_batches`, `lockstep_steps`, `waves`)."""

    def __init__(self, group: DPGroup, sync_interval: int = DP_SYNC_INTERVAL) -> None:
        if sync_interval < 1:
            raise ValueError(f"dp_sync_interval: must be >= 1, got {sync_interval}")
        self.group = group
        self.rank = group.rank
        self.sync_interval = sync_interval
        self.current_wave = 0
        self.step_counter = 0
        self.engines_running = False
        self.lockstep_steps = 0  # steps this rank ran in lockstep (real or dummy)
        self.dummy_batches = 0
        self.padded_tokens = 0  # tokens the other ranks' largest batch exceeded this rank's by, summed
        self.waves = 0  # waves ended

    def on_local_request(self) -> Optional[int]:
        """A request was added here: start running; the wave to announce when this rank was idle."""
        if self.engines_running:
            return None
        self.engines_running = True
        return self.current_wave

    def on_start_wave(self, wave: int) -> None:
        """Another rank started `wave` (vLLM `core.py:2418-2434`: join unless it is an older wave)."""
        if wave >= self.current_wave:
            self.current_wave = wave
            self.engines_running = True

    def step_barrier(self, num_tokens: int) -> list[int]:
        """After this rank's step (real or dummy): every rank's scheduled token count."""
        values = [0] * self.group.world_size
        values[self.rank] = num_tokens
        tokens = self.group.all_reduce_sum(values)
        self.lockstep_steps += 1
        self.padded_tokens += max(tokens) - num_tokens
        return tokens

    def has_global_unfinished(self, local_unfinished: bool) -> bool:
        """vLLM's `_has_global_unfinished_reqs`: the all-reduce on step 1 and every `sync_interval` steps."""
        self.step_counter += 1
        if self.step_counter != 1 and self.step_counter % self.sync_interval != 0:
            return True
        return self.group.all_reduce_sum([int(local_unfinished)])[0] > 0

    def end_wave(self) -> int:
        """The wave ended on every rank: the number of the wave that ended."""
        ended = self.current_wave
        self.engines_running = False
        self.current_wave += 1
        self.step_counter = 0
        self.waves += 1
        return ended

    def stats(self) -> dict[str, int | bool]:
        return dict(lockstep=True, dp_rank=self.rank, lockstep_steps=self.lockstep_steps, dummy_batches=self.dummy_batches,
                    padded_tokens=self.padded_tokens, waves=self.waves, current_wave=self.current_wave,
                    engines_running=self.engines_running)


__all__ = ["DP_SYNC_INTERVAL", "DPGroup", "DPLockstep", "DPRankInfo"]
