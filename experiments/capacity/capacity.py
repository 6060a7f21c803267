"""Capacity under SLOs: the highest load whose runs meet the SLOs with a stated confidence across seeds.

The method (docs/capacity.md):

- A *probe* runs the experiment at one load (arrival rate, or closed-loop clients) once per seed; the
  seeds are independent workload draws, and seed s is the same draw at every load (common random
  numbers: a Poisson stream at twice the rate is the same stream at half the gaps), so the curves
  of one seed are smooth in the load.
- A probe *passes* when every SLO check holds at the confidence `c` across the seeds: for a target
  (e.g. p99 TTFT <= 0.5 s) the one-sided Student-t upper `c` bound on the mean over seeds of the
  per-run statistic is within the limit; for the attainment check the lower bound of the mean
  attainment is at least the required share. A run that fails (an error) fails its probe.
- The search brackets the capacity from the config's own load by doubling (or halving) until one
  probe passes and a higher one fails, then narrows the bracket by k-section: k loads evenly inside
  (k = 1 is bisection; with more workers than seeds, k grows so that all workers are busy) until
  `hi - lo <= rel_tol * lo` (for clients: `hi - lo <= 1`). A pass above a failure (noise) never
  widens the answer: the bracket is [highest pass below the lowest failure, lowest failure].
- A probe must also be *steady* (experiments/run/steady_state.py): over the second half of its
  arrivals (the first half is its warm-up) the waits before the engine schedules a request may not
  still grow - the mean over seeds of the runs' wait growth within `steady_limit(seeds)`; one whose
  waits grow fails, whatever its percentiles say (a server that cannot keep up grows a queue in
  proportion to the run's length, so a short probe must not pass it). A probe whose SLO checks pass
  but which has not *settled* (its waits, or the requests in the system - a batch still filling -
  growing by more than half that limit) is *extended*: run again at twice the requests,
  up to `max_extend` doublings; the longest run decides. When the bracket is narrow, its lower end is
  *confirmed*: run again at the full extension if it passed shorter; failing there, it becomes the
  bracket's upper end and the search goes on below it.
- The capacity is the bracket's lower end (it passed at confidence c); the interval is the bracket.
  Each seed also gets its own crossing (its own highest passing load, interpolated linearly in its
  worst check's value/limit ratio between neighbouring probes, its wait growth counting as a check);
  their mean and 95% t interval say how much one seed's answer would vary; for seeds that meet the SLO at every probe so far, up to
  MAX_TAIL_PROBES probes go 25% higher each after the bracket is narrow. The binding SLO is the worst
  check at the lowest failing probe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from servetwin.experiments.config.slo import miss_ratio
from servetwin.experiments.common.stats import mean_bound, mean_ci
from servetwin.experiments.run.steady_state import STEADY_GROWTH, steady_limit

STEADY_CHECK = "steady_state"  # the probe's steadiness, beside its SLO checks in `Probe.ratios`
MAX_BRACKET_STEPS = 12  # doublings / halvings before giving up (a factor of 4096 either way)
MAX_EXTEND = 3  # doublings of a probe's requests while it is not steady (8x at most)
MAX_TAIL_PROBES = 3  # probes above the bracket for seeds that never missed (their own crossings)
TAIL_FACTOR = 1.25


def _ratio(check: dict[str, Any]) -> float:
    r = check.get("ratio")
    return math.inf if r is None else float(r)


def gated_checks(evaluation: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pass/fail checks of one run's SLO evaluation (`servetwin.experiments.config.slo.evaluate_slo`)."""
    return [c for c in (evaluation or {}).get("checks", []) if c.get("met") is not None]


def run_ratio(evaluation: Optional[dict[str, Any]]) -> float:
    """A run's worst value/limit ratio (> 1: it misses the SLO, or its waits still grow over its second
    half); inf for a run that produced nothing. The in-system count's growth is left out here: one
    run's is too noisy to place a crossing (the probe judges its mean over seeds)."""
    checks = gated_checks(evaluation)
    worst = max((_ratio(c) for c in checks), default=math.inf)
    state = (evaluation or {}).get("steady_state")
    return max(worst, state["wait_growth"] / STEADY_GROWTH) if state and checks else worst


