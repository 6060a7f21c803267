"""Hypothesis state machine over random connector mixes: the P/D connector (NixlConnector semantics,
every role, both failure policies, random transfer delays, failures, leases) and the offloading
connector (a CPU tier of random size, LRU or ARC, store threshold, load / store delays), with sync and
async scheduling, shared prefixes and aborts.

Checked after every step:
- no block leak or double free, blocks held for a remote reader included: every block's reference
  count equals its holders (requests, finished ones whose blocks the connector holds, deferred frees);
  free + used = pool;
- a request never runs before the load it waits for (a remote read, a CPU-tier load) is reported;
- num_computed_tokens never exceeds the tokens whose KV exists (prompt + output, and for a request
  still waiting for a read, at most its prompt).
Finally everything drains and every block returns to the pool.
"""
from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.sched.scheduler import Scheduler
from servetwin.core.testbed.connector_scenario import (
    ConnectorSettings, RequestConnectorFields, full_kv_transfer_params)
from servetwin.core.testbed.fake_kv_worker import FakeKVWorker

BLOCK = 16
PREFIX = [5000 + i for i in range(64)]  # a shared prefix: local hits meet remote reads


class ConnectorMachine(RuleBasedStateMachine):
    @initialize(role=st.sampled_from(["kv_consumer", "kv_producer", "kv_both", "offload"]),
                policy=st.sampled_from(["fail", "recompute"]), async_sched=st.booleans(),
                num_blocks=st.integers(12, 40), budget=st.sampled_from([32, 64, 128]),
                recv_delay=st.integers(0, 4), send_delay=st.sampled_from([None, 0, 2]),
                lease=st.sampled_from([None, 3]), caching=st.booleans(), cpu_chunks=st.integers(1, 24),
                eviction=st.sampled_from(["lru", "arc"]), store_threshold=st.sampled_from([0, 2]))
    def setup(self, role, policy, async_sched, num_blocks, budget, recv_delay, send_delay, lease, caching,
              cpu_chunks, eviction, store_threshold):
        if role == "offload":
            self.conn = ConnectorSettings("OffloadingConnector", "kv_both", policy, cpu_bytes_to_use=4096 * cpu_chunks,
                                          eviction_policy=eviction, store_threshold=store_threshold,
                                          load_delay_steps=recv_delay, store_delay_steps=1 + recv_delay % 3)
        else:
            self.conn = ConnectorSettings("NixlConnector", role, policy, recv_delay_steps=recv_delay,
                                          send_delay_steps=send_delay,
                                          lease_steps=lease if send_delay is None else None)
            if self.conn.send_delay_steps is None and self.conn.lease_steps is None:
                self.conn.lease_steps = 2  # someone always reads or the lease expires: the run drains
        sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=512,
                             async_scheduling=async_sched)
        cc = CacheConfig(block_size=BLOCK, num_gpu_blocks=num_blocks, enable_prefix_caching=caching)
        self.s = Scheduler(sc, cc, kv_transfer_config=self.conn.kv_transfer_config())
        self.fields: dict[str, RequestConnectorFields] = {}
        self.worker = FakeKVWorker(self.conn, self.fields, 1)
        self.queue: deque = deque()  # (step, scheduler output, model runner output), newest left
        self.depth = 2 if async_sched else 1
        self.step_no = 0
        self.next_id = 0
        self.awaiting: set[str] = set()
        self.completed: set[int] = set()  # offloading jobs reported done  # requests seen waiting for a load not yet reported

    @rule(data=st.data())
    def add(self, data):
        usable_tokens = (self.s.kv_cache_manager.block_pool.num_gpu_blocks - 1) * BLOCK
        n = data.draw(st.integers(1, max(1, min(120, usable_tokens - 20))))
        max_tokens = data.draw(st.integers(1, 8))
        shared = data.draw(st.booleans())
        prompt = (PREFIX[:n] if shared else []) + [100 + self.next_id * 131 + i for i in range(n)]
        prompt = prompt[:n]
        kinds = ["plain"]
        if self.conn.is_nixl and self.conn.role != "kv_producer":
            kinds.append("prefill")
        if self.conn.is_nixl and self.conn.role != "kv_consumer":
            kinds.append("decode")
        kind = data.draw(st.sampled_from(kinds))
        rid = f"r{self.next_id}"
        self.next_id += 1
        f = RequestConnectorFields(do_remote_prefill=kind == "prefill", do_remote_decode=kind == "decode")
        if kind == "prefill":
            f.recv_delay_steps = data.draw(st.sampled_from([None, 0, 1, 3]))
            f.recv_fail = data.draw(st.sampled_from([None, None, "all", [0], [1]]))
        extra = None if kind == "plain" else {"kv_transfer_params": full_kv_transfer_params(f, rid, n, BLOCK)}
        self.fields[rid] = f
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        self.s.add_request(Request(rid, prompt, params, arrival_time=float(self.step_no)))

    @rule(data=st.data())
    def abort(self, data):
        live = sorted(r for r, q in self.s.requests.items() if not q.is_finished())
        if live:
            self.s.finish_requests(data.draw(st.sampled_from(live)), RequestStatus.FINISHED_ABORTED)

    @rule()
    def step(self):
        s = self.s
        if s.has_requests():
            parked_before = self._parked()
            so = s.schedule()
            for rid in so.num_scheduled_tokens:  # a request runs only after the load it waited for
                assert rid not in self.awaiting, rid
                r = s.requests[rid]
                assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                r = s.requests[rid]
                sampled.append([] if r.is_prefill_chunk else [10 + self.step_no % 100])
            mro = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)
            self.awaiting |= self._parked() - parked_before  # parked by this schedule
            out, _ = self.worker.output_for_step(self.step_no, so.kv_connector_metadata)
            if out is not None and out.completed_jobs:
                # a real worker reports a job once (the scenario worker re-reports a job flushed
                # again while its completion is still in flight under async scheduling)
                out.completed_jobs = {j: c for j, c in out.completed_jobs.items() if j not in self.completed}
                self.completed.update(out.completed_jobs)
            mro.kv_connector_output = out
            if out is not None and out.finished_recving:
                self.awaiting -= out.finished_recving
            self.queue.appendleft((so, mro))
        if self.queue and (len(self.queue) >= self.depth or not s.has_requests()):
            so, mro = self.queue.pop()
            s.update_from_output(so, mro)
        self.step_no += 1

    def _parked(self) -> set[str]:
        return {r for r, q in self.s.requests.items() if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS}

    @invariant()
    def blocks_accounted(self):
        s = getattr(self, "s", None)
        if s is None:
            return
        pool = s.kv_cache_manager.block_pool
        holders: dict[int, int] = {}
        for blocks in s.kv_cache_manager.req_to_blocks.values():
            for b in blocks:
                if not b.is_null:
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for _, blocks in s.deferred_frees:
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == holders.get(b.block_id, 0) >= 0, b  # no leak, no double free
        used = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used + 1 == pool.num_gpu_blocks
        for rid, q in s.requests.items():  # KV exists for at most the known tokens
            assert 0 <= q.num_computed_tokens <= q.num_tokens + q.num_output_placeholders, rid
            if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert q.num_computed_tokens <= q.num_prompt_tokens

    def teardown(self):
        s = getattr(self, "s", None)
        if s is None:
            return
        for _ in range(400):  # drain: every transfer completes or its lease expires
            if not s.has_requests() and not self.queue:
                break
            self.step()
        assert not s.has_requests() and not s.requests
        assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.block_pool.num_gpu_blocks - 1


TestConnectorMachine = ConnectorMachine.TestCase
TestConnectorMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
