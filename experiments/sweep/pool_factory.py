"""`make_pool`: the local process pool or Ray (a module of its own, so `pool` and `ray_pool` import no cycle)."""
from __future__ import annotations

from typing import Any

from servetwin.experiments.sweep.pool import LocalPool, PointPool


def make_pool(jobs: int = 1, ray: Any = None) -> PointPool:
    """`ray`: None/False for the local pool; True for a local Ray instance; an address string to join a
    cluster (`ray start --head` address, `auto`, or `ray://host:port`)."""
    if ray is None or ray is False:
        return LocalPool(jobs)
    from servetwin.experiments.sweep.ray_pool import RayPool  # noqa: PLC0415

    return RayPool(None if ray is True else str(ray))
