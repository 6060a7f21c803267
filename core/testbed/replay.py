"""`servetwin replay`: run a scenario through the shared scheduler in lockstep with a fake sampler.

The loop is vLLM 0.33.0's `EngineCore` iteration as the recorded oracle drives it (one iteration =
one step k; `step_with_batch_queue` with a queue of 2 in async mode):

1. client aborts carried over from iteration k-1 (a `during_step` abort of an iteration that processed
   no output), then the requests whose `arrival_step == k` (file order), then `between_steps` aborts
   (`_process_input_queue`);
2. `schedule()`, the launch (fake sampler), and the step's record: `waiting_ids` is the queue right
   after `schedule()`, before any output is processed (what the engine loop sees);
3. `during_step` aborts (`_process_aborts_queue`), then `update_from_output` of step k (sync) or of
   step k-1 (async; none when the queue is not yet full).

An idle step (nothing to run, arrivals pending) still advances the counter. `finished` and
`num_free_blocks` belong to the step whose output was processed.

The fake sampler gives row r of step s the token `(s*7 + r) % 1000 + 10`, unless the request's
`stop_at` names this output position (counted as the tokens already sampled for the request id);
vLLM's min_tokens logits processor masks every stop token (stop ids and EOS, ignored or not) before
`min_tokens` outputs. Whether a token stops is the scheduler's `check_stop`, as in vLLM.
"""
from __future__ import annotations

import json
from collections import deque
from typing import IO, Iterator

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.executor import FakeExecutor
from servetwin.core.engine.parallel_sampling import fan_out
from servetwin.core.request import Request, RequestStatus
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.sched.scheduler import Scheduler, UnservableRequestError
from servetwin.core.testbed.connector_scenario import full_kv_transfer_params, kv_transfer_params_summary
from servetwin.core.testbed.fake_kv_worker import FakeKVWorker
from servetwin.core.testbed.iteration import compute_iteration_details
from servetwin.core.testbed.scenario import Scenario, ScenarioError, ScenarioRequest
from servetwin.core.testbed.spec_worker import FakeSpecWorker


class ScriptedSampler:
    """The `token_fn` of the fake executor: a request's scripted tokens (`stop_at`) and the min_tokens mask."""

    def __init__(self) -> None:
        self.plans: dict[str, dict[int, int]] = {}
        self.min_tokens: dict[str, int] = {}
        self.stop_ids: dict[str, set[int]] = {}  # vLLM's all_stop_token_ids (stop ids + EOS)
        self.produced: dict[str, int] = {}  # tokens already sampled per request id
        self.masked: list[str] = []  # ids whose scripted stop token was masked, this step

    def add(self, req_id: str, plan: dict[int, int], params: SamplingParams) -> None:
        self.plans[req_id] = plan
        self.min_tokens[req_id] = params.min_tokens
        self.stop_ids[req_id] = set(params.all_stop_token_ids)
        self.produced[req_id] = 0

    def __call__(self, req_id: str, base_token: int) -> int:
        i = self.produced[req_id]
        self.produced[req_id] = i + 1
        want = self.plans[req_id].get(i)
        if want is None:
            return base_token
        if i < self.min_tokens[req_id] and want in self.stop_ids[req_id]:
            self.masked.append(req_id)  # MinTokensLogitsProcessor: stop tokens get -inf
            return base_token
        return want


def _make_requests(r: ScenarioRequest, index: int, eos_token_id: int,
                   block_size: int = 16) -> list[tuple[Request, dict]]:
    extra = None
    if r.connector is not None and (r.connector.do_remote_prefill or r.connector.do_remote_decode):
        extra = {"kv_transfer_params": full_kv_transfer_params(r.connector, r.id, len(r.prompt_token_ids),
                                                               block_size)}
    params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, n=r.n,
                            stop_token_ids=list(r.stop_token_ids) or None, min_tokens=r.min_tokens,
                            extra_args=extra)
    params.update_from_generation_config(eos_token_id)  # what vLLM's input processor does
    arrival = r.arrival_time if r.arrival_time is not None else r.arrival_step + index * 1e-6
    return [(Request(cid, r.prompt_token_ids, p, arrival_time=arrival, priority=r.priority,
                     cache_salt=r.cache_salt, parent_id=r.id if r.n > 1 else None), r.stop_at.get(ci, {}))
            for ci, (cid, p) in enumerate(fan_out(r.id, params))]


