"""`servetwin replay`: run a scenario through the shared scheduler in lockstep with a fake sampler.

Mirrors the loop that recorded `tests/core/data/*.expected.jsonl` (vLLM 0.33.0's own scheduler): before step k add
the requests whose `arrival_step == k` (file order); an idle step (nothing to run, arrivals pending)
still advances the counter; `finished` and `num_free_blocks` belong to the step whose output was
processed (in async mode that happens after the next step was scheduled).
"""
from __future__ import annotations

import json
from collections import deque
from typing import IO, Iterator

from servetwin.core.engine.engine_core import EngineCore
from servetwin.core.engine.executor import FakeExecutor
from servetwin.core.testbed.iteration import compute_iteration_details
from servetwin.core.engine.parallel_sampling import fan_out
from servetwin.core.request import Request
from servetwin.core.sampling_params import SamplingParams
from servetwin.core.testbed.scenario import Scenario


def _make_requests(r, index: int) -> list[Request]:
    params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, n=r.n)
    arrival = r.arrival_time if r.arrival_time is not None else r.arrival_step + index * 1e-6
    return [Request(cid, r.prompt_token_ids, p, arrival_time=arrival, priority=r.priority,
                    cache_salt=r.cache_salt, parent_id=r.id if r.n > 1 else None)
            for cid, p in fan_out(r.id, params)]


def _schedule_record(step: int, arrived: list[str], engine: EngineCore, result) -> dict:
    so, stats, mro = result.scheduled, result.stats, result.model_output
    cached = so.scheduled_cached_reqs
    resumed = [r for r in cached.req_ids if r in cached.resumed_req_ids]
    pcs = stats.prefix_cache_stats
    sampled = {rid: toks[0] for rid, toks in zip(mro.req_ids, mro.sampled_token_ids) if toks}
    return {
        "type": "step", "step": step, "arrived": arrived,
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
        "total_scheduled_tokens": so.total_num_scheduled_tokens,
        "new": [n.req_id for n in so.scheduled_new_reqs],
        "new_prefix_hit_tokens": {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs},
        "running": [r for r in cached.req_ids if r not in cached.resumed_req_ids],
        "resumed": resumed,
        "resumed_prefix_hit_tokens": {r: cached.num_computed_tokens[cached.req_ids.index(r)] for r in resumed},
        "preempted": list(so.preempted_order),
        "sampled": sampled,
        "num_free_blocks_after_schedule": stats.num_free_blocks,
        "kv_usage_after_schedule": round(stats.kv_cache_usage, 6),
        "prefix_cache": {"requests": pcs.requests, "queries": pcs.queries, "hits": pcs.hits,
                         "preempted_requests": pcs.preempted_requests,
                         "preempted_queries": pcs.preempted_queries, "preempted_hits": pcs.preempted_hits},
        "prefix_queries": pcs.queries, "prefix_hits": pcs.hits,
        "waiting_ids": [r.request_id for r in engine.scheduler.waiting],
        "annotation": compute_iteration_details(so).annotation,
    }


def replay(scenario: Scenario) -> Iterator[dict]:
    """Yield the config line, one line per step, then a summary (the oracle's format)."""
    executor = FakeExecutor()
    engine = EngineCore(scenario.scheduler_config, scenario.cache_config, executor)
    scheduler = engine.scheduler
    async_sched = scenario.scheduler_config.async_scheduling
    pending = deque(sorted(enumerate(scenario.requests), key=lambda x: (x[1].arrival_step, x[0])))
    yield {"type": "config", "settings": {
        "max_num_seqs": scenario.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": scenario.scheduler_config.max_num_batched_tokens,
        "max_model_len": scenario.scheduler_config.max_model_len,
        "num_gpu_blocks": scenario.cache_config.num_gpu_blocks,
        "block_size": scenario.cache_config.block_size,
        "async_scheduling": async_sched}, "num_requests": len(scenario.requests)}
    records: dict[int, dict] = {}
    step_of: dict[int, int] = {}  # id(scheduler_output) -> step
    finish_step: dict[str, int] = {}
    first_token_step: dict[str, int] = {}
    outputs_so_far: dict[str, list[int]] = {}

    def process(result) -> None:
        pstep = step_of.pop(id(result.processed))
        rec = records[pstep]
        fin, reasons = [], {}
        for o in result.outputs:
            if o.new_token_ids:
                outputs_so_far.setdefault(o.request_id, []).extend(o.new_token_ids)
                first_token_step.setdefault(o.request_id, pstep)
            if o.finish_reason is not None:
                fin.append(o.request_id)
                reasons[o.request_id] = str(o.finish_reason)
                finish_step[o.request_id] = pstep
        rec["finished"] = fin
        rec["finish_reasons"] = reasons
        rec["num_free_blocks"] = rec["num_free_blocks_after_update"] = scheduler.kv_cache_manager.num_free_blocks
        rec["num_running_after"], rec["num_waiting_after"] = scheduler.get_request_counts()
        return pstep

    step = 0
    while step < scenario.max_steps:
        arrived = []
        while pending and pending[0][1].arrival_step <= step:
            idx, r = pending.popleft()
            for req in _make_requests(r, idx):
                engine.add_request(req)
                arrived.append(req.request_id)
        if not engine.has_work():
            if not pending:
                break
            yield {"type": "step", "step": step, "arrived": arrived, "idle": True,
                   "num_scheduled_tokens": {}, "new": [], "resumed": [], "preempted": [], "finished": [],
                   "num_free_blocks": scheduler.kv_cache_manager.num_free_blocks,
                   "prefix_queries": 0, "prefix_hits": 0,
                   "annotation": "execute_context_0(0)_generation_0(0)"}
            step += 1
            continue
        result = engine.step(step_index=step)
        if result.scheduled is not None:
            records[step] = _schedule_record(step, arrived, engine, result)
            step_of[id(result.scheduled)] = step
        else:
            records[step] = {"type": "step", "step": step, "arrived": arrived, "drain_only": True}
        if result.processed is not None:
            pstep = process(result)
            if async_sched:
                records[step]["processed_output_of_step"] = pstep
        for s in sorted(records):
            if "finished" in records[s] or records[s].get("drain_only"):
                yield records.pop(s)
            else:
                break
        step += 1
    for res in engine.drain():
        process(res)
    for s in sorted(records):
        yield records.pop(s)
    yield {"type": "summary", "num_steps": step,
           "finish_step": dict(sorted(finish_step.items(), key=lambda kv: (kv[1], kv[0]))),
           "first_token_step": dict(sorted(first_token_step.items(), key=lambda kv: (kv[1], kv[0]))),
           "unfinished": sorted(set(scheduler.requests)),
           "output_token_ids": {k: outputs_so_far[k] for k in sorted(outputs_so_far)},
           "num_free_blocks_end": scheduler.kv_cache_manager.num_free_blocks}


def write_replay(scenario: Scenario, out: IO[str]) -> int:
    n = 0
    for line in replay(scenario):
        out.write(json.dumps(line) + "\n")
        n += 1
    return n