def steady_growth(evaluations: list[Optional[dict[str, Any]]]) -> Optional[dict[str, float]]:
    """The mean over seeds of each run's queue and wait growth over its second half, and the limit for
    that mean (`steady_limit`; None: no verdict). A steady server's growths are noise of either sign;
    their mean above the limit: still growing."""
    states = [ev["steady_state"] for ev in evaluations if ev and ev.get("steady_state")]
    if not states:
        return None
    out = {k: sum(st[k] for st in states) / len(states) for k in ("in_system_growth", "wait_growth")}
    return dict(out, limit=steady_limit(len(states)))


@dataclass(slots=True)
class Probe:
    load: float
    evaluations: list[Optional[dict[str, Any]]]  # per seed: the run's SLO evaluation (None: it failed)
    passed: bool
    bounds: dict[str, Optional[float]]  # check -> the confidence bound over seeds
    ratios: dict[str, float]  # check -> bound / limit (attainment: slo.miss_ratio of the bound); > 1 fails
    worst: Optional[str]
    errors: list[str] = field(default_factory=list)
    growth: Optional[dict[str, float]] = None  # steady_growth: mean queue / wait growth over seeds
    requests: Optional[int] = None  # the probe's length (after any extension)
    extended: int = 0  # how many times this load was run again at twice the requests

    @property
    def steady(self) -> Optional[bool]:
        """The waits no longer grow: the mean wait growth over seeds within its limit. (The in-system
        count wanders for minutes near the capacity - +-15% between quarters at 10,000 ShareGPT-like
        requests - so its growth asks for a longer probe, `settled`, but does not fail one.)"""
        return None if self.growth is None else self.growth["wait_growth"] <= self.growth["limit"]

    @property
    def settled(self) -> Optional[bool]:
        """No longer probe needed: the waits and the in-system count each within half the limit (a count
        still climbing is a batch still filling: its queue comes later)."""
        if self.growth is None:
            return None
        return max(self.growth["wait_growth"], self.growth["in_system_growth"]) <= self.growth["limit"] / 2

    @property
    def slo_passed(self) -> bool:
        """Every SLO check holds (the steady-state check aside)."""
        return all(r <= 1.0 for name, r in self.ratios.items() if name != STEADY_CHECK) and bool(self.ratios) \
            and not any(ev is None for ev in self.evaluations)


def judge(load: float, evaluations: list[Optional[dict[str, Any]]], confidence: float,
          errors: Optional[list[str]] = None) -> Probe:
    """Whether one probe passes: every check's one-sided `confidence` bound over seeds within its limit."""
    names: dict[str, dict[str, Any]] = {}
    for ev in evaluations:
        for c in gated_checks(ev):
            names.setdefault(c["name"], c)
    bounds: dict[str, Optional[float]] = {}
    ratios: dict[str, float] = {}
    failed_run = any(ev is None for ev in evaluations) or not evaluations
    for name, proto in names.items():
        values = []
        for ev in evaluations:
            c = next((x for x in gated_checks(ev) if x["name"] == name), None)
            values.append(None if c is None else c["value"])
        attain = proto["kind"] == "attainment"
        if attain:
            values = [0.0 if v is None else v for v in values]  # no request met: attainment 0
            bound = mean_bound(values, confidence, upper=False)
            ratio = math.inf if bound is None else miss_ratio(bound, proto["limit"])
        else:
            bound = None if any(v is None for v in values) else mean_bound(values, confidence, upper=True)
            ratio = math.inf if bound is None else bound / proto["limit"]
        bounds[name], ratios[name] = bound, ratio
    worst = max(ratios, key=ratios.get) if ratios else None
    growth = steady_growth(evaluations)
    if growth is not None and ratios:
        ratios[STEADY_CHECK] = growth["wait_growth"] / growth["limit"]
        if ratios[worst] <= 1.0 < ratios[STEADY_CHECK]:  # an SLO check that fails binds before the growth
            worst = STEADY_CHECK
    passed = not failed_run and bool(ratios) and all(r <= 1.0 for r in ratios.values())
    return Probe(load, list(evaluations), passed, bounds, ratios, worst, list(errors or []), growth)


