"""An experiment's requests (the same list for every backend), built from its parsed `WorkloadConfig`."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.experiments.config.schema import ExperimentConfig


def build_requests(exp: ExperimentConfig, vocab_size: Optional[int] = None):
    """(requests, arrival process, runtime rng). `vocab_size`: the smallest vocabulary of the backends'
    models; prompts are drawn below it (a workload `vocab_size` must not exceed it)."""
    from servetwin.sim.workload import generate_requests, rng_streams  # noqa: PLC0415

    w = exp.workload
    streams = rng_streams(w.seed)
    if w.scenario is not None:
        return _scenario_requests(w, vocab_size, streams), w.arrival, streams["runtime"]
    if w.prompts is not None:
        return _prompt_requests(exp, vocab_size, streams), w.arrival, streams["runtime"]
    return generate_requests(w.spec, vocab_size=vocab_size), w.arrival, streams["runtime"]


def _scenario_requests(w: Any, vocab_size: Optional[int], streams: dict) -> list:
    from servetwin.sim.workload import WorkloadRequest  # noqa: PLC0415

    chosen = w.scenario.requests[: w.requests] if w.requests else w.scenario.requests
    requests = [WorkloadRequest(r.id, float(r.arrival_time or 0.0), list(r.prompt_token_ids), r.max_tokens,
                                n=r.n, priority=r.priority) for r in chosen]
    if vocab_size is not None:
        top = max((max(r.prompt_token_ids) for r in requests), default=0)
        if top >= vocab_size:
            raise ConfigError("workload.scenario", f"token id {top} is outside the model's vocabulary "
                                                   f"({vocab_size}); use a model with a larger vocabulary")
    arrival = w.scenario_arrival
    if arrival is not None and arrival.closed_loop:
        for r in requests:
            r.arrival_s = 0.0
    elif arrival is not None:
        for r, t in zip(requests, arrival.times(len(requests), streams["arrivals"])):
            r.arrival_s = float(t)
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return requests


def _prompt_requests(exp: ExperimentConfig, vocab_size: Optional[int], streams: dict) -> list:
    """`workload.prompts`: the file's prompts tokenized with the model's tokenizer, timed by the arrival
    process (offline: all at t = 0), in file order."""
    from servetwin.experiments.config.prompt_file import model_tokenizer, tokenize_prompts  # noqa: PLC0415
    from servetwin.sim.workload import WorkloadRequest  # noqa: PLC0415

    w = exp.workload
    ids = tokenize_prompts(w.prompts, model_tokenizer(exp.model))
    top = max(max(p) for p in ids)
    if vocab_size is not None and top >= vocab_size:
        raise ConfigError("workload.prompts", f"token id {top} is outside the model's vocabulary ({vocab_size})")
    requests = [WorkloadRequest(rec.id, 0.0, p, rec.max_tokens) for rec, p in zip(w.prompts, ids)]
    arrival = w.arrival
    if not arrival.closed_loop:
        for r, t in zip(requests, arrival.times(len(requests), streams["arrivals"])):
            r.arrival_s = float(t)
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return requests


def workload_summary(requests: list) -> dict[str, Any]:
    if not requests:
        return {"requests": 0}
    p = np.array([len(r.prompt_token_ids) for r in requests])
    o = np.array([r.eos_at if getattr(r, "eos_at", None) is not None else r.max_tokens for r in requests])
    n = np.array([r.n for r in requests])
    arr = np.array([r.arrival_s for r in requests])
    out = {"requests": len(requests), "sequences": int(n.sum()),
           "prompt_tokens_mean": float(p.mean()), "prompt_tokens_min": int(p.min()),
           "prompt_tokens_max": int(p.max()), "prompt_tokens_total": int(p.sum()),
           "output_tokens_mean": float(o.mean()), "output_tokens_total": int((o * n).sum()),
           "last_arrival_s": float(arr.max())}
    turns = [r.conversation for r in requests if getattr(r, "conversation", None) is not None]
    if turns:  # planned before the run: later turns' arrival times and answers come from the run
        count = len({t.conversation for t in turns})
        out.update(conversations=count, turns_per_conversation_mean=len(turns) / count,
                   turns_max=max(t.turn for t in turns))
        # the last conversation start (a later turn's arrival is set when it is sent)
        out["last_arrival_s"] = float(max(r.arrival_s for r in requests if r.conversation.turn == 1))
    return out


def conversation_summary(reqs: Any) -> Optional[dict[str, Any]]:
    """How much of the conversations' prompts the prefix cache held, first turns vs later turns
    (`reqs`: a run's requests table; None when it has no conversation turns)."""
    turn = reqs.request_id.str.extract(r"conv-\d+-turn-(\d+)$", expand=False) if len(reqs) else None
    if turn is None or turn.isna().all():
        return None
    first, later = reqs[turn == "1"], reqs[turn.notna() & (turn != "1")]

    def share(rows: Any) -> Optional[float]:
        total = int(rows.prompt_tokens.sum())
        return int(rows.cached_tokens.sum()) / total if total else None

    return {"first_turns": int(len(first)), "later_turns": int(len(later)),
            "first_turns_cached_share": share(first), "later_turns_cached_share": share(later)}
