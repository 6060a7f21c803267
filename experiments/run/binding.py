"""What limits a run's answer: GPU compute, KV-cache capacity, the API-server CPU, or the arrival rate.

Named from quantities every run already measures, so `run`, `sweep` and `capacity` can say it:

- open-loop arrivals the server keeps up with (a steady state over the second half of the arrivals:
  neither the requests in the system nor their waits before the engine schedules them still grow,
  `experiments/run/steady_state.py`, and every request completed) with no resource near saturation:
  **the arrival rate**. The throughput then *is* the offered rate: it cannot differ between
  configurations that keep up.
- else the busiest API-server process's CPU share of the run (`frontend.cpu_utilization`) at or
  above `BUSY` with requests waiting longer in the front end than in the engine queue: **the
  API-server CPU** (the modelled front end, docs/frontend_model.md; its coefficients are a first
  estimate, so such an answer is as good as they are).
- else a KV pool at or above `KV_FULL` at its peak, or any preemption: **KV-cache capacity**.
- else **GPU compute** (the engine's steps: the batch the scheduler may form is computed as fast as
  the device does it).

The thresholds are round numbers, stated in the line itself with the measured values, so a reader can
judge a borderline case. `latency` says which part of the mean client TTFT is largest - the front end
(its queue and hops), the engine queue, or the engine's own prefill compute: what an SLO at a load the
server keeps up with is bound by (`servetwin capacity` names it at the capacity).
"""
from __future__ import annotations

import math
from typing import Any, Optional

from servetwin.experiments.run.steady_state import grew_waits, steady_line

BUSY = 0.7  # front-end CPU share of the run from which its queue sets latency (M/G/1: waits grow ~1/(1-u))
KV_FULL = 0.9  # peak KV usage from which admissions wait for blocks

LABELS = {"gpu_compute": "engine compute (the model's steps on its GPU, or CPU)", "kv_capacity": "KV-cache capacity",
          "api_server_cpu": "the API-server CPU (modelled front end)", "arrival_rate": "the arrival rate"}


def offered_rate(exp: Any, requests: Any, routed: bool = False) -> Optional[float]:
    """Requests per second the clients send in an open-loop run (None: offline batch or closed loop).
    `routed`: `requests` are what a cluster's router sent one engine, whose own timing is its offered rate
    (the workload's rate is the whole cluster's)."""
    arrival = exp.workload.arrival
    if getattr(arrival, "closed_loop", False) or len(requests) < 2:
        return None
    rate = getattr(arrival, "rate", None)
    if rate and not routed:
        return float(rate)
    span = float(requests.arrival_s.max() - requests.arrival_s.min())
    return (len(requests) - 1) / span if span > 0 else None  # a trace's own timing; 0: a burst


def binding_resource(s: dict[str, Any], offered: Optional[float], state: Optional[dict[str, Any]]) -> dict[str, Any]:
    """`{"resource": one of LABELS, "line": the reason with its figures}` for one backend's summary;
    `state`: the run's `steady_state` (None: no verdict)."""
    fe = s.get("frontend") or {}
    fe_util = fe.get("cpu_utilization") if fe.get("type") == "api_server" and fe.get("modelled", True) else None
    kv = s.get("kv_peak_usage") or 0.0
    preempt = s.get("preemptions") or 0
    fe_wait = (s.get("frontend_in_s") or {}).get("mean") or 0.0
    q_wait = (s.get("queue_s") or {}).get("mean") or 0.0
    step = s.get("step_duration_s") or {}
    busy = (step["mean"] * step["count"] / s["engine_duration_s"]
            if step.get("mean") is not None and s.get("engine_duration_s") else None)
    unfinished = s.get("requests", 0) - s.get("completed", 0) - s.get("rejected", 0)
    # a batch sent at once always waits longer at its end: growth says something of open-loop traffic only
    growing = offered is not None and state is not None and not state["steady"]
    grew = grew_waits(state) if offered is not None else {}
    stable = state is not None and state["steady"] and not unfinished
    facts = [f"KV peak {_pct(kv)}" + (f", {preempt} preemptions" if preempt else ", no preemption")]
    if fe_util is not None:
        servers = fe.get("api_server_count") or 1
        facts.append(f"{'busiest of ' + str(servers) + ' API servers' if servers > 1 else 'API server'} "
                     f"busy {_pct(fe_util)} of the run")
    facts.append(f"mean wait {_s(fe_wait)} in the front end, {_s(q_wait)} in the engine queue")
    if busy is not None:
        facts.append(f"engine stepping {_pct(busy)} of the time")
    if offered is not None and s.get("request_throughput_s") is not None:
        facts.append(f"offered {offered:.3g} req/s, completed {s['request_throughput_s']:.3g} req/s over the "
                     "whole run, drain included")
    if growing:
        facts.append("not steady: " + steady_line(state))
    saturated_fe = fe_util is not None and (
        grew.get("frontend", 0.0) > grew.get("engine", 0.0) if grew else fe_util >= BUSY and fe_wait >= q_wait)
    if offered is not None and stable and not saturated_fe and kv < KV_FULL and not preempt:
        resource = "arrival_rate"
        why = ("the server keeps up (neither its queue nor its waits grow over the second half of the arrivals), "
               "so throughput equals the offered rate "
               "and cannot differ between configurations that keep up")
    elif saturated_fe:
        resource = "api_server_cpu"
        why = ("requests queue in the front end more and more" if grew else
               f"the front end is busy at least {_pct(BUSY)} and requests wait longer there than in the engine")
    elif kv >= KV_FULL or preempt:
        resource = "kv_capacity"
        why = f"the KV pool reached {_pct(KV_FULL)} or preempted"
    else:
        resource = "gpu_compute"
        why = ("requests queue for the engine's batch slots and its steps set the pace" if growing else
               "no other limit is near saturation: the engine's steps set the pace")
    return {"resource": resource, "line": f"bound by {LABELS[resource]}: {why} ({'; '.join(facts)})",
            "facts": "; ".join(facts), "latency": ttft_parts(s, kv >= KV_FULL or bool(preempt))}


