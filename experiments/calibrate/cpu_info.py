"""What this host's CPU is, as the CPU calibrations key it: model name, the ISA flags that change
kernel speed, torch's version (read from the package metadata, not by importing torch)."""
from __future__ import annotations

import platform

# flags that select different torch/oneDNN CPU kernels (vector width, bf16 dot products, matrix tiles)
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The `SPEED_FLAGS` this CPU has (Linux /proc/cpuinfo; elsewhere none are known: [])."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in SPEED_FLAGS if flag in have]
    except OSError:
        pass
    return []


def torch_version() -> str:
    import importlib.metadata as md  # noqa: PLC0415  (not `import torch`: seconds, and not needed here)

    try:
        return md.version("torch")
    except md.PackageNotFoundError:
        return "not installed"
