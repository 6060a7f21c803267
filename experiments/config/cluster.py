"""The `cluster:` section of an experiment YAML: instances behind a router, and the links between them.

Absent, the experiment is one engine (as before). Present:

    cluster:
      instances:
        - name: replica            # default i0, i1, ...
          count: 16                # copies of this instance (named replica-0 ... replica-15)
          role: both               # prefill | decode | both (P/D: all instances prefill or decode)
          data_parallel_size: 1    # vLLM --data-parallel-size (internal LB across the ranks)
          hardware: h100-sxm       # default: the top-level hardware
          engine: {tensor_parallel_size: 1}   # over the top-level engine settings
      router:
        type: llm_d                # round_robin | random | least_loaded | llm_d | an entry point name
        scrape_interval_s: 0.05
        filters: [{type: prefix-cache-affinity, threshold: 0.8}]
        scorers: [{type: prefix-cache, weight: 3}, {type: queue, weight: 2}]
      prefill_router: {type: llm_d, scorers: [{type: token-load}]}   # P/D: the prefill profile
      links:
        kv_transfer: roce-400g     # a preset of servetwin.sim.links, or {bandwidth_gbps, latency_us}
        cpu_tier: pcie5-x16

With prefill and decode instances, `router` is llm-d's decode profile and `prefill_router` its prefill
profile (default: the same settings as `router`); see servetwin.sim.pd_cluster.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from servetwin.core.config_error import ConfigError

ROLES = ("prefill", "decode", "both")
INSTANCE_KEYS = ("name", "count", "role", "data_parallel_size", "data_parallel_lb", "data_parallel_size_local",
                 "hardware", "engine")
# vLLM's DP load-balancing modes: internal (one API server and its balancer over all ranks),
# external (--data-parallel-external-lb: every rank its own endpoint), hybrid (--data-parallel-hybrid-lb: one
# endpoint per node of `data_parallel_size_local` ranks, balanced inside)
DP_LB_MODES = ("internal", "external", "hybrid")
ROUTER_KEYS = ("type", "scrape_interval_s", "scorers", "filters", "params", "pd_threshold_tokens")
LINK_KEYS = ("kv_transfer", "cpu_tier")
BUILTIN_ROUTERS = ("round_robin", "random", "least_loaded", "llm_d")
# llm-d's P/D decider: prefill remotely only above this many non-cached prompt tokens
# (llm-d-inference-scheduler deploy/config/pd-epp-config.yaml, prefix-based-pd-decider nonCachedTokens: 16)
DEFAULT_PD_THRESHOLD_TOKENS = 16
MAX_SIM_WORKERS = 8  # (sim/cluster_parallel.py MAX_WORKERS; not imported: the config stays free of simpy)


@dataclass(slots=True)
class InstanceConfig:
    name: str
    count: int = 1
    role: str = "both"
    data_parallel_size: int = 1
    data_parallel_lb: str = "internal"
    data_parallel_size_local: Optional[int] = None  # hybrid: ranks per node (endpoint)
    hardware: Any = None  # None: the experiment's
    engine: dict[str, Any] = field(default_factory=dict)  # overrides of the experiment's engine settings
    hardware_spec: Any = None  # servetwin.sim.hardware.HardwareSpec, set when the config is checked


@dataclass(slots=True)
class PluginConfig:
    type: str
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RouterConfig:
    type: str = "round_robin"
    scrape_interval_s: float = 0.05  # GIE DefaultRefreshMetricsInterval
    scorers: list[PluginConfig] = field(default_factory=list)
    filters: list[PluginConfig] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)  # an entry-point router's parameters
    pd_threshold_tokens: int = DEFAULT_PD_THRESHOLD_TOKENS  # the P/D decider's threshold (sim/pd_cluster.py)
    path: str = "cluster.router"  # where it is in the YAML (errors name it): cluster.router | cluster.prefill_router


@dataclass(slots=True)
class ClusterConfig:
    instances: list[InstanceConfig]
    router: RouterConfig
    links: dict[str, Any]  # path -> servetwin.sim.links.Link
    prefill_router: Optional[RouterConfig] = None  # P/D: the prefill profile (None: no P/D)
    # the simulation's worker processes (sim/cluster_parallel.py): "auto" (two where two CPUs are free, the run has
    # 1,000 requests or more and the cluster can be split), or a count; every count gives the same results
    sim_workers: int | str = "auto"

    @property
    def disaggregated(self) -> bool:
        return any(i.role != "both" for i in self.instances)

    def expanded(self) -> list[tuple[str, InstanceConfig]]:
        """Every instance copy with its name (`name-k` when count > 1), in order."""
        out = []
        for inst in self.instances:
            if inst.count == 1:
                out.append((inst.name, inst))
            else:
                out.extend((f"{inst.name}-{k}", inst) for k in range(inst.count))
        return out

    @staticmethod
    def endpoint_ranks(name: str, inst: InstanceConfig) -> list[tuple[str, int]]:
        """An instance copy's endpoints as (name, ranks behind it), by its DP load-balancing mode."""
        dp = inst.data_parallel_size
        if inst.data_parallel_lb == "internal" or dp == 1:
            return [(name, dp)]
        local = 1 if inst.data_parallel_lb == "external" else inst.data_parallel_size_local
        tag = "r" if local == 1 else "n"
        return [(f"{name}-{tag}{k}", local) for k in range(dp // local)]

    def num_gpus(self, base_tensor_parallel_size: int = 1) -> int:
        """GPUs of the whole cluster (`base_tensor_parallel_size`: the experiment's, where an instance keeps it)."""
        return sum(i.count * i.data_parallel_size * int(i.engine.get("tensor_parallel_size", base_tensor_parallel_size))
                   for i in self.instances)


def _mapping(v: Any, path: str) -> Mapping:
    if not isinstance(v, Mapping):
        raise ConfigError(path, f"must be a mapping, got {type(v).__name__}")
    return v


def _keys(cfg: Mapping, allowed: tuple[str, ...], path: str) -> None:
    for k in cfg:
        if k not in allowed:
            raise ConfigError(f"{path}.{k}", f"unknown field; allowed: {', '.join(allowed)}")


def _pos_int(v: Any, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(path, f"must be an integer >= 1, got {v!r}")
    return v


def _number(v: Any, path: str, low: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > low:
        raise ConfigError(path, f"must be a number > {low}, got {v!r}")
    return float(v)


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(path, f"must be a non-empty string, got {v!r}")
    return v


def _instance(raw: Any, i: int, engine_check: Any) -> InstanceConfig:
    path = f"cluster.instances[{i}]"
    cfg = _mapping(raw, path)
    _keys(cfg, INSTANCE_KEYS, path)
    inst = InstanceConfig(_str(cfg.get("name", f"i{i}"), f"{path}.name"))
    if "count" in cfg:
        inst.count = _pos_int(cfg["count"], f"{path}.count")
    if "data_parallel_size" in cfg:
        inst.data_parallel_size = _pos_int(cfg["data_parallel_size"], f"{path}.data_parallel_size")
    lb = cfg.get("data_parallel_lb", "internal")
    if lb not in DP_LB_MODES:
        raise ConfigError(f"{path}.data_parallel_lb", f"must be one of {', '.join(DP_LB_MODES)}, got {lb!r}")
    inst.data_parallel_lb = lb
    if "data_parallel_size_local" in cfg:
        if lb != "hybrid":
            raise ConfigError(f"{path}.data_parallel_size_local", "only with data_parallel_lb: hybrid")
        local = _pos_int(cfg["data_parallel_size_local"], f"{path}.data_parallel_size_local")
        if inst.data_parallel_size % local:
            raise ConfigError(f"{path}.data_parallel_size_local", f"{local} does not divide data_parallel_size "
                                                                  f"{inst.data_parallel_size}")
        inst.data_parallel_size_local = local
    elif lb == "hybrid":
        raise ConfigError(f"{path}.data_parallel_size_local", "required with data_parallel_lb: hybrid (ranks per node)")
    role = cfg.get("role", "both")
    if role not in ROLES:
        raise ConfigError(f"{path}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    inst.role = role
    inst.hardware = cfg.get("hardware")
    inst.engine = engine_check(cfg.get("engine") or {}, f"{path}.engine")
    return inst


def _plugins(raw: Any, path: str) -> list[PluginConfig]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(path, f"must be a list of {{type, weight, ...}}, got {type(raw).__name__}")
    out = []
    for j, item in enumerate(raw):
        p = f"{path}[{j}]"
        if isinstance(item, str):
            item = {"type": item}
        cfg = dict(_mapping(item, p))
        kind = _str(cfg.pop("type", None), f"{p}.type")
        weight = cfg.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{p}.weight", f"must be a number, got {weight!r}")
        out.append(PluginConfig(kind, float(weight), cfg))
    return out


def _router(raw: Any, path: str = "cluster.router") -> RouterConfig:
    cfg = _mapping(raw or {}, path)
    _keys(cfg, ROUTER_KEYS, path)
    r = RouterConfig(_str(cfg.get("type", "round_robin"), f"{path}.type"), path=path)
    if "scrape_interval_s" in cfg:
        r.scrape_interval_s = _number(cfg["scrape_interval_s"], f"{path}.scrape_interval_s")
    r.scorers = _plugins(cfg.get("scorers"), f"{path}.scorers")
    r.filters = _plugins(cfg.get("filters"), f"{path}.filters")
    r.params = dict(_mapping(cfg.get("params") or {}, f"{path}.params"))
    if "pd_threshold_tokens" in cfg:
        r.pd_threshold_tokens = _pos_int(cfg["pd_threshold_tokens"], f"{path}.pd_threshold_tokens")
    if r.type == "llm_d" and not r.scorers:
        raise ConfigError(f"{path}.scorers", "llm_d needs at least one scorer (e.g. [{type: queue}])")
    if r.type != "llm_d" and (r.scorers or r.filters):
        # (named at the type: most often a misspelt llm_d, e.g. 'llmd', whose scorers are right)
        raise ConfigError(f"{path}.type", f"{r.type!r} takes no scorers or filters (the llm_d router's)")
    return r


def parse_cluster(raw: Any, engine_check: Any) -> Optional[ClusterConfig]:
    """The typed section (None when absent). `engine_check(mapping, path)` validates an instance's engine
    overrides as the top-level `engine:` fields are validated."""
    if raw is None:
        return None
    from servetwin.sim.links import parse_link  # noqa: PLC0415  (no torch: cheap)

    cfg = _mapping(raw, "cluster")
    _keys(cfg, ("instances", "router", "links", "prefill_router", "sim_workers"), "cluster")
    insts = cfg.get("instances")
    if not isinstance(insts, list) or not insts:
        raise ConfigError("cluster.instances", "must be a non-empty list of instances")
    instances = [_instance(x, i, engine_check) for i, x in enumerate(insts)]
    names = [i.name for i in instances]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"cluster.instances[{i}].name", f"{name!r} is used twice")
    links_raw = _mapping(cfg.get("links") or {}, "cluster.links")
    _keys(links_raw, LINK_KEYS, "cluster.links")
    links = {k: parse_link(v, f"cluster.links.{k}") for k, v in links_raw.items()}
    router = _router(cfg.get("router"))
    from servetwin.experiments.config.pd import check_pd  # noqa: PLC0415

    prefill_router = check_pd(instances, cfg.get("prefill_router"), router, _router, links.get("kv_transfer"))
    return ClusterConfig(instances, router, links, prefill_router, _sim_workers(cfg.get("sim_workers", "auto")))


def _sim_workers(v: Any) -> int | str:
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIM_WORKERS:
        raise ConfigError("cluster.sim_workers", f"must be 'auto' or an integer from 1 to {MAX_SIM_WORKERS}, got {v!r}")
    return v


def instance_engine_args(base: Any, inst: InstanceConfig, hardware_spec: Any, links: Optional[dict] = None) -> Any:
    """An instance's `EngineArgs`: the experiment's with the instance's overrides and hardware; an instance's
    own `kv_transfer_config` (e.g. a CPU tier, docs/cluster.md) parsed as EngineArgs parses the top-level one,
    its PCIe link defaulting to the cluster's `links.cpu_tier`."""
    args = dataclasses.replace(base, **inst.engine, hardware=hardware_spec)
    if args.kv_transfer_config is not None:  # each engine its own copy (the simulator fills in its chunk size)
        from servetwin.sim.cluster_offload import instance_kv_transfer_config  # noqa: PLC0415

        args.kv_transfer_config = instance_kv_transfer_config(args.kv_transfer_config, args.block_size,
                                                              (links or {}).get("cpu_tier"))
    return args


__all__ = ["DP_LB_MODES", "ClusterConfig", "InstanceConfig", "RouterConfig", "PluginConfig", "parse_cluster",
           "instance_engine_args", "ROLES", "BUILTIN_ROUTERS", "DEFAULT_PD_THRESHOLD_TOKENS"]
