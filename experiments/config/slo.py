"""Service-level objectives: parsed once from the experiment's `slo:` (or `--slo`), evaluated on a run.

    slo:
      ttft_p99_s: 0.5        # distribution targets: <metric>_<stat>_s, the run's statistic <= the limit
      tpot_p50_s: 0.05       #   metric: ttft | tpot | itl | e2e; stat: mean | p50 | p90 | p99
      ttft_s: 1.0            # per-request deadlines: <metric>_s, one request meets it if its value <= the
      e2e_s: 30              #   limit (metric: ttft | tpot | e2e, the metrics vLLM's `--goodput` takes)
      min_attainment: 0.9    # share of requests that must meet every deadline (default 0.9 when deadlines
                             #   are given: DistServe's 90% attainment)
      engine_ttft_p99_s: 0.3 # any metric with `engine_`: measured from the request's arrival at the engine
                             #   (without the API server's queue and hops), as vLLM's engine metrics are

A run meets the SLO when every distribution target holds and, if deadlines are given, the share of
requests meeting all of them is at least `min_attainment`. Each target also reports its attainment:
the share of requests (of tokens, for ITL) whose own value is within the target's limit.

Goodput (DistServe's definition, as vLLM's benchmark computes it) is the rate of requests that meet
every per-request deadline: their count over the run's makespan. Without explicit deadlines, the
deadlines are the limits of the percentile targets on per-request metrics (for each of ttft / tpot /
e2e the tightest p50 / p90 / p99 limit): "p99 TTFT <= 0.5 s" then counts the requests with TTFT <= 0.5 s.
A request that did not finish (or was rejected) never meets a deadline; attainment counts every
sequence of the workload (parallel sampling: each of the n sequences).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from servetwin.core.config_error import ConfigError

_CLIENT_METRICS = ("ttft", "tpot", "itl", "e2e")
# client-boundary metrics, then the same from the engine's boundary (docs/frontend_model.md)
SLO_METRICS = _CLIENT_METRICS + tuple(f"engine_{m}" for m in _CLIENT_METRICS)
SLO_STATS = ("mean", "p50", "p90", "p99")
DEADLINE_METRICS = tuple(m for m in SLO_METRICS if not m.endswith("itl"))  # per request; ITL is per token
DEFAULT_MIN_ATTAINMENT = 0.9
_TARGET_RE = re.compile(r"((?:engine_)?(?:ttft|tpot|itl|e2e))_(mean|p50|p90|p99)_s")
_DEADLINE_RE = re.compile(r"((?:engine_)?(?:ttft|tpot|e2e))_s")


class SloError(ConfigError):
    """A bad SLO specification, naming the field (`slo.ttft_p99_s`)."""


@dataclass(slots=True, frozen=True)
class SloTarget:
    """`metric`'s `stat` (mean/p50/p90/p99) over a run must be <= `limit_s`."""
    metric: str
    stat: str
    limit_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.stat}_s"


@dataclass(slots=True, frozen=True)
class SloDeadline:
    """One request meets this deadline if its `metric` is <= `limit_s`."""
    metric: str
    limit_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_s"


@dataclass(slots=True, frozen=True)
class SloSpec:
    targets: tuple[SloTarget, ...] = ()
    deadlines: tuple[SloDeadline, ...] = ()
    min_attainment: Optional[float] = None  # only with explicit deadlines

    @property
    def empty(self) -> bool:
        return not self.targets and not self.deadlines

    def goodput_deadlines(self) -> tuple[SloDeadline, ...]:
        """The explicit deadlines, else the tightest percentile-target limit per per-request metric."""
        if self.deadlines:
            return self.deadlines
        tightest: dict[str, float] = {}
        for t in self.targets:
            if t.metric in DEADLINE_METRICS and t.stat != "mean":
                tightest[t.metric] = min(t.limit_s, tightest.get(t.metric, math.inf))
        return tuple(SloDeadline(m, v) for m, v in tightest.items())

    def to_dict(self) -> dict[str, float]:
        out: dict[str, float] = {t.name: t.limit_s for t in self.targets}
        out.update({d.name: d.limit_s for d in self.deadlines})
        if self.min_attainment is not None:
            out["min_attainment"] = self.min_attainment
        return out


def _limit(v: Any, path: str) -> float:
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SloError(f"{path}", f"must be a positive number of seconds, got {v!r}")
    return float(v)


