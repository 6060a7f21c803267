"""The worker side of a KV connector in a scenario replay: turns each step's connector metadata
into the `KVConnectorOutput` that step's `ModelRunnerOutput` carries (the recording driver's fake
worker; docs/kv_connectors.md). Step numbers are engine steps; "the output of step s" is what
`update_from_output` of step s processes.

- NIXL read of a request in step s's `reqs_to_recv` (admitted in s): reported in `finished_recving`
  in the output of s + d (`kv_recv.delay_steps`, else the connector's `recv_delay_steps`). `fail:
  "all"` reports it in `failed_recving` too and, with one KV cache group, its loaded blocks as
  invalid; `fail: [i, ...]` reports those blocks of the load invalid.
- NIXL send of a request in step s's `reqs_to_send`: `finished_sending` in s + d (`kv_send`, else
  `send_delay_steps`; null: s + `lease_steps`, the expired lease; both null: never).
- Offloading: `jobs_to_flush` and sync loads complete in s; async loads in s + `load_delay_steps`
  (with `finished_recving` of their request); stores in s + `store_delay_steps`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from servetwin.core.kv_connector.base import KVConnectorOutput
from servetwin.core.testbed.connector_scenario import ConnectorSettings, RequestConnectorFields


@dataclass(slots=True)
class _Due:
    recv: list[str] = field(default_factory=list)
    fail: list[str] = field(default_factory=list)
    send: list[str] = field(default_factory=list)
    invalid: set[int] = field(default_factory=set)
    loads_done: list[tuple[int, str]] = field(default_factory=list)


class FakeKVWorker:
    def __init__(self, conn: ConnectorSettings, fields: dict[str, Optional[RequestConnectorFields]],
                 num_kv_cache_groups: int) -> None:
        self.conn = conn
        self.fields = fields
        self.num_kv_cache_groups = num_kv_cache_groups
        self.due: dict[int, _Due] = {}
        self.pending_jobs: dict[int, int] = {}  # offloading job id -> the step that completes it

    def _at(self, step: int) -> _Due:
        return self.due.setdefault(step, _Due())

    def describe_meta(self, meta: Any) -> Optional[dict]:
        """The step's `connector_meta` record."""
        if meta is None:
            return None
        if self.conn.is_nixl:
            return {"reqs_to_recv": list(meta.reqs_to_recv), "reqs_to_send": list(meta.reqs_to_send),
                    "reqs_not_processed": sorted(meta.reqs_not_processed)}
        return {"load_jobs": [[j, job.req_id, job.sync] for j, job in meta.load_jobs.items()],
                "store_jobs": [[j, job.req_id] for j, job in meta.store_jobs.items()],
                "jobs_to_flush": sorted(meta.jobs_to_flush)}

    def _plan_nixl(self, step: int, meta: Any) -> None:
        for rid, recv in meta.reqs_to_recv.items():
            if not recv.awaiting_kvs:  # an abort notice / nothing to read: no completion
                continue
            f = self.fields.get(rid) or RequestConnectorFields()
            at = self._at(step + (self.conn.recv_delay_steps if f.recv_delay_steps is None else f.recv_delay_steps))
            at.recv.append(rid)
            local = list(recv.local_block_ids[0]) if recv.local_block_ids else []
            if f.recv_fail == "all":
                at.fail.append(rid)  # NIXL reports a failed read in both lists
                if self.num_kv_cache_groups == 1:
                    at.invalid.update(local)
            elif isinstance(f.recv_fail, list):
                at.invalid.update(local[i] for i in f.recv_fail if i < len(local))
        for rid in meta.reqs_to_send:
            f = self.fields.get(rid) or RequestConnectorFields()
            d = f.send_delay_steps if f.send_delay_given else self.conn.send_delay_steps
            if d is None:
                d = self.conn.lease_steps  # nobody reads: the lease expires
            if d is not None:
                self._at(step + d).send.append(rid)

    def _plan_offload(self, step: int, meta: Any) -> None:
        flush = set(meta.jobs_to_flush)
        for j in flush:  # waited for before this step's forward pass
            self.pending_jobs[j] = step
        for j, job in meta.load_jobs.items():
            if job.sync:
                self.pending_jobs[j] = step
            else:
                self.pending_jobs[j] = step + self.conn.load_delay_steps
                self._at(step + self.conn.load_delay_steps).loads_done.append((j, job.req_id))
        for j in meta.store_jobs:
            if j not in flush:  # the worker submits a store at the start of the next step
                self.pending_jobs[j] = step + self.conn.store_delay_steps

    def output_for_step(self, step: int, meta: Any) -> tuple[Optional[KVConnectorOutput], Optional[dict]]:
        """(what the step's output carries, its `kv_connector_output` record); (None, None): nothing."""
        if meta is not None:
            (self._plan_nixl if self.conn.is_nixl else self._plan_offload)(step, meta)
        at = self.due.pop(step, None)
        if self.conn.is_nixl:
            if at is None or not (at.recv or at.send or at.invalid):
                return None, None
            out = KVConnectorOutput(finished_sending=set(at.send) or None, finished_recving=set(at.recv) or None,
                                    failed_recving=set(at.fail), invalid_block_ids=set(at.invalid))
            rec = {"finished_recving": sorted(at.recv), "finished_sending": sorted(at.send),
                   "failed_recving": sorted(at.fail), "invalid_block_ids": len(at.invalid)}
            return out, {k: v for k, v in rec.items() if v}
        done = sorted(j for j, due in self.pending_jobs.items() if due <= step)
        if not done:
            return None, None
        for j in done:
            del self.pending_jobs[j]
        recving = sorted({rid for j, rid in (at.loads_done if at else ()) if j in set(done)})
        out = KVConnectorOutput(finished_recving=set(recving) or None, completed_jobs={j: 1 for j in done})
        rec: dict[str, Any] = {"completed_jobs": done}
        if recving:
            rec["finished_recving"] = recving
        return out, rec

    def pending_summary(self) -> dict:
        if self.conn.is_nixl:
            return {str(k): {name: sorted(ids) for name, ids in (("recv", d.recv), ("send", d.send)) if ids}
                    for k, d in sorted(self.due.items())}
        return {"jobs": sorted(self.pending_jobs)}
