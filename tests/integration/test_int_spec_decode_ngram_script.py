"""benchmarks/spec_decode_ngram.py runs end to end (scaled down, tiny-llama): both engines side by side,
outputs checked identical every round, the acceptance from vLLM's counters, alternating rounds."""
from __future__ import annotations

import json

import pytest

from inttest_helpers import load_benchmark


def test_spec_decode_ngram_script_small(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = load_benchmark("spec_decode_ngram").main([
        "--model", "tiny-llama", "--requests", "6", "--max-tokens", "8", "--rounds", "2", "--max-num-seqs", "3",
        "--min-prompt", "8", "--max-prompt", "20", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "outputs identical in every round (2)" in text and "round 2/2" in text and "speed-up" in text
    data = json.loads(out.read_text())
    assert data["outputs_identical"] and data["output_tokens_per_round"] == 6 * 8
    base, spec = data["engines"]["no speculation"], data["engines"]["ngram k=3"]
    assert len(base["walls_s"]) == len(spec["walls_s"]) == 2
    assert 0.0 <= spec["acceptance_rate"] <= 1.0 and 1.0 <= spec["mean_acceptance_length"] <= 4.0
    assert "acceptance_rate" not in base
    assert data["speedup"] == base["best_wall_s"] / spec["best_wall_s"]


def test_spec_decode_ngram_script_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit) as e:
        load_benchmark("spec_decode_ngram").main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds" in capsys.readouterr().err


def test_spec_decode_ngram_script_starts_no_round_past_its_budget(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = load_benchmark("spec_decode_ngram").main([
        "--model", "tiny-llama", "--requests", "2", "--max-tokens", "4", "--rounds", "3", "--budget-s", "0",
        "--min-prompt", "8", "--max-prompt", "12", "--json", str(out)])
    assert rc == 0
    assert "stopping after 1 of 3 rounds" in capsys.readouterr().out
    assert json.loads(out.read_text())["rounds"] == 1
