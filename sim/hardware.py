"""`HardwareSpec`: one accelerator's peaks, memory, interconnect, physical efficiencies and cost-model
coefficients.

Load a preset by name or a YAML file by path with `load_hardware(name_or_path)`; write one with
`save_hardware`. A YAML file has the fields of `HardwareSpec` (`coefficients` and `provenance` are
mappings) and may start from a preset with `base: <preset name>`, in which case only the fields it
gives are replaced (coefficients are merged field by field). Unknown fields are errors naming them.
Provenance is free-form but conventionally holds: source, calibrated, date, device, versions,
samples, residuals, and `coefficients`: `{field: where its value comes from}` for every efficiency
and coefficient (the source it was read from, or what it was fitted on).

`memory_bytes` is the total the CUDA driver reports (`torch.cuda.mem_get_info()[1]`, what vLLM's
`gpu_memory_utilization` multiplies), a little less than the datasheet/nvidia-smi figure.
`peak_flops_fp8` is the dense fp8 tensor peak (0: the device has no fp8 tensor cores; fp8 weights
then run as weight-only quantization at the bf16 peak); `peak_flops_fp4` the dense fp4 one (Blackwell).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_sizing import dtype_bytes
from servetwin.sim.coefficients import CostCoefficients, Efficiency
from servetwin.sim.hardware_presets import HARDWARE_PRESETS
from servetwin.sim.validate import check_keys, check_mapping, non_negative, one_of, positive


@dataclass(slots=True)
class HardwareSpec:
    name: str
    device_type: str  # "cuda" | "cpu"
    peak_flops_bf16: float  # dense bf16/fp16 FLOP/s
    peak_flops_fp32: float
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    interconnect_bandwidth: float = 0.0  # bytes/s per direction per device (tensor parallel)
    interconnect_latency_s: float = 0.0  # per collective
    peak_flops_fp8: float = 0.0  # dense fp8 FLOP/s; 0: no fp8 tensor cores
    peak_flops_fp4: float = 0.0  # dense fp4 (NVFP4 / MXFP4 x MXFP4) FLOP/s; 0: no fp4 tensor cores
    efficiency: Efficiency = field(default_factory=Efficiency)
    coefficients: CostCoefficients = field(default_factory=CostCoefficients)
    provenance: dict[str, Any] = field(default_factory=dict)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak for a compute dtype: fp32, bf16/fp16, or fp8 where the device has fp8 tensor
        cores (elsewhere fp8 computes at the bf16 peak)."""
        nbytes = dtype_bytes(dtype)
        if nbytes == 4:
            return self.peak_flops_fp32
        if nbytes == 1 and self.peak_flops_fp8 > 0:
            return self.peak_flops_fp8
        return self.peak_flops_bf16

    @property
    def has_fp8(self) -> bool:
        return self.peak_flops_fp8 > 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["efficiency"] = self.efficiency.to_dict()
        out["coefficients"] = self.coefficients.to_dict()
        out["provenance"] = copy.deepcopy(self.provenance)
        return out


HARDWARE_FIELDS = tuple(f.name for f in fields(HardwareSpec))


