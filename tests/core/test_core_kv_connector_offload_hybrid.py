"""The offloading connector with the hybrid KV cache manager (vLLM 0.33's OffloadingConnector is
`SupportsHMA`): a chunk is one block of one KV cache group, keyed by (block hash, group index); a
sliding-window group stores only the blocks a later lookup can reach and a hit needs its window.
The recorded scenarios tests/core/data/k_fuzz_offload_hybrid_* replay vLLM's own decisions
(tests/core/test_core_replay.py); these tests state the rules on small worked cases."""
from __future__ import annotations

from typing import Optional

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_cache_interface import (
    ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec)
from servetwin.core.kv_connector.base import KVConnectorOutput
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.cpu_tier import LookupResult, make_offload_key
from servetwin.core.kv_connector.factory import create_connector
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.scheduler import Scheduler

BLOCK = 16
HYBRID = (FullAttentionSpec(), SlidingWindowSpec(BLOCK))  # a hit needs cdiv(W - 1, B) = 1 window block
PROMPT = [2000 + i for i in range(64)]  # 4 full blocks; its replay boundary (63) ends in block 3


def _scheduler(retention: Optional[int] = 0, cpu_chunks: int = 32) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    cc = CacheConfig(block_size=BLOCK, num_gpu_blocks=64, enable_prefix_caching=True, kv_cache_groups=HYBRID,
                     prefix_cache_retention_interval=retention)
    kv = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": 4096 * cpu_chunks})
    return Scheduler(sc, cc, kv_transfer_config=kv)


def _step(s: Scheduler, report: Optional[KVConnectorOutput] = None):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    s.update_from_output(so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled,
                                               kv_connector_output=report))
    return so


def _run_prompt(s: Scheduler) -> list[bytes]:
    """Run PROMPT once and complete its stores; its block hashes."""
    a = Request("a", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=0.0)
    s.add_request(a)
    jobs = _step(s).kv_connector_metadata.store_jobs
    _step(s, KVConnectorOutput(completed_jobs={j: 1 for j in jobs}))
    return list(a.block_hashes)


def _held(s: Scheduler, hashes: list[bytes], group: int) -> list[int]:
    """The blocks of `group` the CPU tier holds readable."""
    return [i for i, h in enumerate(hashes)
            if s.connector.manager.lookup(make_offload_key(h, group)) is LookupResult.HIT]


@pytest.mark.parametrize("retention, window_blocks", [
    (0, [2]),  # sparse (0.33's default): the window's tail before the replay boundary 63 // 16 = 3
    (None, [0, 1, 2, 3]),  # dense: every block
    (32, [1, 2, 3]),  # every 2-block segment's last block, and the replay boundary's tail
])
def test_both_groups_are_stored_the_window_only_where_a_lookup_reaches(retention, window_blocks):
    s = _scheduler(retention)
    hashes = _run_prompt(s)
    assert _held(s, hashes, 0) == [0, 1, 2, 3]
    assert _held(s, hashes, 1) == window_blocks


def test_a_hit_needs_the_window_before_its_end_so_a_resend_loads_to_the_replay_boundary():
    s = _scheduler(0)
    _run_prompt(s)
    s.reset_prefix_cache()  # the GPU copy is gone; the CPU tier still holds it
    s.add_request(Request("b", PROMPT + [7, 7], SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=1.0))
    so = _step(s)
    (job_id, load), = so.kv_connector_metadata.load_jobs.items()
    # full-attention blocks 0-2 and the window's block 2: 48 tokens, not 64 (no window block 3 was kept)
    assert load.num_blocks == 4 and s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _step(s, KVConnectorOutput(finished_recving={"b"}, completed_jobs={job_id: 1}))
    so = _step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 48 and so.num_scheduled_tokens == {"b": 18}


def test_without_the_window_block_there_is_no_hit():
    s = _scheduler(0)
    hashes = _run_prompt(s)
    s.reset_prefix_cache()
    # a prompt that shares blocks 0-1 only: its hit would end at 32, where no window block was kept
    s.add_request(Request("c", PROMPT[:32] + [9] * 40, SamplingParams(max_tokens=1, ignore_eos=True),
                          arrival_time=1.0))
    so = _step(s)
    assert _held(s, hashes, 0)[:2] == [0, 1] and not so.kv_connector_metadata.load_jobs
    assert so.num_scheduled_tokens == {"c": 72}


def test_chunked_local_attention_groups_are_refused():
    kv = KVTransferConfig("OffloadingConnector", kv_connector_extra_config={"cpu_bytes_to_use": 4096})
    with pytest.raises(ConfigError) as err:
        create_connector(kv, BLOCK, (FullAttentionSpec(), ChunkedLocalAttentionSpec(64)))
    assert err.value.path == "kv_connector"
