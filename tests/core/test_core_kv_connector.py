"""KV connectors in the shared scheduler: the plugin entry point, the connector API's call sequence,
and the P/D connector's states (decode-side wait, producer delayed free, aborts, load failures)."""
from __future__ import annotations

from typing import Optional

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_connector.base import KVConnectorBase, KVConnectorOutput
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.kv_connector.factory import connector_class, create_connector
from servetwin.core.kv_connector.nixl import NixlConnector
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.scheduler import Scheduler
from servetwin.core.sched.spec_decode import SpeculativeConfig

BLOCK = 16


class TinyRemoteConnector(KVConnectorBase):
    """A user's connector: the first lookup of a request asks again later, the second offers the
    whole prompt as an asynchronous load; it records every call the scheduler makes."""

    def __init__(self, config, block_size, kv_cache_groups=None):
        super().__init__(config, block_size, kv_cache_groups)
        self.asked: dict[str, int] = {}
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = self.asked[request.request_id] = self.asked.get(request.request_id, 0) + 1
        self.calls.append(("match", request.request_id, num_computed_tokens))
        if n == 1:
            return None, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens, sum(len(g) for g in blocks)))

    def build_connector_meta(self, scheduler_output):
        return {"step": scheduler_output.scheduler_step}

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id))
        return False, {"done": True}


class NotAConnector:
    pass


def _scheduler(kv_transfer_config: Optional[KVTransferConfig], num_blocks: int = 64,
               async_scheduling: bool = False) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                         async_scheduling=async_scheduling)
    cc = CacheConfig(block_size=BLOCK, num_gpu_blocks=num_blocks, enable_prefix_caching=True)
    return Scheduler(sc, cc, kv_transfer_config=kv_transfer_config)


def _request(rid: str, n: int, max_tokens: int = 3, params: Optional[dict] = None) -> Request:
    extra = {"kv_transfer_params": params} if params else None
    return Request(rid, [1000 + (hash(rid) + i) % 20000 for i in range(n)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra), arrival_time=0.0)


def _step(s: Scheduler, report: Optional[KVConnectorOutput] = None, token: int = 7):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[token] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    mro = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, kv_connector_output=report)
    return so, s.update_from_output(so, mro)


def _remote_prefill() -> dict:
    return {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "p",
            "remote_request_id": "p-1", "remote_host": "h", "remote_port": 1, "tp_size": 1}


# -- the plugin entry point -------------------------------------------------------------------------
def test_plugin_by_module_path_and_by_module_colon_class():
    by_path = KVTransferConfig("TinyRemoteConnector", kv_connector_module_path=__name__)
    by_name = KVTransferConfig(f"{__name__}:TinyRemoteConnector")
    assert connector_class(by_path) is TinyRemoteConnector
    assert connector_class(by_name) is TinyRemoteConnector
    assert isinstance(create_connector(by_name, BLOCK), TinyRemoteConnector)


@pytest.mark.parametrize("config, field", [
    (KVTransferConfig("NoSuchConnector"), "kv_connector"),
    (KVTransferConfig("Missing", kv_connector_module_path=__name__), "kv_connector_module_path"),
    (KVTransferConfig("X", kv_connector_module_path="no_such_module_xyz"), "kv_connector_module_path"),
    (KVTransferConfig(f"{__name__}:NotAConnector"), "kv_connector"),
])
def test_plugin_errors_name_the_field(config, field):
    with pytest.raises(ConfigError) as info:
        connector_class(config)
    assert info.value.path == field


def test_transfer_config_rejects_bad_role_and_policy():
    with pytest.raises(ConfigError, match="kv_role"):
        KVTransferConfig("NixlConnector", kv_role="both")
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        KVTransferConfig("NixlConnector", kv_load_failure_policy="retry")


def test_custom_connector_ask_again_later_then_async_load():
    s = _scheduler(KVTransferConfig(f"{__name__}:TinyRemoteConnector"))
    conn = s.connector
    s.add_request(_request("a", 40))
    so, _ = _step(s)  # "ask again later": skipped, nothing allocated
    assert so.total_num_scheduled_tokens == 0 and s.kv_cache_manager.num_free_blocks == 63
    assert so.kv_connector_metadata == {"step": 0}
    so, _ = _step(s)  # admitted as an async load of the whole prompt: parked, holding 3 blocks
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert so.total_num_scheduled_tokens == 0 and s.kv_cache_manager.num_free_blocks == 60
    assert s.get_request_counts() == (0, 1)  # counted as waiting (kv_holding_waiting)
    _step(s)  # not reported yet: stays parked
    assert s.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _step(s, KVConnectorOutput(finished_recving={"a"}))
    so, outs = _step(s)  # the whole prompt loaded: only the last token is recomputed
    assert so.num_scheduled_tokens == {"a": 1} and so.scheduled_new_reqs[0].num_computed_tokens == 39
    assert outs[0].new_token_ids == [7]
    assert conn.calls[:3] == [("match", "a", 0), ("match", "a", 0), ("alloc", "a", 40, 3)]
    finished = []
    while s.has_requests():
        finished += [o for o in _step(s)[1] if o.finish_reason is not None]
    assert finished[0].kv_transfer_params == {"done": True} and ("finished", "a") in conn.calls
    assert s.kv_cache_manager.num_free_blocks == 63


