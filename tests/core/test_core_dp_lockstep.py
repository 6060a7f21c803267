"""`DPLockstep`, one MoE data-parallel rank's wave state (vLLM `DPEngineCoreProc`), over an in-memory
group of threads: the all-reduce runs only on step 1 and every 16th step of a wave, every rank ends the wave
at the same step, and start-wave messages of older waves are ignored."""
from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.engine.dp_lockstep import DP_SYNC_INTERVAL, DPLockstep


class ThreadGroup:
    """A `DPGroup` of threads: the sum of every rank's values once all have arrived; counts the calls."""

    def __init__(self, shared: dict, rank: int, world_size: int) -> None:
        self.shared, self.rank, self.world_size = shared, rank, world_size
        self.calls = 0

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        self.calls += 1
        s = self.shared
        with s["lock"]:
            s["parts"][self.rank] = values
        s["barrier"].wait(timeout=10)
        total = [sum(col) for col in zip(*s["parts"])]
        s["barrier"].wait(timeout=10)
        return total

    def close(self) -> None:
        pass


def make_groups(n: int) -> list[ThreadGroup]:
    shared = {"lock": threading.Lock(), "parts": [None] * n, "barrier": threading.Barrier(n)}
    return [ThreadGroup(shared, r, n) for r in range(n)]


@settings(max_examples=25, deadline=None)
@given(work=st.lists(st.integers(min_value=0, max_value=40), min_size=2, max_size=3))
def test_ranks_end_the_wave_together_at_a_sync_step(work):
    """Rank r has `work[r]` steps of requests; every rank runs (a real step or a dummy) until the first sync
    step at which no rank has work left."""
    groups = make_groups(len(work))
    states = [DPLockstep(g) for g in groups]
    ended_at: list = [None] * len(work)

    def run(rank: int) -> None:
        ls = states[rank]
        ls.engines_running = True
        left = work[rank]
        steps = 0
        while ls.engines_running:
            tokens = 1 if left else 0
            left = max(0, left - 1)
            if not tokens:
                ls.dummy_batches += 1
            ls.step_barrier(tokens)
            steps += 1
            if not ls.has_global_unfinished(left > 0):
                ls.end_wave()
        ended_at[rank] = steps

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    last = max(work)
    want = 1 if last <= 1 else -(-last // DP_SYNC_INTERVAL) * DP_SYNC_INTERVAL
    assert ended_at == [want] * len(work)
    for w, ls, g in zip(work, states, groups):
        assert ls.lockstep_steps == want and ls.dummy_batches == want - w
        assert ls.current_wave == 1 and ls.step_counter == 0 and ls.waves == 1
        # one barrier per step, plus the unfinished all-reduce on step 1 and every 16th
        assert g.calls == want + 1 + want // DP_SYNC_INTERVAL


def test_wave_start_rules():
    (g,) = make_groups(1)
    ls = DPLockstep(g)
    assert ls.on_local_request() == 0 and ls.engines_running  # idle: announce wave 0
    assert ls.on_local_request() is None  # already running
    ls.end_wave()
    ls.on_start_wave(0)  # an older wave's message arrives late: ignored
    assert not ls.engines_running and ls.current_wave == 1
    ls.on_start_wave(3)
    assert ls.engines_running and ls.current_wave == 3
    with pytest.raises(ValueError, match="dp_sync_interval"):
        DPLockstep(g, sync_interval=0)
