"""Prefill/decode deployments in `servetwin capacity`: the P:D ratio (prefill count x decode count) and the TP
of each role that meet the SLOs with the fewest GPUs (prefill count x prefill TP + decode count x decode TP).

Assumed: adding an instance of either role never makes the SLOs harder to meet (monotone in each count; the
simulation is one seed, so a noisy arm can break this near its threshold). Under that assumption the search is
exact for the GPU count and affordable:

1. the fewest prefill instances P* meeting the SLOs with the most decode instances (bisection): no deployment
   with fewer prefill instances meets them at any decode count;
2. the fewest decode instances D* with P* prefill instances (bisection);
3. a walk over P* + 1 .. max prefill: at each prefill count, the largest decode count that would still be
   cheaper than the best so far is probed; if it meets the SLOs the fewest decode instances there are found by
   bisection (a new best), else no smaller decode count does either. The walk ends when no decode count is
   cheaper. A tie in GPUs keeps the first found (fewer prefill instances).

What binds the answer is read per role: the deployment with one prefill instance fewer (TTFT typically misses
there: the prefill queue) and with one decode instance fewer (TPOT typically: the decode batch), each probed.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from servetwin.core.config_error import ConfigError
from servetwin.experiments.capacity.deployments import (Probe, ProbeCache, evaluate_deployment, fewest, rank_key,
                                                        worst_ratio, worst_text)


@dataclass(slots=True)
class PDResult:
    """`counts` = (prefill, decode) instances at TP `prefill_tp` / `decode_tp` behind `router` (the decode
    profile); None where no deployment up to (max_prefill, max_decode) meets the SLOs."""
    prefill_tp: int
    decode_tp: int
    router: str
    counts: Optional[tuple[int, int]]
    probes: list[Probe]
    max_counts: tuple[int, int]

    kind = "P/D"

    @property
    def gpus(self) -> Optional[int]:
        return None if self.counts is None else self.counts[0] * self.prefill_tp + self.counts[1] * self.decode_tp

    @property
    def tp_text(self) -> str:
        return f"P{self.prefill_tp}:D{self.decode_tp}"

    @property
    def instances_text(self) -> str:
        if self.counts is None:
            return f"> {self.max_counts[0]}P:{self.max_counts[1]}D"
        return f"{self.counts[0]}P:{self.counts[1]}D"

    @property
    def label(self) -> str:
        return f"{self.counts[0]} prefill x TP{self.prefill_tp} + {self.counts[1]} decode x TP{self.decode_tp}"

    def probe(self, prefill: int, decode: int) -> Optional[Probe]:
        return next((p for p in self.probes if p.at == (prefill, decode)), None)

    def worst_ratio(self) -> float:
        at = self.probe(*self.counts) if self.counts else None
        return worst_ratio(at.checks) if at else np.inf

    def binding_roles(self) -> dict[str, Optional[Probe]]:
        """The probe with one instance fewer of each role (None: that role is at one instance)."""
        if self.counts is None:
            return {}
        p, d = self.counts
        return {"prefill": self.probe(p - 1, d) if p > 1 else None, "decode": self.probe(p, d - 1) if d > 1 else None}

    def binds(self) -> str:
        if self.counts is None:
            top = self.probe(*self.max_counts)
            return f"at {self.max_counts[0]}P:{self.max_counts[1]}D: {worst_text(top.checks)}" if top else ""
        p, d = self.counts
        parts = [f"at {p}P:{d}D: {worst_text(self.probe(p, d).checks)}"]
        for role, below in self.binding_roles().items():
            if below is None:
                parts.append(f"{role}: at its minimum (1)")
            else:
                parts.append(f"{role} binds at {below.at[0]}P:{below.at[1]}D: {worst_text(below.checks)}")
        return "; ".join(parts)


def cheapest_counts(probe: Callable[[int, int], Probe], prefill_tp: int, decode_tp: int, max_prefill: int,
                    max_decode: int) -> Optional[tuple[int, int]]:
    """The (prefill, decode) counts meeting the SLOs with the fewest GPUs (module docstring: steps 1-3)."""
    if not probe(max_prefill, max_decode).passed:
        return None
    p = fewest(lambda n: probe(n, max_decode).passed, max_prefill)
    best = (p, fewest(lambda n: probe(p, n).passed, max_decode))
    for n_prefill in range(p + 1, max_prefill + 1):
        cost = best[0] * prefill_tp + best[1] * decode_tp
        bound = min(max_decode, (cost - n_prefill * prefill_tp - 1) // decode_tp)  # cheaper than the best
        if bound < 1:
            break
        if probe(n_prefill, bound).passed:
            best = (n_prefill, fewest(lambda n: probe(n_prefill, n).passed, bound))
    return best


def search_pd(probe_for: Callable[[int, int, dict[str, Any]], ProbeCache], prefill_tps: list[int],
              decode_tps: list[int], routers: list[dict[str, Any]], max_prefill: int,
              max_decode: int) -> list[PDResult]:
    """Every (prefill TP, decode TP, router): its cheapest counts and the neighbours that say what binds."""
    out = []
    for prefill_tp in prefill_tps:
        for decode_tp in decode_tps:
            for router in routers:
                probe = probe_for(prefill_tp, decode_tp, router)
                counts = cheapest_counts(probe, prefill_tp, decode_tp, max_prefill, max_decode)
                if counts is not None:  # what binds: one instance fewer of each role
                    for p, d in ((counts[0] - 1, counts[1]), (counts[0], counts[1] - 1)):
                        if p >= 1 and d >= 1:
                            probe(p, d)
                out.append(PDResult(prefill_tp, decode_tp, router["type"], counts, probe.sorted(),
                                    (max_prefill, max_decode)))
    return sorted(out, key=rank_key)


def pd_templates(raw_cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The prefill and decode instances P/D deployments copy: the config's own (one kind of each), or its one
    aggregated instance in both roles (data_parallel_size 1: P/D instances run without DP)."""
    instances = [dict(i) for i in raw_cluster.get("instances") or []]
    roles = [i.get("role", "both") for i in instances]
    if len(instances) == 1 and roles == ["both"]:
        out = {}
        for role in ("prefill", "decode"):
            inst = copy.deepcopy(instances[0])
            inst.pop("data_parallel_size", None)
            inst.update(name=role, role=role)
            out[role] = inst
        return out
    if sorted(roles) == ["decode", "prefill"]:
        return {inst["role"]: copy.deepcopy(inst) for inst in instances}
    raise ConfigError("cluster.instances", "P/D deployments vary one prefill and one decode instance kind (or one "
                      f"aggregated kind in both roles); this config has {len(instances)} ({', '.join(roles)})")