# -- the P/D connector ----------------------------------------------------------------------------
def test_producer_keeps_blocks_until_finished_sending():
    s = _scheduler(KVTransferConfig("NixlConnector", "kv_producer"))
    s.add_request(_request("p", 40, max_tokens=1, params={"do_remote_decode": True}))
    _, outs = _step(s)
    assert outs[0].finish_reason is not None
    params = outs[0].kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == 40
    assert params["remote_block_ids"] == [[b for b in params["remote_block_ids"][0]]] and len(params["remote_block_ids"][0]) == 3
    assert s.delayed_free_blocks() == {"p": 3} and s.has_requests()
    so, _ = _step(s)
    assert list(so.kv_connector_metadata.reqs_to_send) == ["p"]
    _step(s, KVConnectorOutput(finished_sending={"p"}))
    assert s.delayed_free_blocks() == {} and not s.has_requests()
    assert s.kv_cache_manager.num_free_blocks == 63


def test_aborted_producer_request_frees_at_once():
    s = _scheduler(KVTransferConfig("NixlConnector", "kv_producer"))
    s.add_request(_request("p", 40, max_tokens=5, params={"do_remote_decode": True}))
    _step(s)
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert s.delayed_free_blocks() == {} and s.kv_cache_manager.num_free_blocks == 63
    so, _ = _step(s)
    assert so.kv_connector_metadata.reqs_not_processed == {"p"}


def test_consumer_abort_while_waiting_frees_when_the_read_is_reported():
    s = _scheduler(KVTransferConfig("NixlConnector", "kv_consumer"))
    s.add_request(_request("d", 40, params=_remote_prefill()))
    so, _ = _step(s)
    assert list(so.kv_connector_metadata.reqs_to_recv) == ["d"]
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert s.get_request_counts() == (0, 0) and s.delayed_free_blocks() == {"d": 3}
    _step(s, KVConnectorOutput(finished_recving={"d"}))
    assert s.delayed_free_blocks() == {} and s.kv_cache_manager.num_free_blocks == 63


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_read(policy):
    s = _scheduler(KVTransferConfig("NixlConnector", "kv_consumer", kv_load_failure_policy=policy))
    s.add_request(_request("d", 40, params=_remote_prefill()))
    _step(s)
    _, outs = _step(s, KVConnectorOutput(finished_recving={"d"}, failed_recving={"d"}))
    if policy == "fail":
        assert [(o.request_id, str(o.finish_reason)) for o in outs] == [("d", "error")]
        assert "d" not in s.requests and s.kv_cache_manager.num_free_blocks == 63
    else:  # prefilled locally from scratch
        so, _ = _step(s)
        assert so.num_scheduled_tokens == {"d": 40} and so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_remote_admission_is_all_or_nothing_and_blocks_the_queue():
    s = _scheduler(KVTransferConfig("NixlConnector", "kv_consumer"), num_blocks=9)  # 8 usable
    s.add_request(_request("run", 60, max_tokens=20))
    _step(s)  # running, 4 blocks held
    s.add_request(_request("big", 70, params=_remote_prefill()))  # needs 5 blocks at once
    s.add_request(_request("small", 10))
    so, _ = _step(s)
    assert so.num_scheduled_tokens == {"run": 1}  # "small" would fit but waits behind "big"
    assert s.requests["big"].status == RequestStatus.WAITING and s.get_request_counts() == (1, 2)


def test_nixl_is_the_registered_name():
    assert connector_class(KVTransferConfig("NixlConnector")) is NixlConnector


# -- the scenario contract's connector keys: what the recording driver rejects, rejected here ------
def _scenario(conn=None, **request_keys) -> dict:
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_gpu_blocks": 64, "block_size": 16}
    if conn is not None:
        settings["kv_connector"] = conn
    return {"settings": settings,
            "requests": [dict({"id": "r0", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}, **request_keys)]}


