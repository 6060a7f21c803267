"""`SimScheduler._group_rows_fit` (several KV cache groups: whether the running pass's rows all get their new blocks)
decides as its row-by-row check, which counts each row's sliding-window frees: its first pass without the frees
(`_rows_fit_without_frees`) says "fits" only when the row-by-row check does."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_factory import create_engine_core
from servetwin.sim.engine import Simulation
from servetwin.sim.workload import build_workload, rng_streams
from sim_helpers import small_engine, small_workload, window_model


def _check_state(sim: Simulation, tokens: list[int], slack: list[int], checked: list[int]) -> None:
    """At a step boundary: the two checks on the running requests' rows (members a token each, from the next
    step's C; the others `tokens` each), with the pool's free blocks and fewer."""
    sched = sim.engine.scheduler
    lazy = sched.lazy
    if lazy is None or not sched._group_managers or not sched.running:
        return
    step = sched.current_step
    in_place = dict(lazy.members)
    rows = [(r, 1 if r.request_id in in_place else tokens[i % len(tokens)]) for i, r in enumerate(sched.running)]
    free = sched.kv_cache_manager.block_pool.free_block_queue.num_free_blocks
    for f in {max(0, free - s) for s in slack} | {free}:
        by_row = sched._group_rows_fit_by_row(rows, in_place, step, f)
        if sched._rows_fit_without_frees(rows, in_place, step, f):
            assert by_row
            checked[0] += 1
    assert sched._group_rows_fit(rows, in_place, step) == sched._group_rows_fit_by_row(rows, in_place, step, free)


@settings(max_examples=25, deadline=None)
@given(async_scheduling=st.booleans(), caching=st.booleans(), block_size=st.sampled_from([1, 2, 4, 8]),
       window=st.sampled_from([5, 9, 24]), extra_blocks=st.sampled_from([0, 8, 60]), shared=st.booleans(),
       tokens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       slack=st.lists(st.integers(0, 12), min_size=1, max_size=4), seed=st.integers(0, 500))
def test_the_first_pass_without_frees_fits_only_what_the_row_by_row_check_fits(async_scheduling, caching, block_size,
                                                                            window, extra_blocks, shared, tokens,
                                                                            slack, seed):
    """Sliding-window models (the windows' drops free blocks, some shared by a prefix group), small pools, at every
    step boundary of a run: "fits" from the pass without frees implies "fits" row by row, and `_group_rows_fit`
    gives the row-by-row answer."""
    engine_kw = small_engine(window, block_size, 200, extra_blocks, enable_prefix_caching=caching, max_num_seqs=6,
                             async_scheduling=async_scheduling)
    workload = small_workload(8, seed, 90, 30, None, shared, max_output_tokens=90)
    checked = [0]
    with window_model(window):
        args = EngineArgs.from_kwargs(model="tiny-llama", backend="sim", hardware="h100-sxm", skip_tokenizer_init=True,
                                      **engine_kw)
        engine, info = create_engine_core(args)
        spec, requests = build_workload(workload, vocab_size=info.vocab_size)
        sim = Simulation(engine, requests, spec.arrival, rng=rng_streams(spec.seed)["runtime"], fast_forward=False,
                         record_step_requests=False)
        sim.on_step_boundary = lambda s: _check_state(s, tokens, slack, checked)
        sim.run()
    assert checked[0] > 0
