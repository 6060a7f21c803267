"""SimPy's clock arithmetic: a timeout created at `now` with `delay` fires at the float `now + delay`."""
from __future__ import annotations

import math
from typing import Optional


def delay_to(now: float, t: float) -> Optional[float]:
    """A delay d > 0 with now + d == t in floats (SimPy's timeout lands on `now + delay`), or None."""
    d = t - now
    for cand in (d, math.nextafter(d, math.inf), math.nextafter(d, -math.inf)):
        if cand > 0 and now + cand == t:
            return cand
    return None
