"""SimPy's clock arithmetic: a timeout created at `now` with `delay` fires at the float `now + delay`."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional


def delay_to(now: float, t: float) -> Optional[float]:
    """A delay d > 0 with now + d == t in floats (SimPy's timeout lands on `now + delay`), or None."""
    d = t - now
    for cand in (d, math.nextafter(d, math.inf), math.nextafter(d, -math.inf)):
        if cand > 0 and now + cand == t:
            return cand
    return None


def call_at(env: Any, t: float, callback: Callable[[Any], None]) -> None:
    """`callback(event)` at SimPy time `t` exactly (not before now): a timeout made now that lands on it or, where no
    delay from now does in floats (now's ulp finer than t's: their sums round past it), one that lands on the float
    before `t` and makes the last hop from there."""
    now = env.now
    delay = 0.0 if t == now else delay_to(now, t)
    if delay is not None:
        env.timeout(delay).callbacks.append(callback)
        return
    before = math.nextafter(t, -math.inf)
    hop = delay_to(now, before) if before > now else None
    if hop is None or delay_to(before, t) is None:
        raise RuntimeError(f"no timeout made at t={now!r} lands on {t!r}")
    env.timeout(hop).callbacks.append(lambda _e: call_at(env, t, callback))