def _allowed_keys() -> list[str]:
    return ([f"{m}_{s}_s" for m in SLO_METRICS for s in SLO_STATS] + [f"{m}_s" for m in DEADLINE_METRICS]
            + ["min_attainment"])


def parse_slo(cfg: Any, path: str = "slo") -> SloSpec:
    """`{ttft_p99_s: 0.5, e2e_s: 30, ...}` -> SloSpec; errors name the field (`slo.ttft_p99_s`)."""
    if cfg is None:
        return SloSpec()
    if not isinstance(cfg, Mapping):
        raise SloError(f"{path}", f"must be a mapping like {{ttft_p99_s: 0.5}}, got {type(cfg).__name__} {cfg!r}")
    targets: list[SloTarget] = []
    deadlines: list[SloDeadline] = []
    min_att: Optional[float] = None
    for key, value in cfg.items():
        where = f"{path}.{key}"
        k = str(key)
        if m := _TARGET_RE.fullmatch(k):
            targets.append(SloTarget(m.group(1), m.group(2), _limit(value, where)))
        elif m := _DEADLINE_RE.fullmatch(k):
            deadlines.append(SloDeadline(m.group(1), _limit(value, where)))
        elif k == "min_attainment":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise SloError(f"{where}", f"must be a share in (0, 1], got {value!r}")
            min_att = float(value)
        else:
            import difflib  # noqa: PLC0415

            close = difflib.get_close_matches(k, _allowed_keys(), n=1, cutoff=0.6)
            dym = f" (did you mean {close[0]}?)" if close else ""
            raise SloError(f"{where}", f"unknown SLO{dym}; use <metric>_<stat>_s with metric one of "
                           f"{', '.join(SLO_METRICS)} and stat one of {', '.join(SLO_STATS)} (e.g. ttft_p99_s), "
                           f"a per-request deadline {', '.join(f'{m}_s' for m in DEADLINE_METRICS)}, "
                           "or min_attainment")
    if min_att is not None and not deadlines:
        raise SloError(f"{path}.min_attainment", "needs at least one per-request deadline "
                       f"({', '.join(f'{m}_s' for m in DEADLINE_METRICS)})")
    if deadlines and min_att is None:
        min_att = DEFAULT_MIN_ATTAINMENT
    return SloSpec(tuple(targets), tuple(deadlines), min_att)


def parse_slo_args(items: list[str], flag: str = "--slo") -> dict[str, Any]:
    """`--slo ttft_p99_s=0.5 --slo e2e_s=30` (or comma-separated `ttft_p99_s=0.5,e2e_s=30`) -> a mapping; a name
    in milliseconds becomes the one in seconds (`tpot_p99_ms=50` -> `tpot_p99_s: 0.05`)."""
    out: dict[str, Any] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            if "=" not in part:
                raise SloError(f"{flag} {part!r}", f"expected NAME=SECONDS, e.g. {flag} ttft_p99_s=0.5")
            key, value = (s.strip() for s in part.split("=", 1))
            if key.endswith("_ms"):
                try:
                    value = float(value) / 1000.0
                except ValueError:
                    raise SloError(f"{flag} {key}", f"expected a number of milliseconds, got {value!r}") from None
                key = key[:-3] + "_s"
            out[key] = value
    return out