def _schedule_record(scheduler: Scheduler, so, mro) -> dict:
    stats = scheduler.make_stats()
    cached = so.scheduled_cached_reqs
    resumed = [r for r in cached.req_ids if r in cached.resumed_req_ids]
    pcs = stats.prefix_cache_stats
    return {
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
        "total_scheduled_tokens": so.total_num_scheduled_tokens,
        "new": [n.req_id for n in so.scheduled_new_reqs],
        "new_prefix_hit_tokens": {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs},
        "running": [r for r in cached.req_ids if r not in cached.resumed_req_ids],
        "resumed": resumed,
        "resumed_prefix_hit_tokens": {r: cached.num_computed_tokens[cached.req_ids.index(r)] for r in resumed},
        "preempted": list(so.preempted_order),
        "sampled": {rid: toks[0] for rid, toks in zip(mro.req_ids, mro.sampled_token_ids) if toks},
        "num_free_blocks_after_schedule": stats.num_free_blocks,
        "kv_usage_after_schedule": round(stats.kv_cache_usage, 6),
        "prefix_cache": {"requests": pcs.requests, "queries": pcs.queries, "hits": pcs.hits,
                         "preempted_requests": pcs.preempted_requests,
                         "preempted_queries": pcs.preempted_queries, "preempted_hits": pcs.preempted_hits},
        "prefix_queries": pcs.queries, "prefix_hits": pcs.hits,
        "waiting_ids": [r.request_id for r in scheduler.waiting],
        "annotation": compute_iteration_details(so).annotation,
        **_blocks_per_group(scheduler),
        **_connector_schedule_record(scheduler, stats),
    }


def _spec_schedule_record(so, mro, accepted: dict[str, int]) -> dict:
    """Speculative decoding's per-step fields (the oracle's CONNECTORS contract): drafts scheduled,
    which of them are padding, drafts accepted, and every token a row returned."""
    spec = so.scheduled_spec_decode_tokens
    from_waiting = {n.req_id for n in so.scheduled_new_reqs} | so.scheduled_cached_reqs.resumed_req_ids
    return {"spec_tokens": {rid: len(t) for rid, t in spec.items()},
            "spec_padded": [rid for rid in spec if rid in from_waiting], "accepted": accepted,
            "sampled": {rid: toks for rid, toks in zip(mro.req_ids, mro.sampled_token_ids) if toks}}


def _connector_schedule_record(scheduler: Scheduler, stats) -> dict:
    """The connector contract's per-step fields after `schedule()` (none without a connector)."""
    if scheduler.connector is None:
        return {}
    rec = {"waiting_for_remote_kvs": [rid for rid, q in scheduler.requests.items()
                                      if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS]}
    cpc = stats.connector_prefix_cache_stats
    if cpc is not None:
        rec["connector_prefix_cache"] = {"requests": cpc.requests, "queries": cpc.queries, "hits": cpc.hits}
    return rec


def _blocks_per_group(scheduler: Scheduler) -> dict:
    """The HYBRID contract's `blocks_per_group` (when the scenario names its KV cache groups, uses
    speculative decoding or a connector): non-null blocks each running request holds per group, after
    `schedule()`."""
    if (scheduler.cache_config.kv_cache_groups is None and scheduler.speculative_config is None
            and scheduler.connector is None):
        return {}
    kv = scheduler.kv_cache_manager
    return {"blocks_per_group": {r.request_id: kv.num_blocks_per_group(r.request_id)
                                 for r in scheduler.running}}


def _idle_record(rec: dict, scheduler: Scheduler) -> dict:
    rec.update({"idle": True, "num_scheduled_tokens": {}, "new": [], "resumed": [], "preempted": [],
                "finished": [], "num_free_blocks": scheduler.kv_cache_manager.num_free_blocks,
                "prefix_queries": 0, "prefix_hits": 0, "annotation": "execute_context_0(0)_generation_0(0)"})
    return rec


