"""Median |error| of a `servetwin validate benchmarks/published_moe_heldout -o TABLE.md` table, by GPU, by GPU and
shape, load, TP and vLLM version, with the signed medians of throughput and TPOT/ITL (which way the model errs).

    .venv/bin/python benchmarks/published_moe_heldout/breakdown.py TABLE.md [TABLE2.md ...]

Groups are `servetwin validate`'s (`metric_group`): throughput (out_tok_s, tot_tok_s here), TPOT/ITL, TTFT, E2E.
"""
from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from typing import Callable

from servetwin.experiments.validate.published import GROUPS, metric_group

ROW = re.compile(r"\| (M_(\w+?)_tp(\d+)_(\d+)x(\d+)_c(\d+)_(v\d+)) \| (\w+) \| [\d,.]+ \| [\d,.]+ \| ([+-][\d.]+)% \|")
THROUGHPUT, TPOT = metric_group("out_tok_s"), metric_group("tpot_mean")


def read(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        for line in open(path):
            m = ROW.match(line)
            if m:
                rows.append({"case": m.group(1), "gpu": m.group(2), "tp": int(m.group(3)),
                             "shape": f"{m.group(4)}/{m.group(5)}", "conc": int(m.group(6)), "version": m.group(7),
                             "group": metric_group(m.group(8)), "err": float(m.group(9))})
    return rows


def _median(rows: list[dict], group: str, signed: bool = False) -> float:
    values = [r["err"] if signed else abs(r["err"]) for r in rows if r["group"] == group]
    return statistics.median(values) if values else float("nan")


def table(rows: list[dict], key: Callable[[dict], str], title: str) -> str:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    out = [f"| {title} | cases | throughput | TPOT/ITL | TTFT | E2E | signed: throughput / TPOT |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for name in sorted(groups):
        rs = groups[name]
        cells = " | ".join(f"{_median(rs, group):.1f}%" for group in GROUPS)
        out.append(f"| {name} | {len({r['case'] for r in rs})} | {cells} | "
                   f"{_median(rs, THROUGHPUT, True):+.1f}% / {_median(rs, TPOT, True):+.1f}% |")
    return "\n".join(out)


def load_band(conc: int) -> str:
    return "4-8 clients" if conc <= 8 else ("16-32 clients" if conc <= 32 else "64-128 clients")


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    rows = read(argv)
    if not rows:
        raise SystemExit(f"no case rows in {', '.join(argv)} (a `servetwin validate ... -o` table?)")
    print(table(rows, lambda r: "all", "set"), end="\n\n")
    for title, key in (("version", lambda r: r["version"]), ("GPU", lambda r: r["gpu"]),
                       ("GPU, in/out", lambda r: f"{r['gpu']} {r['shape']}"),
                       ("GPU, load", lambda r: f"{r['gpu']} {load_band(r['conc'])}"),
                       ("GPU, TP", lambda r: f"{r['gpu']} TP{r['tp']}")):
        print(table(rows, key, title), end="\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])