# -- evaluation ---------------------------------------------------------------------------------
def _finite_or_none(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None  # JSON has no infinity


def miss_ratio(attainment: float, required: float) -> float:
    """The share of requests missing their deadlines over the share allowed to miss (1 - required):
    0 when all meet them, 1 at the required attainment, > 1 below it."""
    if required >= 1.0:
        return 0.0 if attainment >= 1.0 else math.inf
    return max(0.0, 1.0 - attainment) / (1.0 - required)

def _stat(values, stat: str) -> Optional[float]:
    import numpy as np  # noqa: PLC0415

    if values.size == 0:
        return None
    if stat == "mean":
        return float(values.mean())
    return float(np.percentile(values, {"p50": 50, "p90": 90, "p99": 99}[stat]))


def evaluate_slo(spec: SloSpec, requests, itls, duration_s: float, engine_itls=None) -> dict[str, Any]:
    """Attainment per target, whether the run meets the SLO, and goodput, from one backend's request
    table (`requests.parquet`'s columns) and its inter-token latencies. `ratio` is value / limit (for
    the attainment check: required / achieved; None when nothing was measured), so the largest ratio is
    the binding SLO. `engine_itls`: the engine-boundary gaps (`engine_itl_*` targets; default `itls`)."""
    import numpy as np  # noqa: PLC0415

    total = int(len(requests))

    def column(metric: str):
        if metric.endswith("itl"):  # a list's None becomes nan, dropped below
            return np.asarray(engine_itls if metric == "engine_itl" and engine_itls is not None else itls,
                              dtype=float)
        return requests[f"{metric}_s"].to_numpy(dtype=float, na_value=np.nan)

    checks: list[dict[str, Any]] = []
    for t in spec.targets:
        col = column(t.metric)
        finite = col[np.isfinite(col)]
        value = _stat(finite, t.stat)
        denom = col.size if t.metric.endswith("itl") else total
        att = float((finite <= t.limit_s).sum() / denom) if denom else None
        met = value is not None and value <= t.limit_s
        checks.append({"name": t.name, "kind": "target", "limit": t.limit_s, "value": value, "met": bool(met),
                       "ratio": (value / t.limit_s) if value is not None else None, "attainment": att})
    deadlines = spec.goodput_deadlines()
    ok = np.ones(total, dtype=bool)
    for d in deadlines:
        col = column(d.metric)
        meets = np.isfinite(col) & (col <= d.limit_s)
        if d.metric.endswith("tpot"):  # a one-token output has no TPOT: it meets any TPOT deadline once finished
            e2e = requests[d.metric.replace("tpot", "e2e") + "_s"].to_numpy(dtype=float, na_value=np.nan)
            meets |= ~np.isfinite(col) & np.isfinite(e2e)
        ok &= meets
        if spec.deadlines:
            checks.append({"name": d.name, "kind": "deadline", "limit": d.limit_s, "value": None, "met": None,
                           "ratio": None, "attainment": float(meets.sum() / total) if total else None})
    good = int(ok.sum()) if deadlines else None
    attainment = (good / total) if deadlines and total else None
    if spec.deadlines:
        need = float(spec.min_attainment)
        got = attainment or 0.0
        checks.append({"name": "attainment", "kind": "attainment", "limit": need, "value": attainment,
                       "met": got >= need, "ratio": _finite_or_none(miss_ratio(got, need)),
                       "attainment": None})
    gated = [c for c in checks if c["met"] is not None]
    binding = max(gated, key=lambda c: math.inf if c["ratio"] is None else c["ratio"])["name"] if gated else None
    return {
        "spec": spec.to_dict(),
        "met": all(c["met"] for c in gated),
        "checks": checks,
        "binding": binding,
        "deadlines": {d.name: d.limit_s for d in deadlines},
        "attainment": attainment,
        "good_requests": good,
        "goodput_req_s": (good / duration_s) if good is not None and duration_s > 0 else None,
    }


def slo_markdown(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """The report's SLO section: per backend, each check's value, limit, attainment; goodput."""
    from servetwin.experiments.common.md_tables import fmt, md_table  # noqa: PLC0415

    evs = {b: s["slo"] for b, s in summaries.items() if s.get("slo")}
    if not evs:
        return []
    rows = []
    for b, ev in evs.items():
        for c in ev["checks"]:
            met = "-" if c["met"] is None else ("yes" if c["met"] else "NO")
            rows.append([b, f"`{c['name']}`", c["kind"], c["value"], c["limit"], c["attainment"], met])
        rows.append([b, "**all**", "", None, None, ev.get("attainment"), "yes" if ev["met"] else "NO"])
    lines = ["## SLO", "", md_table(["backend", "check", "kind", "value", "limit", "attainment", "met"], rows), ""]
    for b, ev in evs.items():
        lines.append(f"- **{b}**: SLO {'met' if ev['met'] else 'missed'}; binding `{ev['binding']}`; goodput "
                     f"{fmt(ev.get('goodput_req_s'))} req/s ({fmt(ev.get('good_requests'))} requests meeting "
                     f"{', '.join(f'{k} <= {v:g} s' for k, v in ev['deadlines'].items()) or 'no deadline'}).")
    return lines + ["", "Attainment: the share of requests (tokens, for ITL) within the check's limit; goodput: "
                        "requests meeting every per-request deadline per second of makespan (docs/capacity.md).", ""]
