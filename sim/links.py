"""KV-transfer links between instances and to a CPU tier: bandwidth and latency per path, as presets with
their sources. A transfer of B bytes over a link takes `latency_s + B / bandwidth_Bps` (one direction; no
contention model yet). Presets give the per-GPU, one-direction line rate of the datasheet; a deployment
reaches less (protocol overhead, NIXL/UCX efficiency), so calibrate `efficiency` against a measurement
before trusting absolute transfer times. The latencies are the order of magnitude of a small message on
that fabric, not measured here.

The cluster YAML parses and records them (`cluster.links`); `kv_transfer` carries the P/D reads between
instances (sim/pd_cluster.py), and a single engine's connector worker takes its links from
`kv_connector_extra_config` (sim/kv_transfer.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from servetwin.core.config_error import ConfigError


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    bandwidth_gbps: float  # gigabits per second, one direction
    latency_us: float
    efficiency: float = 1.0  # share of the line rate a transfer reaches
    source: str = "given in the YAML"

    def transfer_s(self, num_bytes: int) -> float:
        return self.latency_us * 1e-6 + num_bytes * 8 / (self.bandwidth_gbps * 1e9 * self.efficiency)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us,
                "efficiency": self.efficiency, "source": self.source}


LINK_PRESETS: dict[str, Link] = {
    # NVLink 4 (H100 SXM): 900 GB/s total bidirectional per GPU = 450 GB/s = 3600 Gb/s each way
    "nvlink4": Link("nvlink4", 3600.0, 2.0, source="NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s"),
    # H200 SXM: the same NVLink 4 figure
    "nvlink4-h200": Link("nvlink4-h200", 3600.0, 2.0, source="NVIDIA H200 datasheet: NVLink 900 GB/s"),
    # one ConnectX-7 NDR port per GPU (DGX H100: 8 x 400 Gb/s compute fabric)
    "ib-ndr-400": Link("ib-ndr-400", 400.0, 2.0, source="NVIDIA DGX H100 user guide: 8x ConnectX-7 400 Gb/s "
                                                          "InfiniBand/Ethernet"),
    "roce-400g": Link("roce-400g", 400.0, 5.0, source="ConnectX-7 400 GbE per GPU (RoCE v2), as ib-ndr-400"),
    # AWS p5.48xlarge: 3200 Gbps EFA per instance of 8 H100 = 400 Gb/s per GPU
    "efa-p5": Link("efa-p5", 400.0, 15.0, source="AWS EC2 P5 instances page: 3200 Gbps EFAv2 networking "
                                                "(8 GPUs)"),
    # PCIe to host memory (a CPU KV tier): 16 lanes at 32 GT/s (Gen5), 16 GT/s (Gen4), 128b/130b encoding
    "pcie5-x16": Link("pcie5-x16", 504.0, 1.0, source="PCI-SIG PCIe 5.0: 32 GT/s x16, 128b/130b (~63 GB/s)"),
    "pcie4-x16": Link("pcie4-x16", 252.0, 1.0, source="PCI-SIG PCIe 4.0: 16 GT/s x16, 128b/130b (~31.5 GB/s)"),
}
LINK_KEYS = ("bandwidth_gbps", "latency_us", "efficiency", "preset")


def parse_link(raw: Any, path: str) -> Link:
    """A preset name, or a mapping {bandwidth_gbps, latency_us, efficiency} (optionally over `preset`)."""
    if isinstance(raw, str):
        if raw not in LINK_PRESETS:
            raise ConfigError(path, f"unknown link preset {raw!r}; presets: {', '.join(LINK_PRESETS)}")
        return LINK_PRESETS[raw]
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"must be a preset name or a mapping, got {type(raw).__name__}")
    for k in raw:
        if k not in LINK_KEYS:
            raise ConfigError(f"{path}.{k}", f"unknown field; allowed: {', '.join(LINK_KEYS)}")
    base = parse_link(raw["preset"], f"{path}.preset") if "preset" in raw else None
    values = {}
    for key in ("bandwidth_gbps", "latency_us", "efficiency"):
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (key != "latency_us" and v == 0):
                raise ConfigError(f"{path}.{key}", f"must be a positive number, got {v!r}")
            values[key] = float(v)
        elif base is not None:
            values[key] = getattr(base, key)
        elif key != "efficiency":
            raise ConfigError(f"{path}.{key}", "required (or give a preset)")
    if values.get("efficiency", 1.0) > 1.0:
        raise ConfigError(f"{path}.efficiency", f"must be in (0, 1], got {values['efficiency']}")
    return Link(base.name if base else "custom", values["bandwidth_gbps"], values["latency_us"],
                values.get("efficiency", 1.0), base.source + " (overridden)" if base else "given in the YAML")


__all__ = ["Link", "LINK_PRESETS", "parse_link"]
