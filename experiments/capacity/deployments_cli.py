"""The CLI path of `servetwin capacity` for a config with a `cluster:` section: which deployments to search
(aggregated replicas, prefill/decode instances), from which flags, and the ranked table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from servetwin.core.config_error import ConfigError
from servetwin.experiments.capacity.deployments import (aggregated_template, deployment_values, int_list, rank_key,
                                                        render, router_choices, search_deployments)
from servetwin.experiments.capacity.pd_deployments import pd_templates, pd_values, run_pd_search

PD_FLAGS = (("prefill_tp", "--prefill-tp"), ("decode_tp", "--decode-tp"), ("max_prefill", "--max-prefill"),
            ("max_decode", "--max-decode"))


@dataclass(slots=True)
class DeploymentSpace:
    """What `capacity` searches on a cluster config (empty TP lists: that kind of deployment is not searched)."""
    tps: list[int]  # aggregated: TP per replica
    prefill_tps: list[int]
    decode_tps: list[int]
    routers: list[dict[str, Any]]
    max_replicas: int
    max_prefill: int
    max_decode: int


def _is_pd(raw_cluster: dict[str, Any]) -> bool:
    return any(dict(i).get("role", "both") != "both" for i in raw_cluster.get("instances") or [])


def _own_tp(raw: dict[str, Any], inst: dict[str, Any]) -> int:
    engine = {**dict(raw.get("engine") or {}), **dict(inst.get("engine") or {})}
    return int(engine.get("tensor_parallel_size", 1))


def _at_least_one(value: Any, flag: str) -> int:
    if int(value) < 1:
        raise ConfigError(flag, f"must be at least 1, got {value}")
    return int(value)


def deployment_space(args: Any, raw: dict[str, Any]) -> DeploymentSpace:
    """The flags read once, before any simulation: a bad flag is a ConfigError naming it (exit code 2)."""
    raw_cluster = dict(raw.get("cluster") or {})
    pd = bool(args.pd or args.pd_only or _is_pd(raw_cluster))
    if not pd:
        given = [flag for attr, flag in PD_FLAGS if getattr(args, attr) is not None]
        if given:
            raise ConfigError(given[0], "sets prefill/decode deployments: add --pd (or give the config prefill and "
                                        "decode instances)")
    if args.pd_only and args.tp:
        raise ConfigError("--tp", "sets the TP of aggregated replicas, which --pd-only does not search")
    max_replicas = _at_least_one(args.max_replicas, "--max-replicas")
    tps = []
    if not args.pd_only:
        tps = int_list(args.tp, "--tp") if args.tp else [_own_tp(raw, aggregated_template(raw_cluster))]
    prefill_tps, decode_tps = [], []
    if pd:
        templates = pd_templates(raw_cluster)
        prefill_tps = (int_list(args.prefill_tp, "--prefill-tp") if args.prefill_tp
                       else [_own_tp(raw, templates["prefill"])])
        decode_tps = (int_list(args.decode_tp, "--decode-tp") if args.decode_tp
                      else [_own_tp(raw, templates["decode"])])
    return DeploymentSpace(
        tps, prefill_tps, decode_tps, router_choices(raw_cluster, args.router), max_replicas,
        _at_least_one(args.max_prefill if args.max_prefill is not None else max_replicas, "--max-prefill"),
        _at_least_one(args.max_decode if args.max_decode is not None else max_replicas, "--max-decode"))


def search_space(load: Callable[[dict[str, Any]], Any], raw_cluster: dict[str, Any], space: DeploymentSpace,
                 log: Callable[[str], None], **kw: Any) -> list[Any]:
    """Every deployment's cheapest instance counts, aggregated and P/D together, ranked cheapest first."""
    results: list[Any] = []
    if space.tps:
        results += search_deployments(load, raw_cluster, space.tps, space.routers, space.max_replicas, log=log, **kw)
    if space.prefill_tps:
        results += run_pd_search(load, raw_cluster, space.prefill_tps, space.decode_tps, space.routers,
                                 space.max_prefill, space.max_decode, log=log, **kw)
    return sorted(results, key=rank_key)


def check_configs(load: Callable[[dict[str, Any]], Any], raw_cluster: dict[str, Any], space: DeploymentSpace) -> None:
    """Parse the first deployment of each kind before any simulation: a config that cannot take that shape
    (a P/D instance's connector, a missing SLO) fails at once, naming the field, not after other searches ran."""
    router = space.routers[0]
    if space.tps:
        load(deployment_values(aggregated_template(raw_cluster), 1, space.tps[0], router))
    if space.prefill_tps:
        load(pd_values(pd_templates(raw_cluster), (1, 1), (space.prefill_tps[0], space.decode_tps[0]), router))


def run_deployment_capacity(args: Any, exp: Any, log: Callable[[str], None]) -> int:
    """Search, print the ranked table with the cheapest and the runner-up, and write the run folder
    (`-o`, default runs/<name>.capacity: deployments_report.py); 0 when a deployment meets the SLOs."""
    import os  # noqa: PLC0415

    from servetwin.experiments.capacity.deployments import evaluate_deployment  # noqa: PLC0415
    from servetwin.experiments.capacity.deployments_report import probe_row, write_deployments  # noqa: PLC0415
    from servetwin.experiments.config.schema import load_config, load_raw_config  # noqa: PLC0415
    from servetwin.experiments.config.slo import parse_slo, parse_slo_args  # noqa: PLC0415
    from servetwin.experiments.run.run_folder import RunFolder  # noqa: PLC0415

    raw = load_raw_config(args.config, args.overrides)
    raw_cluster = dict(raw.get("cluster") or {})
    slo = parse_slo_args(args.slo) if args.slo else None
    space = deployment_space(args, raw)

    def load(values: dict[str, Any]) -> Any:
        vals = dict(values)
        if slo is not None:
            vals["slo"] = slo
        exp = load_config(args.config, overrides=list(args.overrides), values={**vals, "output.plots": False,
                                                                              "output.step_requests": False})
        if exp.slo is None or exp.slo.empty:
            raise ConfigError("--slo", "capacity needs SLOs: give --slo (e.g. --slo ttft_p99_s=2) or an slo: section")
        return exp
    check_configs(load, raw_cluster, space)
    probes: list[dict[str, Any]] = []

    def evaluate(probe_exp: Any) -> list[dict[str, Any]]:
        checks = evaluate_deployment(probe_exp)
        probes.append(probe_row(probe_exp, checks))
        return checks

    out = args.output or os.path.join("runs", f"{exp.name}.capacity")
    slo_given = (parse_slo(slo, "--slo") if slo is not None else exp.slo).to_dict()  # (seconds, as numbers)
    with RunFolder(out, overwrite=args.overwrite) as folder:  # (a folder it may not write: refused before the search)
        try:
            results = search_space(load, raw_cluster, space, log, evaluate=evaluate)
        except KeyboardInterrupt:
            write_deployments(folder, exp, slo_given, None, probes, interrupted=True)
            print(f"interrupted: {out}/ has the {len(probes)} deployments simulated so far (probes.csv); "
                  "capacity.json says \"interrupted\": true", flush=True)
            raise
        write_deployments(folder, exp, slo_given, results, probes, interrupted=False)
    for line in render(results):
        print(line)
    print(f"wrote {out}/: {folder.describe()}")
    return 0 if any(r.gpus for r in results) else 1
