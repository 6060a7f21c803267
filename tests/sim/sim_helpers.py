"""Shared checks for the simulator's exact shortcuts (fast-forward, implicit decodes)."""
import contextlib


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


def create_schedulers(**kw):
    """A `SimScheduler` and a core `Scheduler` with the same configuration (sync; one KV group unless
    `kv_cache_groups` says otherwise)."""
    from servetwin.core.sched.config import CacheConfig, SchedulerConfig  # noqa: PLC0415
    from servetwin.core.sched.scheduler import Scheduler  # noqa: PLC0415
    from servetwin.sim.scheduler import SimScheduler  # noqa: PLC0415

    cache_kw = {k: kw.pop(k) for k in ("block_size", "num_gpu_blocks", "enable_prefix_caching", "kv_cache_groups",
                                       "prefix_cache_retention_interval") if k in kw}
    return tuple(cls(SchedulerConfig(**kw), CacheConfig(**cache_kw)) for cls in (SimScheduler, Scheduler))


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int, arrival_time: float = 0.0,
                 eos: int = 50256):
    from servetwin.core.request import Request  # noqa: PLC0415
    from servetwin.core.sampling_params import SamplingParams  # noqa: PLC0415

    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config(eos)
    return Request(request_id, prompt_token_ids, sp, arrival_time=arrival_time)


def sync_step(scheduler, token: int = 1000):
    """schedule -> one token for every sampling row -> update_from_output; returns the outputs."""
    from servetwin.core.outputs import ModelRunnerOutput  # noqa: PLC0415

    so = scheduler.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[rid].is_prefill_chunk else [token] for rid in ids]
    return so, scheduler.update_from_output(so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled))


# hybrid models: tiny-llama's sizes with these attention layers (tests of the decode shortcuts)
LAYER_PATTERNS = {
    "gpt-oss-like": ("sliding_attention", "full_attention"),  # groups [sliding W, full]
    "all-sliding": ("sliding_attention", "sliding_attention"),  # [sliding W]
    "gemma-like": ("sliding_attention",) * 5 + ("full_attention",),  # five sliding groups, then full
}
NUM_KV_CACHE_GROUPS = {"gpt-oss-like": 2, "all-sliding": 1, "gemma-like": 6}


def hybrid_spec(pattern: str, window: int):
    """tiny-llama with the layers of `LAYER_PATTERNS[pattern]` and sliding window `window`."""
    import dataclasses  # noqa: PLC0415

    from servetwin.sim.model_spec import PRESETS  # noqa: PLC0415
    layers = LAYER_PATTERNS[pattern]
    return dataclasses.replace(PRESETS["tiny-llama"], name=f"tiny-{pattern}", num_layers=len(layers),
                               layer_types=layers, sliding_window=window)


@contextlib.contextmanager
def sim_model(spec, retention_interval=0):
    """Sim engines built inside load `spec` as their model, with this sparse-retention interval."""
    import dataclasses  # noqa: PLC0415
    from unittest import mock  # noqa: PLC0415

    import servetwin.sim.kv_pool as kv_pool  # noqa: PLC0415
    from servetwin.core.engine.engine_args import EngineArgs  # noqa: PLC0415
    orig = EngineArgs.cache_config

    def cache_config(self, *a, **kw):
        config = orig(self, *a, **kw)
        if config.kv_cache_groups is None:  # (asked before the model's groups are known)
            return config
        return dataclasses.replace(config, prefix_cache_retention_interval=retention_interval)
    with mock.patch.object(kv_pool, "load_model_spec", lambda name, dtype=None: spec), \
            mock.patch.object(EngineArgs, "cache_config", cache_config):
        yield


def window_model(window):
    """The sim engines built inside use tiny-llama (window None) or the gpt-oss-like pattern with that sliding
    window."""
    return sim_model(hybrid_spec("gpt-oss-like", window)) if window is not None else contextlib.nullcontext()


def small_engine(window, block_size: int, max_model_len: int, extra_blocks: int, **engine_kw) -> dict:
    """Engine kwargs of a small sim engine for `window_model(window)`: its pool holds one max-length request
    plus `extra_blocks`."""
    groups = 1 if window is None else NUM_KV_CACHE_GROUPS["gpt-oss-like"]
    num_blocks = groups * -(-max_model_len // block_size) + 1 + extra_blocks
    return dict(block_size=block_size, num_gpu_blocks=num_blocks, max_model_len=max_model_len, **engine_kw)


# a small cluster experiment (tests/sim/test_sim_cluster_speed.py, test_sim_step_windows.py): 30 requests in 6
# shared-prefix groups of 5, and routers that read scraped metrics or not
CLUSTER_BASE = {
    "name": "speed", "model": "tiny-llama", "hardware": "h100-sxm",
    "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 16, "max_model_len": 384,
               "enable_prefix_caching": True},
    "workload": {"requests": 30, "shared_prefix": {"groups": 6, "per_group": 5, "prefix_tokens": 64,
                                                   "suffix_tokens": 20},
                 "output_tokens": {"type": "lognormal", "mean": 60, "cv": 0.6}, "max_output_tokens": 150},
    "output": {"step_requests": False, "plots": False},
}
CLUSTER_ROUTERS = [{"type": "round_robin"}, {"type": "least_loaded"},
                   {"type": "llm_d", "filters": [{"type": "prefix-cache-affinity"}], "scorers": [{"type": "token-load"}]},
                   {"type": "llm_d", "scorers": [{"type": "queue"}, {"type": "kv-cache-utilization", "weight": 2},
                                                 {"type": "prefix-cache"}]}]


def assert_same_recordings(a_rec, b_rec, label: str = "") -> None:
    """Two runs' trace recorders: the same step and request rows, exactly, the same ITLs and, with a modelled
    front end, the same client time of every step end."""
    import pandas as pd  # noqa: PLC0415

    a, b = a_rec.frames(), b_rec.frames()
    for name in ("steps", "requests"):
        pd.testing.assert_frame_equal(a[name].reset_index(drop=True), b[name].reset_index(drop=True),
                                      check_exact=True, obj=f"{label} {name}".strip())
    assert a_rec.itls() == b_rec.itls()
    assert (a_rec.delivery is None) == (b_rec.delivery is None)
    if a_rec.delivery is not None:
        ends = list(a["steps"]["t_end_s"])
        assert [b_rec.delivery.client_time(t) for t in ends] == [a_rec.delivery.client_time(t) for t in ends]


def assert_same_engine_runs(a_runs, b_runs) -> None:
    """Two cluster runs' engines (label -> run): `assert_same_recordings` of each."""
    assert sorted(a_runs) == sorted(b_runs)
    for label, run in a_runs.items():
        assert_same_recordings(run.recorder, b_runs[label].recorder, label)
