"""`servetwin capacity` of a cluster config: the cheapest deployment (GPU count) that meets the SLOs at the
config's own load.

The config's arrivals stay as they are; what varies is the deployment: the replica count of its (single)
instance kind, the tensor-parallel size of each replica (`--tp`) and the router (`--router`). For each
(TP, router) the fewest replicas meeting every SLO is found by bisection over 1..`--max-replicas` (more
replicas of the same engine do not serve worse); the deployments are ranked by GPUs (replicas x TP x DP),
then by their worst SLO ratio. One simulation per probe, one seed: a cluster run is the workload's whole
arrival stream. Each deployment reports what binds it: the SLO closest to its limit where it passes, and
the one missed with one replica fewer. P:D ratios come with prefill/decode instances.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from servetwin.core.config_error import ConfigError


@dataclass(slots=True)
class Probe:
    replicas: int
    passed: bool
    checks: list[dict[str, Any]]  # evaluate_slo's checks of the run


@dataclass(slots=True)
class DeploymentResult:
    tp: int
    router: str
    gpus_per_replica: int
    replicas: Optional[int]  # the fewest meeting the SLOs (None: not met up to max_replicas)
    probes: list[Probe]

    @property
    def gpus(self) -> Optional[int]:
        return None if self.replicas is None else self.replicas * self.gpus_per_replica

    def probe(self, replicas: int) -> Optional[Probe]:
        return next((p for p in self.probes if p.replicas == replicas), None)

    def binds(self) -> str:
        """The SLO closest to its limit at the answer, and the one missed with one replica fewer."""
        parts = []
        at = self.probe(self.replicas) if self.replicas else None
        if at is not None:
            parts.append(f"at {self.replicas}: {_worst(at.checks)}")
        below = self.probe((self.replicas or 0) - 1) if self.replicas else max(self.probes, key=lambda p: p.replicas)
        if below is not None:
            parts.append(f"at {below.replicas}: {_worst(below.checks)}")
        return "; ".join(parts)


def _worst(checks: list[dict[str, Any]]) -> str:
    gated = [c for c in checks if c.get("ratio") is not None]
    if not gated:
        return "nothing measured"
    c = max(gated, key=lambda c: c["ratio"])
    unit, scale = ("ms", 1000.0) if c["limit"] < 1.0 else ("s", 1.0)
    verdict = "met" if c["met"] else "missed"
    return f"{c['name']} {c['value'] * scale:.3g} {unit} of {c['limit'] * scale:.3g} {unit} ({verdict})"


def slo_seconds(items: dict[str, Any]) -> dict[str, Any]:
    """`tpot_p99_ms=50` -> `tpot_p99_s=0.05` (the SLO names are in seconds)."""
    out = {}
    for key, value in items.items():
        if key.endswith("_ms"):
            try:
                out[key[:-3] + "_s"] = float(value) / 1000.0
            except ValueError:
                raise ConfigError(f"--slo {key}", f"expected a number of milliseconds, got {value!r}") from None
        else:
            out[key] = value
    return out


def deployment_values(raw_cluster: dict[str, Any], replicas: int, tp: int, router: dict[str, Any]) -> dict[str, Any]:
    """`load_config` values giving the cluster `replicas` copies of its instance at TP `tp` behind `router`."""
    instances = raw_cluster.get("instances") or []
    if len(instances) != 1 or instances[0].get("role", "both") != "both":
        raise ConfigError("cluster.instances", "capacity across deployments varies one instance kind (role both); "
                          f"this config has {len(instances)}")
    inst = copy.deepcopy(dict(instances[0]))
    inst["count"] = replicas
    inst["engine"] = {**dict(inst.get("engine") or {}), "tensor_parallel_size": tp}
    return {"cluster.instances": [inst], "cluster.router": router}


def evaluate_deployment(exp: Any) -> list[dict[str, Any]]:
    """Simulate the cluster once and evaluate `exp.slo` on every engine's requests pooled."""
    import pandas as pd  # noqa: PLC0415

    from servetwin.experiments.config.slo import evaluate_slo  # noqa: PLC0415
    from servetwin.experiments.run.cluster_run import simulate_cluster  # noqa: PLC0415

    _, runs, _, _ = simulate_cluster(exp)
    frames = [run.recorder.frames()["requests"] for run in runs.values()]
    itls = np.concatenate([np.asarray(run.recorder.itl_array(), dtype=float) for run in runs.values()])
    reqs = pd.concat(frames, ignore_index=True)
    duration = max((run.simulated_s or 0.0 for run in runs.values()), default=0.0)
    return evaluate_slo(exp.slo, reqs, itls, duration)["checks"]


