"""Whether an open-loop run reached a steady state: its queue and its waits no longer grow.

One diagnostic serves the run report ("the server keeps up" only when it holds, experiments/run/binding.py)
and every capacity probe (a probe that is not steady fails, whatever its percentiles say,
experiments/capacity/capacity.py).

The first half of the arrival window is the *warm-up* (the server starts empty; its batch fills over the
first requests' lifetimes) and is not judged. The second half is split in two quarters, Q3 and Q4, and
compared:

- the requests in the system (arrived and not yet finished at the client, sampled on a regular grid of
  times): a server that does not keep up accumulates them at `offered - served` per second, and a run
  still filling its batch (not yet at its steady level) shows it the same way;
- the wait before the engine schedules a request (the front end's queue plus the engine's), by arrival:
  once the batch is full, the excess waits, and its wait grows linearly.

`growth` is the larger of the two relative growths from Q3 to Q4: the in-system count's
`(N4 - N3) / N3` (`in_system_growth`), and the wait's `(W4 - W3) / (W3 + floor)` with `floor` a few
engine steps (a few steps of wait is no queue). One run is steady when `growth <= STEADY_GROWTH` (the
run report says "keeps up" only then). A capacity probe takes the mean over its n seeds and compares it
with `steady_limit(n)` = STEADY_GROWTH / sqrt(n), the same margin in standard errors: the mean wait
growth decides its steadiness, the in-system growth only whether it needs a longer run. A server in a
steady state shows only noise here (either sign: the in-system count of ShareGPT-like lengths wanders
by +-15% between quarters); one that cannot keep up shows a growth proportional to the run's length,
so a longer run separates the two better (capacity probes are extended for that).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

STEADY_GROWTH = 0.20  # relative growth from Q3 to Q4 above which one run is still growing
FLOOR_STEPS = 5  # a few steps of wait is no queue
GRID = 200  # in-system count samples per quarter
MIN_REQUESTS = 20  # fewer requests per run: no verdict


def steady_limit(runs: int) -> float:
    """The growth limit for the mean over `runs` independent runs (seeds): STEADY_GROWTH / sqrt(runs)."""
    return STEADY_GROWTH / math.sqrt(max(1, runs))


def _quarter_means(values: np.ndarray, times: np.ndarray, mid: float, q34: float) -> tuple[float, float]:
    q3, q4 = values[(times >= mid) & (times < q34)], values[times >= q34]
    q3, q4 = q3[q3 == q3], q4[q4 == q4]  # NaN: not modelled / never scheduled
    return (float(q3.mean()) if q3.size else 0.0, float(q4.mean()) if q4.size else 0.0)


def in_system_counts(arrivals: np.ndarray, finishes: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Requests arrived at or before each time and not finished by it (NaN finish: never finished)."""
    done = np.sort(finishes[finishes == finishes])
    return (np.searchsorted(np.sort(arrivals), times, side="right")
            - np.searchsorted(done, times, side="right")).astype(float)


def steady_state(requests: Any, step_p50_s: Optional[float]) -> Optional[dict[str, Any]]:
    """The second half's growth of one run (`requests.parquet`'s columns); None with too few requests or
    no arrival window (an offline batch sent at once)."""
    if len(requests) < MIN_REQUESTS:
        return None
    arrival = requests["arrival_s"].to_numpy(dtype=float)
    t0, t1 = float(arrival.min()), float(arrival.max())
    if not t1 > t0:
        return None
    mid, q34 = t0 + (t1 - t0) / 2, t0 + 3 * (t1 - t0) / 4
    finish = requests["client_finish_s"].to_numpy(dtype=float, na_value=np.nan) \
        if "client_finish_s" in requests else np.full(len(arrival), np.nan)
    engine_finish = requests["finish_s"].to_numpy(dtype=float, na_value=np.nan)
    finish = np.where(finish == finish, finish, engine_finish)  # no front end modelled: the engine's end
    grid = np.linspace(mid, t1, 2 * GRID)
    n3, n4 = _quarter_means(in_system_counts(arrival, finish, grid), grid, mid, q34)
    waits = {}
    for name, col in (("frontend", "frontend_in_s"), ("engine", "queue_s")):
        waits[name] = _quarter_means(requests[col].to_numpy(dtype=float, na_value=np.nan), arrival, mid, q34)
    w3, w4 = (sum(w[i] for w in waits.values()) for i in (0, 1))
    floor = FLOOR_STEPS * (step_p50_s or 0.0)
    in_system_growth = (n4 - n3) / max(n3, 1.0)
    wait_growth = (w4 - w3) / (w3 + floor) if w3 + floor > 0 else 0.0
    growth = max(in_system_growth, wait_growth)
    return {"window": [mid, t1], "in_system": [n3, n4], "waits_s": {k: list(v) for k, v in waits.items()},
            "in_system_growth": in_system_growth, "wait_growth": wait_growth, "floor_s": floor, "growth": growth,
            "limit": STEADY_GROWTH, "steady": bool(growth <= STEADY_GROWTH)}


def grew_waits(state: Optional[dict[str, Any]]) -> dict[str, float]:
    """Where the waits grew in a run that is not steady: {"frontend" | "engine": late - early} for the
    parts whose wait rose by more than the steady limit allows (empty for a steady run)."""
    if not state or state["steady"]:
        return {}
    out = {}
    for name, (early, late) in state["waits_s"].items():
        if late - early > STEADY_GROWTH * (early + state["floor_s"]):
            out[name] = late - early
    return out


def steady_line(state: Optional[dict[str, Any]]) -> str:
    """`requests in the system 187 -> 242 (+29%), waits 39 ms -> 71 ms (+35%) over the second half`."""
    from servetwin.experiments.common.units import format_seconds  # noqa: PLC0415

    if not state:
        return "no steady-state verdict (too few requests or no arrival window)"
    n3, n4 = state["in_system"]
    w3 = sum(w[0] for w in state["waits_s"].values())
    w4 = sum(w[1] for w in state["waits_s"].values())
    return (f"requests in the system {n3:.0f} -> {n4:.0f} ({100 * state['in_system_growth']:+.0f}%), waits "
            f"{format_seconds(w3)} -> {format_seconds(w4)} ({100 * state['wait_growth']:+.0f}% with a "
            f"{format_seconds(state['floor_s'])} floor) from the third to the last quarter of the arrivals")