class _Replay:
    """State of one replay: the scheduler, the batch queue and what the summary reports."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.sampler = ScriptedSampler()
        self.executor = FakeExecutor(token_fn=self.sampler)
        spec, conn = scenario.speculative, scenario.kv_connector
        self.scheduler = Scheduler(scenario.scheduler_config, scenario.cache_config,
                                   speculative_config=spec.config if spec else None,
                                   kv_transfer_config=conn.kv_transfer_config() if conn else None)
        self.scheduler.refuse_unservable = False  # vLLM admits a request its pool can never hold; it waits
        parents = {cid: r for r in scenario.requests for cid in r.child_ids}
        self.spec_worker = FakeSpecWorker(spec, parents, self.sampler) if spec else None
        self.spec_totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.kv_worker = None if conn is None else FakeKVWorker(
            conn, {r.id: r.connector for r in scenario.requests},
            len(self.scheduler.kv_cache_manager.kv_cache_groups))
        self.final_kv_transfer_params: dict[str, dict] = {}
        self.async_sched = scenario.scheduler_config.async_scheduling
        self.records: dict[int, dict] = {}
        self.finish_step: dict[str, int] = {}
        self.finish_reasons: dict[str, str] = {}
        self.stop_reasons: dict[str, object] = {}
        self.aborted_step: dict[str, int] = {}
        self.first_token_step: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}

    def add(self, r: ScenarioRequest, index: int) -> list[str]:
        ids = []
        for req, plan in _make_requests(r, index, self.scenario.eos_token_id, self.scenario.cache_config.block_size):
            try:
                self.scheduler.add_request(req)
            except UnservableRequestError as e:
                raise ScenarioError(f"requests[{index}]", e.message) from None
            self.sampler.add(req.request_id, plan, req.sampling_params)
            ids.append(req.request_id)
        return ids

    def abort(self, step: int, rec: dict, targets: list[list[str]], key: str) -> None:
        """One `finish_requests([id], FINISHED_ABORTED)` per id (vLLM's set() order avoided)."""
        for ids in targets:
            for cid in ids:
                req = self.scheduler.requests.get(cid)
                state = None if req is None else {
                    "status": req.status.name, "num_computed_tokens": req.num_computed_tokens,
                    "num_prompt_tokens": req.num_prompt_tokens, "num_output_tokens": req.num_output_tokens,
                    "num_in_flight_tokens": req.num_in_flight_tokens,
                    "num_output_placeholders": req.num_output_placeholders,
                    "num_preemptions": req.num_preemptions, "is_prefill_chunk": req.is_prefill_chunk}
                if self.scheduler.finish_requests([cid], RequestStatus.FINISHED_ABORTED):
                    rec.setdefault(key, []).append(cid)
                    rec.setdefault("aborted_states", {})[cid] = state
                    self.aborted_step[cid] = step
                else:
                    rec.setdefault("abort_noop", []).append(cid)

    def process(self, pstep: int, so, mro) -> None:
        rec = self.records[pstep]
        fin, reasons = [], {}
        outputs = self.scheduler.update_from_output(so, mro)
        if self.spec_worker is not None:  # vLLM trims the worker's token list in place at a stop
            sampled = rec["sampled"]
            for o in outputs:
                if o.request_id in sampled:
                    sampled[o.request_id] = o.new_token_ids
        for o in outputs:
            if o.kv_transfer_params is not None and self.kv_worker is not None:
                summary = kv_transfer_params_summary(o.kv_transfer_params)
                rec.setdefault("kv_transfer_params", {})[o.request_id] = summary
                self.final_kv_transfer_params[o.request_id] = summary
            if o.new_token_ids:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                self.first_token_step.setdefault(o.request_id, pstep)
            if o.finish_reason is not None:
                reason = str(o.finish_reason)
                fin.append(o.request_id)
                reasons[o.request_id] = self.finish_reasons[o.request_id] = reason
                self.finish_step[o.request_id] = pstep
                if o.stop_reason is not None:
                    rec.setdefault("stop_reasons", {})[o.request_id] = o.stop_reason
                    self.stop_reasons[o.request_id] = o.stop_reason
        rec["finished"] = fin
        rec["finish_reasons"] = reasons
        rec["num_free_blocks"] = rec["num_free_blocks_after_update"] = \
            self.scheduler.kv_cache_manager.num_free_blocks
        rec["num_running_after"], rec["num_waiting_after"] = self.scheduler.get_request_counts()
        if self.kv_worker is not None:
            rec["delayed_free_after_update"] = self.scheduler.delayed_free_blocks()
        if self.spec_worker is not None:
            self._record_spec_update(rec, so)

    def _record_spec_update(self, rec: dict, so) -> None:
        """The update's `SpecDecodingStats` and each verified request's computed tokens after the
        rejection correction."""
        stats = self.scheduler.last_spec_decoding_stats
        if stats is not None:
            rec["spec_decoding"] = stats.to_dict()
            for k in self.spec_totals:
                self.spec_totals[k] += getattr(stats, k)
        if so.scheduled_spec_decode_tokens:
            requests = self.scheduler.requests
            rec["num_computed_tokens_after_update"] = {
                rid: requests[rid].num_computed_tokens for rid in so.scheduled_spec_decode_tokens
                if rid in requests and not requests[rid].is_finished()}

    def ready(self) -> Iterator[dict]:
        """Records complete so far, in step order (a step waits for its output to be processed)."""
        for s in sorted(self.records):
            if "finished" in self.records[s] or self.records[s].get("drain_only"):
                yield self.records.pop(s)
            else:
                break

    def summary(self, num_steps: int) -> dict:
        sc = self.scenario
        every = [cid for r in sc.requests for cid in r.child_ids]
        out = {"type": "summary", "num_steps": num_steps,
               "finish_step": dict(sorted(self.finish_step.items(), key=lambda kv: (kv[1], kv[0]))),
               "first_token_step": dict(sorted(self.first_token_step.items(), key=lambda kv: (kv[1], kv[0]))),
               # never reached (arrival after max_steps) counts as unfinished too
               "unfinished": sorted(set(every) - set(self.finish_step) - set(self.aborted_step)),
               "output_token_ids": {k: self.outputs[k] for k in sorted(self.outputs)},
               "num_free_blocks_end": self.scheduler.kv_cache_manager.num_free_blocks}
        if sc.uses_events:
            out["aborted"] = dict(sorted(self.aborted_step.items(), key=lambda kv: (kv[1], kv[0])))
            out["finish_reasons"] = dict(sorted(self.finish_reasons.items()))
            out["stop_reasons"] = dict(sorted(self.stop_reasons.items()))
        if self.spec_worker is not None:
            out["spec_decoding"] = dict(self.spec_totals)
            out["accepted_tokens"] = dict(sorted(self.spec_worker.accepted_total.items()))
        if self.kv_worker is not None:
            out["kv_transfer_params"] = dict(sorted(self.final_kv_transfer_params.items()))
            out["held_at_end"] = self.scheduler.delayed_free_blocks()
            out["kv_worker_pending"] = self.kv_worker.pending_summary()
        return out

    def connector_step(self, step: int, rec: dict, so, mro) -> None:
        """The fake worker's report for this step rides on its model runner output."""
        rec["connector_meta"] = self.kv_worker.describe_meta(so.kv_connector_metadata)
        out, out_rec = self.kv_worker.output_for_step(step, so.kv_connector_metadata)
        mro.kv_connector_output = out
        if out_rec:
            rec["kv_connector_output"] = out_rec


def _config_line(scenario: Scenario, scheduler: Scheduler) -> dict:
    sc, cc = scenario.scheduler_config, scenario.cache_config
    line = {"type": "config", "settings": {
        "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": sc.max_model_len, "num_gpu_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
        "async_scheduling": sc.async_scheduling}, "num_requests": len(scenario.requests),
        "eos_token_id": scenario.eos_token_id, "num_aborts": len(scenario.aborts)}
    if cc.kv_cache_groups is not None:
        line["effective"] = _hybrid_effective(scheduler)
    if scenario.speculative is not None:
        line.setdefault("effective", {})["speculative"] = _spec_effective(scheduler)
    if scenario.kv_connector is not None:
        line.setdefault("effective", {})["kv_connector"] = _connector_effective(scenario, scheduler)
    return line


def _spec_effective(scheduler: Scheduler) -> dict:
    """What vLLM derives from `speculative` (the oracle's `effective.speculative`)."""
    cfg = scheduler.speculative_config
    hash_lookahead = scheduler.num_hash_lookahead_tokens
    return {"method": cfg.method, "num_spec_tokens": scheduler.num_spec_tokens,
            "num_lookahead_tokens": scheduler.num_lookahead_tokens,
            "num_prefill_lookahead_tokens": cfg.num_prefill_lookahead_tokens,
            "num_hash_lookahead_tokens": hash_lookahead, "use_eagle": cfg.use_eagle,
            # vLLM drops the volatile trailing cached block for eagle unless hashes look ahead
            "use_eagle_block_drop": scheduler.use_eagle_block_drop,
            "draft_slots": 0,  # max_num_new_slots_for_drafting: 0 for ngram, eagle, mtp
            "spec_decode_step_blocks": scheduler.spec_decode_step_blocks}


def _connector_effective(scenario: Scenario, scheduler: Scheduler) -> dict:
    conn, c = scenario.kv_connector, scheduler.connector
    eff = {"class": getattr(type(c), "class_name", type(c).__name__), "role": conn.role,
           "kv_load_failure_policy": conn.kv_load_failure_policy,
           "recompute_kv_load_failures": scheduler.recompute_kv_load_failures,
           "defer_block_free": scheduler.defer_block_free, "requires_kv_delivery": bool(c.requires_kv_delivery)}
    if conn.is_nixl:
        eff.update(kv_lease_duration=c.kv_lease_duration, kv_recompute_threshold=c.kv_recompute_threshold,
                   prefill_backoff=c.prefill_backoff(), recv_delay_steps=conn.recv_delay_steps,
                   send_delay_steps=conn.send_delay_steps, lease_steps=conn.lease_steps)
    else:
        eff.update(cpu_bytes_to_use=conn.cpu_bytes_to_use, eviction_policy=conn.eviction_policy,
                   store_threshold=conn.store_threshold, num_cpu_chunks=c.num_cpu_chunks,
                   manager_class="CPUOffloadingManager", load_delay_steps=conn.load_delay_steps,
                   store_delay_steps=conn.store_delay_steps)
    return eff


def _hybrid_effective(scheduler: Scheduler) -> dict:
    """The HYBRID contract's additions to the config line's `effective`."""
    coord = scheduler.kv_cache_manager.coordinator
    return {
        "kv_cache_groups": [dict(m.kv_cache_spec.to_dict(), manager=type(m).__name__,
                                 max_admission_blocks_per_request=m.max_admission_blocks_per_request)
                            for m in coord.single_type_managers],
        "kv_cache_coordinator": type(coord).__name__,
        "prefix_cache_retention_interval": coord.retention_interval,
        "max_in_flight_tokens": scheduler.scheduler_config.max_in_flight_tokens,
        "cache_hit_alignment_tokens": coord.block_size,
    }


def replay(scenario: Scenario) -> Iterator[dict]:
    """Yield the config line, one line per step, then a summary (the oracle's format)."""
    run = _Replay(scenario)
    scheduler, executor = run.scheduler, run.executor
    queue_size = 2 if run.async_sched else 1
    batch_queue: deque = deque()  # (step, scheduler_output, model_runner_output), newest left
    pending = deque(sorted(enumerate(scenario.requests), key=lambda x: (x[1].arrival_step, x[0])))
    aborts_at: dict[int, list] = {}
    for a in scenario.aborts:
        aborts_at.setdefault(a.step, []).append(a)
    yield _config_line(scenario, scheduler)
    carried: list[list[str]] = []  # during_step aborts of an iteration that processed no output
    step = 0
    while step < scenario.max_steps:
        rec: dict = {"type": "step", "step": step}
        if carried:
            run.abort(step, rec, carried, "aborted")
            carried = []
        arrived: list[str] = []
        while pending and pending[0][1].arrival_step <= step:
            idx, r = pending.popleft()
            arrived.extend(run.add(r, idx))
        rec["arrived"] = arrived
        todo = aborts_at.get(step, [])
        run.abort(step, rec, [a.targets for a in todo if a.phase == "between_steps"], "aborted")
        during = [a.targets for a in todo if a.phase == "during_step"]
        if not scheduler.has_requests() and not batch_queue:
            if during:  # nothing in flight: the same effect as between steps
                run.abort(step, rec, during, "aborted")
            if not pending:
                if len(rec) > 3:  # the step only applied aborts
                    yield _idle_record(rec, scheduler)
                break
            yield _idle_record(rec, scheduler)
            step += 1
            continue
        run.records[step] = rec
        scheduled = False
        if scheduler.has_requests():
            run.sampler.masked = []
            so = scheduler.schedule()
            so.step = step
            if run.spec_worker is not None:
                mro, accepted = run.spec_worker.execute_model(so, scheduler)
            else:
                mro = executor.execute_model(so)
            scheduled = True
            rec.update(_schedule_record(scheduler, so, mro))
            if run.spec_worker is not None:
                rec.update(_spec_schedule_record(so, mro, accepted))
            if run.kv_worker is not None:
                run.connector_step(step, rec, so, mro)
            if run.sampler.masked:
                rec["masked_stop"] = run.sampler.masked
            batch_queue.appendleft((step, so, mro))
            if len(batch_queue) < queue_size and (so.total_num_scheduled_tokens > 0 or scheduler.has_requests()):
                carried.extend(during)  # this iteration processes no output
                step += 1
                continue  # async: don't block on this batch yet
        if batch_queue:
            pstep, pso, pmro = batch_queue.pop()
            run.abort(step, rec, during, "aborted_during_step")
            run.process(pstep, pso, pmro)
            if run.async_sched:
                rec["processed_output_of_step"] = pstep
            elif run.spec_worker is not None and pso.total_num_scheduled_tokens > 0:
                # sync: the drafter proposes after the update, as vLLM's EngineCore.post_step does
                proposed = run.spec_worker.propose(pso, scheduler)
                if proposed:
                    run.records[pstep]["drafts_proposed"] = proposed
        else:
            run.abort(step, rec, during, "aborted")
        if not scheduled:
            rec["drain_only"] = True  # only processed an older batch
        yield from run.ready()
        step += 1
    while batch_queue:
        pstep, pso, pmro = batch_queue.pop()
        run.process(pstep, pso, pmro)
    for s in sorted(run.records):
        yield run.records.pop(s)
    yield run.summary(step)


DEFAULT_MAX_OUTPUT_BYTES = 1 << 30  # a replay's JSONL output (a recorded scenario's is a few MB)


def replay_jsonl(scenario: Scenario, max_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> Iterator[str]:
    """The replay's JSONL lines; a `ConfigError` once they pass `max_bytes` (0: no limit). A scenario with
    `max_steps` around 10^9 and a late arrival writes a line per step: it would fill the disk."""
    total = 0
    for line in replay(scenario):
        text = json.dumps(line) + "\n"
        total += len(text)
        if max_bytes and total > max_bytes:
            raise ConfigError("--max-output-bytes", f"the replay's output passed {max_bytes} bytes (raise the "
                              "limit, or lower settings.max_steps)")
        yield text


def write_replay(scenario: Scenario, out: IO[str], max_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> int:
    n = 0
    for text in replay_jsonl(scenario, max_bytes):
        out.write(text)
        n += 1
    return n


__all__ = ["replay", "replay_jsonl", "write_replay", "ScriptedSampler", "DEFAULT_MAX_OUTPUT_BYTES"]