def search_deployments(load: Callable[[dict[str, Any]], Any], raw_cluster: dict[str, Any], tps: list[int],
                       routers: list[dict[str, Any]], max_replicas: int,
                       evaluate: Callable[[Any], list[dict[str, Any]]] = evaluate_deployment,
                       log: Callable[[str], None] = lambda msg: None) -> list[DeploymentResult]:
    """For each (TP, router): the fewest replicas meeting the SLOs (bisection); ranked cheapest first.
    `load(values)` -> the ExperimentConfig with those overrides."""
    out = []
    for tp in tps:
        for router in routers:
            probes: dict[int, Probe] = {}

            def probe(n: int) -> Probe:
                if n not in probes:
                    exp = load(deployment_values(raw_cluster, n, tp, router))
                    checks = evaluate(exp)
                    passed = bool(checks) and all(c["met"] for c in checks if c.get("met") is not None)
                    probes[n] = Probe(n, passed, checks)
                    log(f"TP{tp} {router['type']} x{n}: {'meets' if passed else 'misses'} the SLOs ({_worst(checks)})")
                return probes[n]
            lo, hi = 0, max_replicas  # invariant: lo fails (or 0), hi passes (once probed)
            if not probe(hi).passed:
                out.append(DeploymentResult(tp, router["type"], tp * _dp(raw_cluster), None, sorted(probes.values(), key=lambda p: p.replicas)))
                continue
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if probe(mid).passed else (mid, hi)
            out.append(DeploymentResult(tp, router["type"], tp * _dp(raw_cluster), hi,
                                        sorted(probes.values(), key=lambda p: p.replicas)))
    return sorted(out, key=_rank)


def _dp(raw_cluster: dict[str, Any]) -> int:
    return int((raw_cluster.get("instances") or [{}])[0].get("data_parallel_size", 1))


def _rank(r: DeploymentResult) -> tuple:
    if r.replicas is None:
        return (1, 0.0, r.tp)
    at = r.probe(r.replicas)
    worst = max((c["ratio"] for c in at.checks if c.get("ratio") is not None), default=np.inf)
    return (0, r.gpus, worst)


def render(results: list[DeploymentResult], max_replicas: int) -> list[str]:
    lines = ["| rank | TP | router | replicas | GPUs | what binds |", "|---:|---:|---|---:|---:|---|"]
    for i, r in enumerate(results, 1):
        reps = str(r.replicas) if r.replicas else f"> {max_replicas}"
        lines.append(f"| {i} | {r.tp} | {r.router} | {reps} | {r.gpus if r.gpus else '-'} | {r.binds()} |")
    ok = [r for r in results if r.replicas]
    if ok:
        best = ok[0]
        lines.append("")
        lines.append(f"cheapest: {best.replicas} x TP{best.tp} behind {best.router} = {best.gpus} GPUs")
        if len(ok) > 1:
            nxt = ok[1]
            lines.append(f"runner-up: {nxt.replicas} x TP{nxt.tp} behind {nxt.router} = {nxt.gpus} GPUs")
    else:
        lines.append("")
        lines.append(f"no deployment up to {max_replicas} replicas meets the SLOs")
    return lines


def router_choices(raw_cluster: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    """The config's router (by default) and each `--router NAME`: the config's settings where its type is
    NAME, else `{type: NAME}`."""
    own = dict(raw_cluster.get("router") or {"type": "round_robin"})
    if not names:
        return [own]
    return [own if own.get("type", "round_robin") == n else {"type": n} for n in dict.fromkeys(names)]


def run_deployment_capacity(args: Any, log: Callable[[str], None]) -> int:
    """The CLI path of `servetwin capacity` for a config with a `cluster:` section."""
    from servetwin.experiments.config.schema import load_config, load_yaml, parse_override, set_dotted  # noqa: PLC0415
    from servetwin.experiments.config.slo import parse_slo_args  # noqa: PLC0415

    raw = load_yaml(args.config) or {}
    for text in args.overrides:
        set_dotted(raw, *parse_override(text))
    raw_cluster = dict(raw.get("cluster") or {})
    slo = slo_seconds(parse_slo_args(args.slo)) if args.slo else None
    tps = _int_list(args.tp, "--tp") if args.tp else [int((raw.get("engine") or {}).get("tensor_parallel_size", 1))]
    routers = router_choices(raw_cluster, args.router)
    max_replicas = int(args.max_replicas)
    if max_replicas < 1:
        raise ConfigError("--max-replicas", "must be at least 1")

    def load(values: dict[str, Any]) -> Any:
        vals = dict(values)
        if slo is not None:
            vals["slo"] = slo
        exp = load_config(args.config, overrides=list(args.overrides), values={**vals, "output.plots": False,
                                                                              "output.step_requests": False})
        if exp.slo is None or exp.slo.empty:
            raise ConfigError("--slo", "capacity needs SLOs: give --slo (e.g. --slo ttft_p99_s=2) or an slo: section")
        return exp
    results = search_deployments(load, raw_cluster, tps, routers, max_replicas, log=log)
    for line in render(results, max_replicas):
        print(line)
    return 0 if any(r.replicas for r in results) else 1


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(flag, f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(flag, f"expected positive integers, got {text!r}")
    return out
