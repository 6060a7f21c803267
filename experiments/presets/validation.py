"""What each hardware preset was validated on, and the caveat a run on a preset not fitted on its own
GPU's runs prints (`servetwin presets` shows the same per preset)."""
from __future__ import annotations

from typing import Any, Iterable


def preset_validation(name: str) -> tuple[bool, str]:
    """(fitted on runs of its own GPU, what it was validated on with its held-out error)."""
    from servetwin.sim.hardware_presets import HARDWARE_PRESETS  # noqa: PLC0415

    prov = HARDWARE_PRESETS[name].get("provenance") or {}
    return bool(prov.get("calibrated")), prov.get("validated_on") or prov.get("source") or "-"


def preset_caveats(exp: Any) -> list[str]:
    """One line per hardware preset the simulator runs on (the config's, or a sweep's) that was not
    fitted on a run of its GPU."""
    from servetwin.sim.hardware_presets import HARDWARE_PRESETS  # noqa: PLC0415

    if "sim" not in (exp.backends or []):
        return []
    names: Iterable[Any] = [exp.hardware, *((getattr(exp, "sweep", None) or {}).get("hardware") or [])]
    out = []
    for name in dict.fromkeys(n for n in names if isinstance(n, str) and n in HARDWARE_PRESETS):
        fitted, validated = preset_validation(name)
        if not fitted and name != "cpu":  # cpu: the run's own calibration notes say it
            out.append(f"hardware {name!r} is not fitted on a run of its own GPU: {validated} "
                       "(`servetwin presets hardware`)")
    return out
