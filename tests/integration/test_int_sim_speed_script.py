"""benchmarks/sim_speed.py runs end to end (scaled down) with every section (no speed is asserted)."""
from __future__ import annotations

import re

from inttest_helpers import load_benchmark


def test_sim_speed_script_small(capsys):
    load_benchmark("sim_speed").main(["--requests", "40", "--variants", "--breakdown", "--bounds"])
    text = capsys.readouterr().out
    for label in ("as configured", "no implicit decodes", "sync + fast-forward", "sync, step by step"):
        row = re.search(rf"^\s*{re.escape(label)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", text, re.M)
        assert row, (label, text)
        assert float(row.group(1)) > 0 and float(row.group(3)) > 0
    assert "floor run" in text and "decode rows:" in text
    hashes = re.search(r"block hashes: ([\d,]+)", text)
    assert hashes and int(hashes.group(1).replace(",", "")) > 40
    assert "at most" in text and "1000x budget" in text