class CapacitySearch:
    """Bracket + k-section over one load knob (noise-robust through `judge`). Drive it with
    `next_loads(k)` (the loads to probe now, [] when done) and `record(load, evaluations)`."""

    def __init__(self, start: float, confidence: float = 0.9, rel_tol: float = 0.02, integer: bool = False,
                 lo: Optional[float] = None, hi: Optional[float] = None, max_probes: int = 40,
                 requests: Optional[int] = None, max_extend: int = MAX_EXTEND) -> None:
        if not start > 0:
            raise ValueError(f"capacity: the starting load must be > 0, got {start}")
        self.start = float(start)
        self.confidence = confidence
        self.rel_tol = rel_tol
        self.integer = integer
        self.min_load = 1.0 if integer else start / 2 ** MAX_BRACKET_STEPS
        self.max_load = start * 2 ** MAX_BRACKET_STEPS
        self.max_probes = max_probes
        self.probes: dict[float, Probe] = {}
        self._seed_lo = lo  # user bounds: probed first
        self._seed_hi = hi
        self.note: Optional[str] = None
        self._tail = 0  # probes above a finished bracket (seed crossings)
        self.requests = requests  # a probe's length before extensions (None: the config's, never extended)
        self.max_extend = max_extend
        self.extend: dict[float, int] = {}  # load -> doublings of its requests so far
        self.pending: list[float] = []  # loads to run again, longer, before anything else
        self.confirmed_from: dict[float, Probe] = {}  # a capacity's shorter passing probe, before confirming

    def length(self, load: float) -> Optional[int]:
        """The requests of the next probe at `load` (None: the config's own count)."""
        if self.requests is None:
            return None
        return self.requests * 2 ** self.extend.get(float(load), 0)

    # -- state ------------------------------------------------------------------------------------
    def _round(self, x: float) -> float:
        return float(max(1, round(x))) if self.integer else float(x)

    @property
    def hi_fail(self) -> Optional[float]:
        fails = [x for x, p in self.probes.items() if not p.passed]
        return min(fails) if fails else None

    @property
    def lo_pass(self) -> Optional[float]:
        hi = self.hi_fail
        passes = [x for x, p in self.probes.items() if p.passed and (hi is None or x < hi)]
        return max(passes) if passes else None

    def _narrow_enough(self, lo: float, hi: float) -> bool:
        if self.integer:
            return hi - lo <= 1
        return hi - lo <= self.rel_tol * lo

    @property
    def done(self) -> bool:
        return not self._candidates(1)

    # -- driving ------------------------------------------------------------------------------------
    def _candidates(self, k: int) -> list[float]:
        if len(self.probes) >= self.max_probes:
            self.note = self.note or f"stopped after {self.max_probes} probes"
            return []
        if self.pending:  # a probe not yet steady runs again, longer, before the search moves on
            return sorted(self.pending)
        if not self.probes:
            first = [x for x in (self._seed_lo, self._seed_hi) if x is not None] or [self.start]
            return sorted({self._round(x) for x in first})
        lo, hi = self.lo_pass, self.hi_fail
        if lo is None:  # everything failed so far: halve below the lowest failure
            if hi <= self.min_load:
                self.note = f"even the lowest load probed ({hi:g}) misses the SLO"
                return []
            out = [self._round(max(self.min_load, hi / 2 ** (i + 1))) for i in range(k)]
        elif hi is None:  # everything passed so far: double above the highest pass
            if lo >= self.max_load:
                self.note = f"even the highest load probed ({lo:g}) meets the SLO"
                return []
            out = [self._round(min(self.max_load, lo * 2 ** (i + 1))) for i in range(k)]
        else:
            if self._narrow_enough(lo, hi):
                return self._confirm(lo) or self._tail_probe()
            out = [self._round(lo + (hi - lo) * (i + 1) / (k + 1)) for i in range(k)]
            out = [x for x in out if lo < x < hi]
        return sorted({x for x in out if x not in self.probes})

    def _confirm(self, lo: float) -> list[float]:
        """The answer must hold at the longest probe: a capacity that passed shorter runs again at the
        full extension (`requests` x 2^max_extend); if it fails there, the bracket narrows below it."""
        full = None if self.requests is None else self.requests * 2 ** self.max_extend
        probe = self.probes[lo]
        if full is None or probe.requests is None or probe.requests >= full:
            return []
        del self.probes[lo]  # judged again, longer; the shorter verdict is kept in `confirmed_from`
        self.confirmed_from[lo] = probe
        self.extend[lo] = self.max_extend
        self.pending.append(lo)
        return [lo]

    def _tail_probe(self) -> list[float]:
        """After the bracket: a few probes above it until every seed misses somewhere on its own, so that
        each seed has a crossing (the per-seed capacities and their interval)."""
        top = max(self.probes)
        if self._tail >= MAX_TAIL_PROBES or all(c is not None for c in self.seed_crossings()) \
                or top >= self.max_load:
            return []
        return [self._round(min(self.max_load, top * TAIL_FACTOR))]

    def next_loads(self, k: int = 1) -> list[float]:
        return self._candidates(max(1, k))

    def record(self, load: float, evaluations: list[Optional[dict[str, Any]]],
               errors: Optional[list[str]] = None) -> Probe:
        """Judge one probe. One whose SLO checks pass but which has not settled (`Probe.settled`) is not
        recorded yet: its load is run again at twice the requests (`pending`, `length`), up to
        `max_extend` times; after that it passes or fails as it is."""
        load = float(load)
        probe = judge(load, evaluations, self.confidence, errors)
        probe.requests, probe.extended = self.length(load), self.extend.get(load, 0)
        if load in self.pending:
            self.pending.remove(load)
        if probe.settled is False and probe.slo_passed and self.requests is not None \
                and probe.extended < self.max_extend:
            self.extend[load] = probe.extended + 1
            self.pending.append(load)
            return probe
        lo, hi = self.lo_pass, self.hi_fail
        if lo is not None and hi is not None and self._narrow_enough(lo, hi):
            self._tail += 1
        self.probes[load] = probe
        return probe

    # -- the answer ---------------------------------------------------------------------------------
    def seed_crossings(self) -> list[Optional[float]]:
        """Per seed: the load where its worst check crosses its limit, interpolated between probes."""
        loads = sorted(self.probes)
        n = max((len(p.evaluations) for p in self.probes.values()), default=0)
        out: list[Optional[float]] = []
        for i in range(n):
            ratios = [run_ratio(self.probes[x].evaluations[i]) if i < len(self.probes[x].evaluations)
                      else math.inf for x in loads]
            cross = None
            for j, r in enumerate(ratios):
                if r > 1.0:
                    if j > 0 and ratios[j - 1] <= 1.0:
                        x0, x1, r0 = loads[j - 1], loads[j], ratios[j - 1]
                        frac = 0.5 if not math.isfinite(r) else (1.0 - r0) / (r - r0)
                        cross = x0 + frac * (x1 - x0)
                    break
            out.append(cross)
        return out

    def result(self) -> dict[str, Any]:
        lo, hi = self.lo_pass, self.hi_fail
        binding = self.probes[hi].worst if hi is not None else (self.probes[lo].worst if lo is not None else None)
        status = "ok" if lo is not None and hi is not None else ("above_range" if hi is None else "below_range")
        crossings = self.seed_crossings()
        per_seed = mean_ci(crossings)  # clipped at 0: a load is never negative
        return {
            "status": status,
            "capacity": lo,
            "interval": [lo, hi],
            "binding": binding,
            "confidence": self.confidence,
            "seeds": max((len(p.evaluations) for p in self.probes.values()), default=0),
            "probes": len(self.probes),
            "per_seed_capacity": crossings,
            "per_seed_capacity_ci95": per_seed,
            "probe_requests": [None if x is None else self.probes[x].requests for x in (lo, hi)],
            "note": self.note,
        }