_SATURATED = ("api_server_cpu", "kv_capacity")  # an engine's verdicts that name a full resource
_SEVERITY = ("api_server_cpu", "kv_capacity", "gpu_compute")  # of as many engines: the one named


def cluster_binding(engines: dict[str, dict[str, Any]], unfinished: int,
                    state: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """What limits a cluster's result. `engines`: each engine's summary with its own `binding` (the rule above, on
    what the router sent it); `unfinished`: requests neither completed nor rejected; `state`: the `steady_state`
    of the cluster's requests pooled.
    - the arrival rate when the cluster keeps up - the pooled verdict (an engine's own, on its share of a short
      run, is noisy; with too few requests for one: every engine keeps up) and every request ended - and no
      engine's API-server CPU or KV pool is saturated;
    - else the resource binding the most engines (the more severe of equals: `_SEVERITY`), with the engines and
      the first one's reasons;
    - else (every engine keeps up with its share, the whole does not) engine compute, with the pooled figures."""
    bound = {label: s["binding"] for label, s in engines.items() if s.get("binding")}
    if not bound:
        return None
    by: dict[str, list[str]] = {}
    for label, b in bound.items():
        by.setdefault(b["resource"], []).append(label)

    def at(resource: str) -> str:
        labels = by.get(resource, [])
        return f"{len(labels)} of {len(bound)} engines ({', '.join(labels[:4])}" + \
            (f" and {len(labels) - 4} more)" if len(labels) > 4 else ")")

    keeps_up = not unfinished and (state["steady"] if state is not None else set(by) == {"arrival_rate"})
    limits = {r: labels for r, labels in by.items() if r != "arrival_rate"}
    if keeps_up and not any(r in limits for r in _SATURATED):
        resource = "arrival_rate"
        line = (f"bound by {LABELS[resource]}: the cluster keeps up ("
                + ("its requests in the system and their waits do not grow over the second half of the "
                   "arrivals" if state is not None else f"each of its {len(bound)} engines does")
                + "), so its throughput equals the offered rate and cannot differ between deployments that keep up")
        if "gpu_compute" in by:
            line += (f"; on its own share {at('gpu_compute')} looked still filling (a short share of the run "
                     "is a noisy verdict)")
    elif limits:
        resource = max(limits, key=lambda r: (len(limits[r]), -_SEVERITY.index(r)))
        first = limits[resource][0]
        line = f"bound by {LABELS[resource]} at {at(resource)}"
        others = "; ".join(f"{LABELS[r]} at {len(ls)}" for r, ls in by.items() if r != resource)
        line += (f"; {others}" if others else "") + f". {first}: {bound[first]['line']}"
    else:  # (every engine keeps up with its share, the whole does not, or requests did not end)
        resource = "gpu_compute"
        line = f"bound by {LABELS[resource]}: " + (f"the cluster does not keep up ({steady_line(state)})"
                                                   if state is not None and not state["steady"] else
                                                   f"{unfinished} requests did not end")
    return {"resource": resource, "line": line, "engines": by}  # (the pooled `state`: the summary's steady_state)


def ttft_parts(s: dict[str, Any], kv_bound: bool) -> Optional[dict[str, Any]]:
    """The largest part of the mean client TTFT: front end, engine queue (waiting for KV blocks when
    the pool is full, else for batch slots: compute), or the prefill itself (compute)."""
    fe = (s.get("frontend_in_s") or {}).get("mean") or 0.0
    queue = (s.get("queue_s") or {}).get("mean") or 0.0
    ttft = (s.get("ttft_s") or {}).get("mean")
    if ttft is None:
        return None
    prefill = max(0.0, ttft - fe - queue)  # scheduled -> first token at the client
    parts = {"api_server_cpu": fe, ("kv_capacity" if kv_bound else "gpu_compute"): queue}
    parts["gpu_compute"] = parts.get("gpu_compute", 0.0) + prefill
    top = max(parts, key=parts.get)
    return {"resource": top, "line": f"the mean TTFT ({_s(ttft)}) is mostly {LABELS[top]}: {_s(fe)} in the "
                                     f"front end, {_s(queue)} in the engine queue, {_s(prefill)} prefill and "
                                     "delivery"}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _s(x: float) -> str:
    from servetwin.experiments.common.units import format_seconds  # noqa: PLC0415

    return format_seconds(x)
