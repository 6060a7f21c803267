"""Markdown tables and number formatting shared by the reports (run, sweep, compare, SLO, capacity)."""
from __future__ import annotations

import math
from typing import Any, Optional


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:
            return "-"
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def fmt_to(v: Optional[float], width: Optional[float]) -> str:
    """`v` with as many decimals as an uncertainty of `width` justifies (two significant digits of the
    width): 19.0625 within an interval 1.2 wide is `19.1`, within one 12 wide `19`."""
    if v is None or v != v:
        return "-"
    if not width or width != width or width <= 0 or math.isinf(width):
        return fmt(v)
    decimals = max(0, 1 - math.floor(math.log10(width)))
    return f"{v:,.{decimals}f}"


def fmt_pm(mean: float, lo: float, hi: float, scale: float = 1.0) -> str:
    """`mean ± half-width` of an interval [lo, hi], both with the digits its width justifies."""
    width = (hi - lo) * scale
    return f"{fmt_to(mean * scale, width)} ± {fmt_to(width / 2, width)}"


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) for c in row) + " |")
    return "\n".join(lines)
