"""A recorded run's KV-transfer completions, replayed into the simulator's connector worker.

The simulator's worker (sim/kv_transfer.py) finishes a transfer at a modelled time; a real backend
finishes it when the copy is done (the torch backend's workers copy synchronously, so in the very
step that starts it). To compare the two backends step by step, `TransferRecorder` watches a run's
steps (each step's `kv_connector_metadata` and the `kv_connector_output` its execution reported) and
keeps, for every transfer, how many steps after the one that started it the run reported it done;
`SimKVWorker(..., replay=...)` then finishes each transfer in that step instead of at its modelled
time (as `SpecReplay` replays a run's acceptance, sim/spec_drafter.py).

Transfers are keyed as the scheduler side names them: a NIXL read or send by its request (in the
order they start: a request may be read again after a preemption), an offloading job by its job id
(a load also reports its request in `finished_recving`, as the workers do).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

NEVER = None  # a transfer the recorded run never reported done


@dataclass(slots=True)
class TransferReplay:
    """Steps from start to report (0: the starting step itself; None: never), per transfer:
    `recv` / `send`: request id -> one entry per read / send, in start order; `jobs`: offloading
    job id -> its delay."""
    recv: dict[str, list[Optional[int]]] = field(default_factory=dict)
    send: dict[str, list[Optional[int]]] = field(default_factory=dict)
    jobs: dict[int, Optional[int]] = field(default_factory=dict)

    def delay(self, kind: str, req_id: str, job_id: int, nth: int) -> Optional[int]:
        """The recorded delay of the `nth` (0-based) `kind` transfer of `req_id` (or of job `job_id`);
        a transfer the recording does not hold is a ValueError (the runs diverged)."""
        if kind in ("load", "store"):
            if job_id not in self.jobs:
                raise ValueError(f"transfer replay: job {job_id} ({kind} for {req_id}) was not recorded")
            return self.jobs[job_id]
        recorded = (self.recv if kind == "recv" else self.send).get(req_id, [])
        if nth >= len(recorded):
            raise ValueError(f"transfer replay: {kind} #{nth} of {req_id} was not recorded")
        return recorded[nth]


class TransferRecorder:
    """Builds a `TransferReplay` from a run: call `observe` once per executed step, in order."""

    def __init__(self) -> None:
        self.replay = TransferReplay()
        self.num_steps = 0
        self._pending: dict[tuple[str, Any], tuple[int, int]] = {}  # (kind, key) -> (start step, entry)

    def _start(self, kind: str, key: Any, step: int) -> None:
        if kind == "job":
            self.replay.jobs[key] = NEVER
            self._pending[(kind, key)] = (step, -1)
            return
        entries = (self.replay.recv if kind == "recv" else self.replay.send).setdefault(key, [])
        entries.append(NEVER)
        self._pending[(kind, key)] = (step, len(entries) - 1)

    def _done(self, kind: str, key: Any, step: int) -> None:
        started = self._pending.pop((kind, key), None)
        if started is None:  # e.g. an offloading load's finished_recving (its job is the transfer)
            return
        if kind == "job":
            self.replay.jobs[key] = step - started[0]
        else:
            (self.replay.recv if kind == "recv" else self.replay.send)[key][started[1]] = step - started[0]

    def observe(self, meta: Any, kv_output: Any) -> None:
        """One executed step: the transfers its metadata starts and those its output reports done."""
        step = self.num_steps
        self.num_steps += 1
        if meta is not None:
            for rid, recv in getattr(meta, "reqs_to_recv", {}).items():
                if recv.awaiting_kvs:  # (otherwise only a notice to the remote engine)
                    self._start("recv", rid, step)
            for rid in getattr(meta, "reqs_to_send", ()):
                self._start("send", rid, step)
            for job_id in (*getattr(meta, "load_jobs", ()), *getattr(meta, "store_jobs", ())):
                self._start("job", job_id, step)
        if kv_output is None:
            return
        for rid in kv_output.finished_recving or ():
            self._done("recv", rid, step)
        for rid in kv_output.finished_sending or ():
            self._done("send", rid, step)
        for job_id in kv_output.completed_jobs or {}:
            self._done("job", job_id, step)


__all__ = ["NEVER", "TransferRecorder", "TransferReplay"]