CONSUMER = {"name": "NixlConnector", "role": "kv_consumer"}
PRODUCER = {"name": "NixlConnector", "role": "kv_producer"}


@pytest.mark.parametrize("scenario, field", [
    (_scenario({"name": "LMCacheConnector"}), "settings.kv_connector"),
    (_scenario({"name": "NixlConnector"}), "settings.kv_connector.role"),
    (_scenario(dict(CONSUMER, bogus=1)), "settings.kv_connector.bogus"),
    (_scenario(dict(CONSUMER, recv_delay_steps=-1)), "settings.kv_connector.recv_delay_steps"),
    (_scenario(dict(CONSUMER, lease_steps=0)), "settings.kv_connector.lease_steps"),
    (_scenario(dict(CONSUMER, kv_load_failure_policy="retry")), "settings.kv_connector.kv_load_failure_policy"),
    (_scenario({"name": "OffloadingConnector"}), "settings.kv_connector.cpu_bytes_to_use"),
    (_scenario({"name": "OffloadingConnector", "cpu_bytes_to_use": 4096, "eviction_policy": "mru"}),
     "settings.kv_connector.eviction_policy"),
    (_scenario({"name": "OffloadingConnector", "cpu_bytes_to_use": 4096, "store_delay_steps": 0}),
     "settings.kv_connector.store_delay_steps"),
    (_scenario({"name": "OffloadingConnector", "cpu_bytes_to_use": 4096, "role": "kv_both"}),
     "settings.kv_connector.role"),
    (_scenario(kv_transfer_params={"do_remote_prefill": True}), "requests[0].kv_transfer_params"),
    (_scenario(CONSUMER, kv_transfer_params={}), "requests[0].kv_transfer_params"),
    (_scenario(CONSUMER, kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": True}),
     "requests[0].kv_transfer_params"),
    (_scenario(CONSUMER, kv_transfer_params={"do_remote_decode": True}), "requests[0].kv_transfer_params"),
    (_scenario(PRODUCER, kv_transfer_params={"do_remote_prefill": True}), "requests[0].kv_transfer_params"),
    (_scenario(CONSUMER, kv_transfer_params={"do_remote_prefill": True}, n=2), "requests[0].kv_transfer_params"),
    (_scenario(CONSUMER, kv_recv={"delay_steps": 1}), "requests[0].kv_recv"),
    (_scenario(CONSUMER, kv_transfer_params={"do_remote_prefill": True}, kv_recv={"fail": "some"}),
     "requests[0].kv_recv.fail"),
    (_scenario(PRODUCER, kv_transfer_params={"do_remote_decode": True}, kv_send={"delay_steps": -2}),
     "requests[0].kv_send.delay_steps"),
    (_scenario(PRODUCER, kv_send={"delay_steps": None}), "requests[0].kv_send"),
])
def test_connector_scenario_errors_name_the_field(scenario, field):
    from servetwin.core.testbed.scenario import ScenarioError, parse_scenario
    with pytest.raises(ScenarioError) as info:
        parse_scenario(scenario)
    assert info.value.path == field, str(info.value)


def test_connector_scenario_reads_the_overrides():
    from servetwin.core.testbed.scenario import parse_scenario
    sc = parse_scenario(_scenario(dict(PRODUCER, send_delay_steps=2, lease_steps=5),
                                  kv_transfer_params={"do_remote_decode": True}, kv_send={"delay_steps": None}))
    assert sc.kv_connector.send_delay_steps == 2 and sc.kv_connector.lease_steps == 5
    f = sc.requests[0].connector
    assert f.do_remote_decode and f.send_delay_given and f.send_delay_steps is None


# -- the offloading connector ---------------------------------------------------------------------
def _offloading(cpu_chunks: int, policy: str = "lru", **extra) -> KVTransferConfig:
    return KVTransferConfig("OffloadingConnector", kv_connector_extra_config=dict(
        cpu_bytes_to_use=4096 * cpu_chunks, eviction_policy=policy, **extra))


def test_offloading_cpu_tier_size_is_page_aligned_chunks():
    assert create_connector(_offloading(15), BLOCK).num_cpu_chunks == 15
    assert create_connector(_offloading(15, kv_bytes_per_block=5000), BLOCK).num_cpu_chunks == 7  # 8192 B/chunk


def test_offloading_stores_then_a_later_request_loads_from_the_cpu_tier():
    s = _scheduler(_offloading(8), num_blocks=64)
    prompt = [2000 + i for i in range(64)]
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=0.0))
    so, _ = _step(s)
    stores = so.kv_connector_metadata.store_jobs
    assert [j.req_id for j in stores.values()] == ["a"]  # the 4 full prompt blocks, one job
    _step(s, KVConnectorOutput(completed_jobs={j: 1 for j in stores}))
    s.reset_prefix_cache()  # the GPU copy is gone; the CPU tier still holds it
    s.add_request(Request("b", prompt + [7, 7], SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=1.0))
    so, _ = _step(s)
    loads = so.kv_connector_metadata.load_jobs
    assert [j.req_id for j in loads.values()] == ["b"] and s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _step(s, KVConnectorOutput(finished_recving={"b"}, completed_jobs={j: 1 for j in loads}))
    so, _ = _step(s)
    assert so.num_scheduled_tokens == {"b": 2} and so.scheduled_new_reqs[0].num_computed_tokens == 64


