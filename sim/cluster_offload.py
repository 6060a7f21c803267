"""CPU KV offload tiers per cluster instance: each instance's `kv_transfer_config`, and the CPU tier's KV
events on their way to the router.

- An instance's `engine.kv_transfer_config` (or the experiment's, inherited) is parsed per engine copy, as
  `EngineArgs` parses the top-level one: every engine gets its own `KVTransferConfig` (the simulator fills in
  its CPU chunk size, which depends on the instance's TP). Without its own `pcie_link` key, an offloading
  connector moves its chunks over the cluster's `links.cpu_tier` (when given; else `sim/kv_transfer.py`'s
  default).
- The CPU tier's events: vLLM 0.33's OffloadingConnector publishes `BlockStored` / `BlockRemoved` with
  medium "CPU" through the same KV-event stream as the GPU pool's (`offloading_connector.py:231-233`
  `take_events`; `v1/kv_offload/cpu/manager.py:346-353` eviction, :392-420 a completed store), which
  llm-d's precise prefix indexer keeps per pod and tier. `take_cpu_tier_events` drains them after a step.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from servetwin.core.engine.engine_args import check_kv_transfer_config
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.sim.kv_transfer import PCIE_LINK_KEY


def instance_kv_transfer_config(raw: Any, block_size: int, cpu_tier_link: Optional[Any] = None) -> KVTransferConfig:
    """A fresh, checked `KVTransferConfig` for one engine; `cpu_tier_link` (a `servetwin.sim.links.Link`,
    the cluster's `links.cpu_tier`) is the default PCIe link of an offloading connector."""
    data = raw.to_dict() if isinstance(raw, KVTransferConfig) else dict(raw)
    extra = dict(data.get("kv_connector_extra_config") or {})
    if cpu_tier_link is not None and PCIE_LINK_KEY not in extra:
        extra[PCIE_LINK_KEY] = {"bandwidth_gbps": cpu_tier_link.bandwidth_gbps, "latency_us": cpu_tier_link.latency_us,
                                "efficiency": cpu_tier_link.efficiency}
    data["kv_connector_extra_config"] = extra
    return check_kv_transfer_config(data, block_size)


def enable_cpu_tier_events(scheduler: Any) -> bool:
    """Turn the CPU tier's KV events on (False: the engine has no CPU tier)."""
    connector = getattr(scheduler, "connector", None)
    enable = getattr(connector, "enable_kv_cache_events", None)
    if enable is None:
        return False
    enable()
    return True


def take_cpu_tier_events(scheduler: Any) -> list:
    """The CPU tier's events since the last call: ("stored" | "removed", block hash)."""
    connector = getattr(scheduler, "connector", None)
    take = getattr(connector, "take_events", None)
    return take() if take is not None else []


def cpu_tier_totals(engines: Sequence[Any]) -> Optional[dict[str, Any]]:
    """The CPU tiers' figures summed over `engines` (EngineCore): tokens the connectors were asked about
    and supplied (vLLM's external prefix-cache queries / hits), the hit rate, and the bytes loaded and stored
    over PCIe; None when no engine has a CPU tier."""
    totals = [e.executor.kv_transfer_totals() for e in engines if hasattr(e.executor, "kv_transfer_totals")]
    if not any(totals):
        return None
    queries = sum(e.external_prefix_cache_queries for e in engines)
    hits = sum(e.external_prefix_cache_hits for e in engines)
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None,
            "load_bytes": sum(t.get("kv_offload_load_bytes", 0) for t in totals),
            "store_bytes": sum(t.get("kv_offload_store_bytes", 0) for t in totals)}


__all__ = ["instance_kv_transfer_config", "enable_cpu_tier_events", "take_cpu_tier_events", "cpu_tier_totals"]