def pd_values(templates: dict[str, dict[str, Any]], counts: tuple[int, int], tps: tuple[int, int],
              router: dict[str, Any]) -> dict[str, Any]:
    """`load_config` values giving the cluster counts[0] prefill and counts[1] decode instances at TPs `tps`."""
    instances = []
    for role, count, tp in zip(("prefill", "decode"), counts, tps):
        inst = copy.deepcopy(templates[role])
        inst["count"] = count
        inst["engine"] = {**dict(inst.get("engine") or {}), "tensor_parallel_size": tp}
        instances.append(inst)
    return {"cluster.instances": instances, "cluster.router": router}


def run_pd_search(load: Callable[[dict[str, Any]], Any], raw_cluster: dict[str, Any], prefill_tps: list[int],
                  decode_tps: list[int], routers: list[dict[str, Any]], max_prefill: int, max_decode: int,
                  evaluate: Callable[[Any], list[dict[str, Any]]] = evaluate_deployment,
                  log: Callable[[str], None] = lambda msg: None) -> list[PDResult]:
    """`search_pd` over simulations: `load(values)` -> the ExperimentConfig of a deployment."""
    templates = pd_templates(raw_cluster)

    def probe_for(prefill_tp: int, decode_tp: int, router: dict[str, Any]) -> ProbeCache:
        return ProbeCache(lambda p, d: load(pd_values(templates, (p, d), (prefill_tp, decode_tp), router)), evaluate,
                          lambda p, d: f"P/D {p}P TP{prefill_tp} : {d}D TP{decode_tp} {router['type']}", log)
    return search_pd(probe_for, prefill_tps, decode_tps, routers, max_prefill, max_decode)
