"""Shared checks for the simulator's exact shortcuts (fast-forward, implicit decodes)."""


def assert_same_block_pool(a_engine, b_engine) -> None:
    """Identical final block state: the free queue's order and every block's hash, ids included."""
    ap, bp = a_engine.scheduler.kv_cache_manager.block_pool, b_engine.scheduler.kv_cache_manager.block_pool
    assert [b.block_id for b in ap.free_block_queue.get_all_free_blocks()] == \
           [b.block_id for b in bp.free_block_queue.get_all_free_blocks()]
    assert [b.block_hash for b in ap.blocks] == [b.block_hash for b in bp.blocks]


def small_workload(requests: int, seed: int, out_hi: int, prompt_hi: int, rate, shared: bool, **extra) -> dict:
    """A small random workload: uniform prompt/output lengths, or groups of 3 sharing a 20-token prefix."""
    workload = {"requests": requests, "seed": seed, "output_tokens": {"type": "uniform", "low": 1, "high": out_hi},
                "arrival": {"type": "offline"} if rate is None else {"type": "poisson", "rate": rate}, **extra}
    if shared:
        workload.pop("requests")
        workload["shared_prefix"] = {"groups": max(1, requests // 3), "per_group": 3, "prefix_tokens": 20,
                                     "suffix_tokens": {"type": "uniform", "low": 0, "high": prompt_hi}}
    else:
        workload["prompt_tokens"] = {"type": "uniform", "low": 1, "high": prompt_hi}
    return workload
