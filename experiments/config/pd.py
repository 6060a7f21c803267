"""Prefill/decode disaggregation in the `cluster:` section: what a P/D cluster must look like, and each role's
KV connector (vLLM's NixlConnector: `kv_producer` on prefill instances, `kv_consumer` on decode ones).

A cluster is P/D when an instance has `role: prefill` or `role: decode`; it then needs both roles, no
`both` instances (llm-d's P/D guide runs none) and `data_parallel_size: 1` (a rank's KV read is priced
per instance). The engines' `kv_transfer_config` is filled in from the role when an instance does not
give one, its worker reading over `cluster.links.kv_transfer` (default: the simulator's, sim/kv_transfer.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional

from servetwin.core.config_error import ConfigError

# the connector role of each instance role (vLLM --kv-transfer-config kv_role)
KV_ROLE_OF = {"prefill": "kv_producer", "decode": "kv_consumer"}


def check_pd(instances: Sequence[Any], raw_prefill_router: Any, router: Any,
             parse_router: Callable[[Any, str], Any], kv_link: Any = None) -> Optional[Any]:
    """The prefill profile's `RouterConfig` of a P/D cluster (default: the decode profile's settings), None
    otherwise; a misshapen P/D cluster raises a ConfigError naming the field. Each P/D instance's engine
    overrides get its role's `kv_transfer_config` (`pd_kv_transfer_config`)."""
    roles = [i.role for i in instances]
    if all(r == "both" for r in roles):
        if raw_prefill_router is not None:
            raise ConfigError("cluster.prefill_router", "only with prefill and decode instances (role: prefill / decode)")
        return None
    for i, inst in enumerate(instances):
        path = f"cluster.instances[{i}]"
        if inst.role == "both":
            raise ConfigError(f"{path}.role", "'both' next to prefill/decode instances is not simulated "
                                              "(give every instance role prefill or decode)")
        if inst.data_parallel_size != 1:
            raise ConfigError(f"{path}.data_parallel_size", "prefill/decode instances run with data_parallel_size 1 "
                                                            "(use count for more instances)")
        config = pd_kv_transfer_config(inst.role, inst.engine.get("kv_transfer_config"), kv_link, f"{path}.engine")
        inst.engine["kv_transfer_config"] = config.to_dict()
    for role in ("prefill", "decode"):
        if role not in roles:
            raise ConfigError("cluster.instances", f"a prefill/decode cluster needs a {role} instance (role: {role})")
    raw_prefill_params = raw_prefill_router.get("params") if isinstance(raw_prefill_router, dict) else None
    for params, path in ((router.params, "cluster.router"), (raw_prefill_params, "cluster.prefill_router")):
        if isinstance(params, dict) and "in_flight_load" in params:
            # (llm-d charges the client's request at the EPP and releases it at the first token the decode pod
            # streams, after the prefill pod's work and the KV read: a charge across both profiles, not modelled)
            raise ConfigError(f"{path}.params.in_flight_load", "not simulated on the prefill/decode path "
                                                               "(only for instances with role both)")
    if raw_prefill_router is None:
        return dataclasses.replace(router, scorers=list(router.scorers), filters=list(router.filters),
                                   params=dict(router.params), path="cluster.router")  # (its settings are router's)
    return parse_router(raw_prefill_router, "cluster.prefill_router")


def pd_kv_transfer_config(role: str, given: Any, kv_link: Any, path: str) -> Any:
    """The `kv_transfer_config` of an instance of `role`: the one it gives (a NixlConnector whose kv_role fits
    the role), else NixlConnector with the role's kv_role reading over `kv_link` (a sim.links.Link or None)."""
    from servetwin.core.kv_connector.config import KVTransferConfig  # noqa: PLC0415

    want = KV_ROLE_OF[role]
    if given is None:
        extra = {} if kv_link is None else {"kv_link": {k: getattr(kv_link, k) for k in ("bandwidth_gbps", "latency_us", "efficiency")}}
        return KVTransferConfig("NixlConnector", want, kv_connector_extra_config=extra)
    try:
        config = KVTransferConfig.from_dict(given)
    except ConfigError as e:
        raise e.within(path) from None
    if config.kv_connector != "NixlConnector":
        raise ConfigError(f"{path}.kv_transfer_config.kv_connector",
                          f"a {role} instance needs NixlConnector, got {config.kv_connector!r}")
    if config.kv_role not in (want, "kv_both"):
        raise ConfigError(f"{path}.kv_transfer_config.kv_role", f"a {role} instance needs {want}, got {config.kv_role!r}")
    return config


__all__ = ["check_pd", "pd_kv_transfer_config", "KV_ROLE_OF"]