def test_offloading_rejects_a_job_reported_twice():
    from servetwin.core.kv_connector.base import KVConnectorOutputError
    conn = create_connector(_offloading(4), BLOCK)
    with pytest.raises(KVConnectorOutputError, match="job 3"):
        conn.update_connector_output(KVConnectorOutput(completed_jobs={3: 1}))


# -- with speculative decoding ----------------------------------------------------------------------
def _spec_scheduler(method: str, connector: bool, num_blocks: int = 64) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    cc = CacheConfig(block_size=BLOCK, num_gpu_blocks=num_blocks, enable_prefix_caching=True)
    return Scheduler(sc, cc, speculative_config=SpeculativeConfig(3, method),
                     kv_transfer_config=KVTransferConfig("NixlConnector", kv_role="kv_consumer") if connector else None)


def _cached_hit(s: Scheduler) -> int:
    """Prefill and finish a 3-block prompt, then the prefix-cache hit of the same prompt + 1 token."""
    prompt = [1000 + i for i in range(3 * BLOCK)]
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=0.0))
    _step(s)
    _, hit = s.kv_cache_manager.get_computed_blocks(
        Request("b", prompt + [7], SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=1.0,
                block_hasher=s.block_hasher))
    return hit


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_a_connector_keeps_legacy_hashes_so_eagle_drops_the_last_hit_block(method):
    """vLLM 0.33: no lookahead block hashes with a KV connector (config/vllm.py:677-693), so an eagle /
    mtp hit gives back its last block; without a connector the hashes look ahead and nothing drops."""
    with_conn = _spec_scheduler(method, connector=True)
    assert (with_conn.num_hash_lookahead_tokens, with_conn.use_eagle_block_drop) == (0, True)
    assert _cached_hit(with_conn) == 2 * BLOCK
    alone = _spec_scheduler(method, connector=False)
    assert (alone.num_hash_lookahead_tokens, alone.use_eagle_block_drop) == (1, False)
    assert _cached_hit(alone) == 3 * BLOCK
    ngram = _spec_scheduler("ngram", connector=True)
    assert not ngram.use_eagle_block_drop and _cached_hit(ngram) == 3 * BLOCK


@pytest.mark.parametrize("num_blocks, admitted", [(12, True), (11, False)])
def test_an_async_load_reserves_a_spec_step_and_in_flight_prefills_count_theirs(num_blocks, admitted):
    """An async load must leave free what the in-flight prefills still need (each with one verify
    step, 1 + k + lookahead tokens, past its sequence) plus one spec-decode step of its own
    (sched:1421-1430, :3404-3420). Here: a 5-block prompt prefilled 32 tokens at a time holds 3 blocks
    (2 + eagle's lookahead slots) and reserves cdiv(80 + 7, 16) - 3 = 3 more; the 4-block load then
    needs 4 + 3 + 1 blocks of the 8 or 7 left (pool minus the null block and local's 3)."""
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                         long_prefill_token_threshold=2 * BLOCK)
    cc = CacheConfig(block_size=BLOCK, num_gpu_blocks=num_blocks, enable_prefix_caching=True)
    s = Scheduler(sc, cc, speculative_config=SpeculativeConfig(3, "eagle"),
                  kv_transfer_config=KVTransferConfig("NixlConnector", kv_role="kv_consumer"))
    assert s.spec_decode_step_blocks == 1  # cdiv(1 + 3 + 3, 16)
    s.add_request(_request("local", 5 * BLOCK, max_tokens=1))
    s.add_request(_request("remote", 4 * BLOCK, params=_remote_prefill()))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"local": 2 * BLOCK}
    assert s.kv_cache_manager.num_blocks_per_group("local") == [3]
    waiting_for_kv = s.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert waiting_for_kv == admitted
