"""`servetwin capacity` of a cluster config: the cheapest deployment (GPU count) that meets the SLOs at the
config's own load.

The config's arrivals stay as they are; what varies is the deployment. Aggregated deployments: the replica
count of one instance kind (role both), the tensor-parallel size of each replica (`--tp`) and the router
(`--router`); for each (TP, router) the fewest replicas meeting every SLO is found by bisection over
1..`--max-replicas` (more replicas of the same engine do not serve worse). Prefill/decode deployments (the P:D
ratio and the TP of each role) are searched in pd_deployments.py. All are ranked by GPUs (instances x TP x
DP), then by their worst SLO ratio. One simulation per probe, one seed: a cluster run is the workload's whole
arrival stream. Each deployment reports what binds it: the SLO closest to its limit where it passes, and the
one missed with one instance fewer (per role for P/D).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from servetwin.core.config_error import ConfigError


@dataclass(slots=True)
class Probe:
    at: tuple[int, ...]  # the instance counts simulated: (replicas,) or (prefill, decode)
    passed: bool
    checks: list[dict[str, Any]]  # evaluate_slo's checks of the run


class ProbeCache:
    """Each deployment simulated once: `probe(*counts)` evaluates `make(*counts)` the first time it is asked."""

    def __init__(self, make: Callable[..., Any], evaluate: Callable[[Any], list[dict[str, Any]]],
                 name: Callable[..., str], log: Callable[[str], None]):
        self.make, self.evaluate, self.name, self.log = make, evaluate, name, log
        self.probes: dict[tuple[int, ...], Probe] = {}

    def __call__(self, *counts: int) -> Probe:
        if counts not in self.probes:
            checks = self.evaluate(self.make(*counts))
            passed = checks_pass(checks)
            self.probes[counts] = Probe(counts, passed, checks)
            self.log(f"{self.name(*counts)}: {'meets' if passed else 'misses'} the SLOs ({worst_text(checks)})")
        return self.probes[counts]

    def sorted(self) -> list[Probe]:
        return sorted(self.probes.values(), key=lambda p: p.at)


def checks_pass(checks: list[dict[str, Any]]) -> bool:
    """A deployment meets the SLOs: every gated check of `evaluate_slo` holds (and there is one)."""
    return bool(checks) and all(c["met"] for c in checks if c.get("met") is not None)


def fewest(passes: Callable[[int], bool], hi: int) -> int:
    """The least n in 1..hi with passes(n), for a `passes` monotone in n and true at hi (bisection)."""
    lo = 0  # invariant: lo fails (or is 0), hi passes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(mid) else (mid, hi)
    return hi


@dataclass(slots=True)
class DeploymentResult:
    """An aggregated deployment: `replicas` copies of the instance at TP `tp` behind `router`."""
    tp: int
    router: str
    gpus_per_replica: int
    replicas: Optional[int]  # the fewest meeting the SLOs (None: not met up to max_replicas)
    probes: list[Probe]
    max_replicas: int = 0

    kind = "aggregated"

    @property
    def gpus(self) -> Optional[int]:
        return None if self.replicas is None else self.replicas * self.gpus_per_replica

    @property
    def tp_text(self) -> str:
        return str(self.tp)

    @property
    def instances_text(self) -> str:
        return str(self.replicas) if self.replicas else f"> {self.max_replicas}"

    @property
    def label(self) -> str:
        return f"{self.replicas} x TP{self.tp}"

    def probe(self, replicas: int) -> Optional[Probe]:
        return next((p for p in self.probes if p.at == (replicas,)), None)

    def worst_ratio(self) -> float:
        at = self.probe(self.replicas) if self.replicas else None
        return worst_ratio(at.checks) if at else np.inf

    def binds(self) -> str:
        """The SLO closest to its limit at the answer, and the one missed with one replica fewer."""
        parts = []
        at = self.probe(self.replicas) if self.replicas else None
        if at is not None:
            parts.append(f"at {self.replicas}: {worst_text(at.checks)}")
        below = self.probe(self.replicas - 1) if self.replicas else max(self.probes, key=lambda p: p.at)
        if below is not None:
            parts.append(f"at {below.at[0]}: {worst_text(below.checks)}")
        return "; ".join(parts)


def worst_check(checks: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    gated = [c for c in checks if c.get("ratio") is not None]
    return max(gated, key=lambda c: c["ratio"]) if gated else None


def worst_ratio(checks: list[dict[str, Any]]) -> float:
    c = worst_check(checks)
    return np.inf if c is None else float(c["ratio"])


def worst_text(checks: list[dict[str, Any]]) -> str:
    c = worst_check(checks)
    if c is None:
        return "nothing measured"
    verdict = "met" if c["met"] else "missed"
    if c.get("kind") == "attainment":  # (a share of requests, not seconds: `slo_line`'s words)
        got = "-" if c["value"] is None else f"{100 * c['value']:.3g}%"
        return f"deadlines met by {got} of requests, {100 * c['limit']:g}% required ({verdict})"
    unit, scale = ("ms", 1000.0) if c["limit"] < 1.0 else ("s", 1.0)
    return f"{c['name']} {c['value'] * scale:.3g} {unit} of {c['limit'] * scale:.3g} {unit} ({verdict})"


def aggregated_template(raw_cluster: dict[str, Any]) -> dict[str, Any]:
    """The instance aggregated deployments copy: the config's one instance kind (role both), or, in a P/D
    config, its decode instance serving alone (role both, without the NixlConnector that made it a consumer)."""
    instances = raw_cluster.get("instances") or []
    roles = [dict(i).get("role", "both") for i in instances]
    if len(instances) == 1 and roles[0] == "both":
        return copy.deepcopy(dict(instances[0]))
    if "decode" in roles and "both" not in roles:
        inst = copy.deepcopy(dict(instances[roles.index("decode")]))
        inst.update(role="both", name="r")
        engine = dict(inst.get("engine") or {})
        if dict(engine.get("kv_transfer_config") or {}).get("kv_connector") == "NixlConnector":
            engine.pop("kv_transfer_config")
        inst["engine"] = engine
        return inst
    raise ConfigError("cluster.instances", "capacity across deployments varies one instance kind (role both) or "
                      f"one prefill and one decode kind; this config has {len(instances)} ({', '.join(roles)})")


def deployment_values(template: dict[str, Any], replicas: int, tp: int, router: dict[str, Any]) -> dict[str, Any]:
    """`load_config` values giving the cluster `replicas` copies of `template` at TP `tp` behind `router`."""
    inst = copy.deepcopy(template)
    inst["count"] = replicas
    inst["engine"] = {**dict(inst.get("engine") or {}), "tensor_parallel_size": tp}
    return {"cluster.instances": [inst], "cluster.router": router, "cluster.prefill_router": None}


def evaluate_deployment(exp: Any) -> list[dict[str, Any]]:
    """Simulate the cluster once and evaluate `exp.slo` as its run's summary does: on the client's requests,
    every engine's pooled (with P/D: the decode side's records, whose TTFT runs from the arrival).
    Ctrl-C during the run stops the search (KeyboardInterrupt), not just this probe."""
    from servetwin.experiments.run.cluster_run import cluster_run_summary  # noqa: PLC0415

    combined = cluster_run_summary(exp)
    if combined["interrupted"]:  # (a cut run's checks would judge the deployment on part of its load)
        raise KeyboardInterrupt
    return combined["backends"]["sim"]["slo"]["checks"]


def search_deployments(load: Callable[[dict[str, Any]], Any], raw_cluster: dict[str, Any], tps: list[int],
                       routers: list[dict[str, Any]], max_replicas: int,
                       evaluate: Callable[[Any], list[dict[str, Any]]] = evaluate_deployment,
                       log: Callable[[str], None] = lambda msg: None) -> list[DeploymentResult]:
    """For each (TP, router): the fewest replicas meeting the SLOs (bisection); ranked cheapest first.
    `load(values)` -> the ExperimentConfig with those overrides."""
    template = aggregated_template(raw_cluster)
    dp = int(template.get("data_parallel_size", 1))
    out = []
    for tp in tps:
        for router in routers:
            probe = ProbeCache(lambda n, tp=tp, router=router: load(deployment_values(template, n, tp, router)),
                               evaluate, lambda n, tp=tp, router=router: f"TP{tp} {router['type']} x{n}", log)
            replicas = fewest(lambda n: probe(n).passed, max_replicas) if probe(max_replicas).passed else None
            out.append(DeploymentResult(tp, router["type"], tp * dp, replicas, probe.sorted(), max_replicas))
    return sorted(out, key=rank_key)


def rank_key(r: Any) -> tuple:
    """Met first; then fewer GPUs; then the smaller worst SLO ratio (more headroom)."""
    if r.gpus is None:
        return (1, 0, 0.0)
    return (0, r.gpus, r.worst_ratio())


def render(results: list[Any]) -> list[str]:
    lines = ["| rank | deployment | TP | router | instances | GPUs | what binds |",
             "|---:|---|---|---|---|---:|---|"]
    for i, r in enumerate(results, 1):
        lines.append(f"| {i} | {r.kind} | {r.tp_text} | {r.router} | {r.instances_text} | {r.gpus if r.gpus else '-'} "
                     f"| {r.binds()} |")
    ok = [r for r in results if r.gpus]
    lines.append("")
    if not ok:
        lines.append("no deployment within the instance limits meets the SLOs (--max-replicas, --max-prefill, "
                     "--max-decode)")
        return lines
    lines.append(f"cheapest: {ok[0].label} behind {ok[0].router} = {ok[0].gpus} GPUs")
    if len(ok) > 1:
        lines.append(f"runner-up: {ok[1].label} behind {ok[1].router} = {ok[1].gpus} GPUs")
    return lines


def router_choices(raw_cluster: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    """The config's router (by default) and each `--router NAME`: the config's settings where its type is
    NAME, else `{type: NAME}`."""
    own = dict(raw_cluster.get("router") or {"type": "round_robin"})
    if not names:
        return [own]
    return [own if own.get("type", "round_robin") == n else {"type": n} for n in dict.fromkeys(names)]


def int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(flag, f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(flag, f"expected positive integers, got {text!r}")
    return out
