"""Build an experiment's requests (the same list for every backend) from its validated workload."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from servetwin.experiments.schema import ConfigError, ExperimentConfig, _rename_message


def _retime(requests: list, arrival: Any, rng: np.random.Generator) -> None:
    if arrival.closed_loop:
        for r in requests:
            r.arrival_s = 0.0
        return
    times = arrival.times(len(requests), rng)
    for r, t in zip(requests, times):
        r.arrival_s = float(t)


def build_requests(exp: ExperimentConfig, vocab_size: Optional[int] = None):
    """(requests, arrival process, runtime rng). `vocab_size`: the smallest vocabulary of the backends'
    models; prompts are drawn below it (a workload `vocab_size` must not exceed it)."""
    from servetwin.core.testbed.scenario import load_scenario  # noqa: PLC0415
    from servetwin.sim.arrivals import Offline, parse_arrival  # noqa: PLC0415
    from servetwin.sim.workload import WorkloadRequest, WorkloadSpec, generate_requests, rng_streams  # noqa: PLC0415

    w = exp.workload
    seed = int(w.get("seed", exp.seed))
    streams = rng_streams(seed)
    user_arrival = parse_arrival(w["arrival"], "workload.arrival") if w.get("arrival") is not None else None
    if vocab_size is not None and w.get("vocab_size") is not None and w["vocab_size"] > vocab_size:
        raise ConfigError(f"workload.vocab_size: {w['vocab_size']} exceeds the model's vocabulary ({vocab_size})")
    if "scenario" in w:
        sc = load_scenario(w["scenario"])
        chosen = sc.requests[: w["requests"]] if w.get("requests") else sc.requests
        requests = [WorkloadRequest(r.id, float(r.arrival_time or 0.0), list(r.prompt_token_ids), r.max_tokens,
                                    n=r.n, priority=r.priority) for r in chosen]
        if vocab_size is not None:
            top = max((max(r.prompt_token_ids) for r in requests), default=0)
            if top >= vocab_size:
                raise ConfigError(f"workload.scenario: token id {top} is outside the model's vocabulary "
                                  f"({vocab_size}); use a model with a larger vocabulary")
        arrival = user_arrival or Offline()
        if user_arrival is not None:
            _retime(requests, arrival, streams["arrivals"])
        requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
        return requests, arrival, streams["runtime"]
    try:
        spec = WorkloadSpec.from_dict(exp.sim_workload(), "workload", vocab_size=vocab_size)
        requests = generate_requests(spec)
    except ValueError as e:
        raise ConfigError(_rename_message(str(e))) from None
    arrival = spec.arrival
    if "file" in w and user_arrival is not None:
        arrival = user_arrival
        _retime(requests, arrival, streams["arrivals"])
    return requests, arrival, streams["runtime"]


def workload_summary(requests: list) -> dict[str, Any]:
    if not requests:
        return {"requests": 0}
    p = np.array([len(r.prompt_token_ids) for r in requests])
    o = np.array([r.eos_at if getattr(r, "eos_at", None) is not None else r.max_tokens for r in requests])
    n = np.array([r.n for r in requests])
    arr = np.array([r.arrival_s for r in requests])
    return {"requests": len(requests), "sequences": int(n.sum()),
            "prompt_tokens_mean": float(p.mean()), "prompt_tokens_min": int(p.min()),
            "prompt_tokens_max": int(p.max()), "prompt_tokens_total": int(p.sum()),
            "output_tokens_mean": float(o.mean()), "output_tokens_total": int((o * n).sum()),
            "last_arrival_s": float(arr.max())}
