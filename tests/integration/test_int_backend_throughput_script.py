"""benchmarks/backend_throughput.py runs end to end (scaled down, tiny-llama) and reports every system."""
from __future__ import annotations

import json

from inttest_helpers import load_benchmark


def test_backend_throughput_script_small(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = load_benchmark("backend_throughput").main([
        "--model", "tiny-llama", "--requests", "4", "--min-prompt", "8", "--max-prompt", "40",
        "--min-output", "4", "--max-output", "12", "--batch-size", "2", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "servetwin (torch backend)" in text and "HF generate (padded batches)" in text
    data = json.loads(out.read_text())
    assert data["requests"] == 4 and 16 <= data["output_tokens"] <= 48
    systems = data["systems"]
    ref = systems["servetwin (torch backend)"]
    assert ref["output_tok_s"] > 0 and ref["servetwin_speedup"] == 1.0
    hf = systems["HF generate (padded batches)"]
    assert hf["output_tok_s"] > 0 and hf["equality"]["total"] == 4
    # fp32 greedy on the same weights: every request matches (the report would show a mismatch)
    assert hf["equality"]["exact"] == 4, hf["equality"]
    cb = systems["HF continuous batching"]
    assert "skipped" in cb or cb["equality"]["total"] == 4
