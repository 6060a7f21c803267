"""Human units for durations, shared by the console, the reports and the plot axes.

A latency of 37296.1 ms reads better as 37.3 s, and 0.00042 s as 420 us: the unit follows the value.
"""
from __future__ import annotations

import math
from typing import Optional

# (upper bound in seconds, divisor, unit): the first row whose bound exceeds |v| is used
_UNITS = ((1e-3, 1e-6, "us"), (1.0, 1e-3, "ms"), (120.0, 1.0, "s"), (7200.0, 60.0, "min"), (math.inf, 3600.0, "h"))


def unit_for(seconds: float) -> tuple[float, str]:
    """(divisor, unit name) for a magnitude in seconds: us below 1 ms, ms below 1 s, s below 2 min, ..."""
    a = abs(seconds)
    for bound, div, name in _UNITS:
        if a < bound:
            return div, name
    return 3600.0, "h"


def format_seconds(v: Optional[float], digits: int = 3) -> str:
    """`0.0371` -> `37.1 ms`, `37.2961` -> `37.3 s`, `None` -> `-`; `digits` significant digits."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if v == 0:
        return "0 s"
    div, name = unit_for(v)
    x = v / div
    text = f"{x:.{digits}g}"
    if "e" in text:  # never scientific notation in a duration
        text = f"{x:.0f}"
    return f"{text} {name}"


def axis_unit(max_seconds: float) -> tuple[float, str]:
    """(divisor, unit) for a linear time axis spanning [0, max_seconds]: the unit of its largest value."""
    if not max_seconds or not math.isfinite(max_seconds):
        return 1.0, "s"
    if 1.0 <= max_seconds < 600.0:  # seconds read better than fractions of minutes up to 10 min
        return 1.0, "s"
    return unit_for(max_seconds)