def hardware_from_dict(cfg: Mapping[str, Any], path: str = "hardware") -> HardwareSpec:
    """Build and validate a `HardwareSpec` from a mapping (optionally `base: <preset>`)."""
    cfg = check_mapping(cfg, path)
    check_keys(cfg, HARDWARE_FIELDS + ("base",), path)
    merged: dict[str, Any] = {}
    if "base" in cfg:
        base = cfg["base"]
        one_of(base, HARDWARE_PRESETS, f"{path}.base")
        merged = copy.deepcopy(HARDWARE_PRESETS[base])
    base_coeffs = (CostCoefficients.from_dict(merged["coefficients"], f"{path}.coefficients")
                   if "coefficients" in merged else None)
    base_eff = Efficiency.from_dict(merged["efficiency"], f"{path}.efficiency") if "efficiency" in merged else None
    for key, value in cfg.items():
        if key != "base":
            merged[key] = value
    for key in ("name", "device_type", "peak_flops_bf16", "peak_flops_fp32", "memory_bandwidth",
                "memory_bytes"):
        if key not in merged:
            raise ConfigError(f"{path}.{key}", "required field is missing")
    if not isinstance(merged["name"], str) or not merged["name"]:
        raise ConfigError(f"{path}.name", f"must be a non-empty string, got {merged['name']!r}")
    provenance = check_mapping(merged.get("provenance", {}), f"{path}.provenance")
    return HardwareSpec(
        name=merged["name"],
        device_type=one_of(merged["device_type"], ("cuda", "cpu"), f"{path}.device_type"),
        peak_flops_bf16=positive(merged["peak_flops_bf16"], f"{path}.peak_flops_bf16"),
        peak_flops_fp32=positive(merged["peak_flops_fp32"], f"{path}.peak_flops_fp32"),
        memory_bandwidth=positive(merged["memory_bandwidth"], f"{path}.memory_bandwidth"),
        memory_bytes=int(positive(merged["memory_bytes"], f"{path}.memory_bytes")),
        interconnect_bandwidth=non_negative(merged.get("interconnect_bandwidth", 0.0),
                                            f"{path}.interconnect_bandwidth"),
        interconnect_latency_s=non_negative(merged.get("interconnect_latency_s", 0.0),
                                            f"{path}.interconnect_latency_s"),
        peak_flops_fp8=non_negative(merged.get("peak_flops_fp8", 0.0), f"{path}.peak_flops_fp8"),
        peak_flops_fp4=non_negative(merged.get("peak_flops_fp4", 0.0), f"{path}.peak_flops_fp4"),
        efficiency=Efficiency.from_dict(cfg.get("efficiency", {}), f"{path}.efficiency", base=base_eff),
        coefficients=CostCoefficients.from_dict(merged.get("coefficients", {}),
                                                f"{path}.coefficients", base=base_coeffs),
        provenance=copy.deepcopy(dict(provenance)),
    )


# what users write for a preset: the GPU's common name (`H100`: the SXM part vLLM's numbers come from)
PRESET_ALIASES = {"h100": "h100-sxm", "h100sxm": "h100-sxm", "h100-sxm5": "h100-sxm", "a100": "a100-80g",
                  "a100-80gb": "a100-80g", "a100-sxm": "a100-80g", "h200-sxm": "h200", "h200-141g": "h200"}


def preset_name(name: str) -> Optional[str]:
    """The preset `name` means, case-insensitively and by its common aliases (`H100` -> `h100-sxm`)."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in HARDWARE_PRESETS:
        return key
    return PRESET_ALIASES.get(key) or PRESET_ALIASES.get(key.replace("-", ""))


def unknown_hardware(name: str, where: str = "") -> ConfigError:
    """The error for a name that is neither a preset nor a file, with a did-you-mean."""
    import difflib  # noqa: PLC0415

    close = difflib.get_close_matches(name.lower(), list(HARDWARE_PRESETS) + list(PRESET_ALIASES), n=1, cutoff=0.5)
    dym = f" (did you mean {preset_name(close[0])}?)" if close else ""
    return ConfigError("hardware", f"{name!r} is neither a preset{dym} ({', '.join(HARDWARE_PRESETS)}) nor an "
                       f"existing YAML file{where}; for a GPU without a preset, copy the template in "
                       "docs/hardware_template.md")


def load_hardware(name_or_path: str | Path | HardwareSpec) -> HardwareSpec:
    """A preset name (`h100-sxm`, `h200`, `a100-80g`, `l40s`, `cpu`; any case, `H100` too) or a YAML file."""
    if isinstance(name_or_path, HardwareSpec):
        return name_or_path
    key = str(name_or_path)
    preset = preset_name(key) if not Path(key).is_file() else None
    if preset is not None:
        return hardware_from_dict(HARDWARE_PRESETS[preset], f"hardware[{preset}]")
    path = Path(key)
    if not path.is_file():
        raise unknown_hardware(key)
    from servetwin.core.safe_yaml import load_yaml_file  # noqa: PLC0415

    data = load_yaml_file(path, "hardware")  # bounded: aliases, nesting, size, encoding
    return hardware_from_dict(data if data is not None else {}, "hardware")


def save_hardware(hw: HardwareSpec, path: str | Path) -> Path:
    """Write `hw` (coefficients and provenance included) as YAML that `load_hardware` reads back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(hw.to_dict(), f, sort_keys=False)
    return path
