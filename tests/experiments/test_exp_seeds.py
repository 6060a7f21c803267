"""Seeds on `servetwin run` and `servetwin sweep`: one folder per seed, mean / spread / 95% interval."""
import json

import pandas as pd
from exptest_helpers import tiny, write_yaml

from servetwin.experiments.cli import main
from servetwin.experiments.sweep.sweep import LATENCY_MD_COLUMNS

ONLINE = {"workload__arrival": {"type": "poisson", "rate": 50.0}, "workload__requests": 8}


def test_run_with_seeds_writes_each_seed_and_the_statistics(tmp_path, capsys):
    path = write_yaml(tmp_path / "s.yaml", tiny(**ONLINE, slo={"ttft_p99_s": 0.5}))
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--seeds", "3", "--no-progress", "--no-plots"]) == 0
    per_seed = pd.read_csv(out / "seeds.csv")
    assert list(per_seed.seed) == [0, 1, 2] and (per_seed.status == "ok").all()
    for s in (0, 1, 2):
        seed_summary = json.loads((out / f"seed={s}" / "summary.json").read_text())
        assert seed_summary["backends"]["sim"]["ttft_s"]["p99"] == per_seed.ttft_p99_s[s]
    stats = json.loads((out / "summary.json").read_text())["backends"]["sim"]
    ttft = stats["ttft_p99_s"]
    assert ttft["n"] == 3 and ttft["mean"] == per_seed.ttft_p99_s.mean()
    assert ttft["ci_lo"] < ttft["mean"] < ttft["ci_hi"]
    assert per_seed.duration_s.nunique() == 3  # different draws
    assert stats["slo_met"]["mean"] == 1.0 and stats["goodput_req_s"]["n"] == 3
    assert "ttft_p99_s" in (out / "seeds.md").read_text()
    assert "sim: 3/3 seeds ok" in capsys.readouterr().out


def test_sweep_with_seeds_aggregates_per_point_and_keeps_every_seed(tmp_path):
    path = write_yaml(tmp_path / "s.yaml", tiny(**ONLINE, seeds=[3, 4], sweep={"engine.max_num_seqs": [1, 4]}))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 0
    rows = pd.read_csv(out / "sweep_seeds.csv")
    assert len(rows) == 4 and set(rows.seed) == {3, 4}
    table = pd.read_csv(out / "sweep.csv")
    assert list(table.point) == ["max_num_seqs=1", "max_num_seqs=4"] and (table.seeds_ok == 2).all()
    for col in LATENCY_MD_COLUMNS:  # p50/p90/p99 of TTFT, TPOT, ITL, E2E with their intervals
        assert {col, f"{col}_std", f"{col}_ci_lo", f"{col}_ci_hi"} <= set(table.columns)
    one = rows[rows.point == "max_num_seqs=1"]
    assert table.ttft_p99_s[0] == one.ttft_p99_s.mean()
    assert (out / "max_num_seqs=4" / "seed=4" / "report.md").is_file()
    assert "± " in (out / "sweep.md").read_text()


def test_sweep_without_seeds_carries_every_percentile(tmp_path):
    path = write_yaml(tmp_path / "s.yaml", tiny(sweep={"engine.max_num_seqs": [1, 4]}))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "-o", str(out), "--no-progress", "--no-plots"]) == 0
    table = pd.read_csv(out / "sweep.csv")
    assert set(LATENCY_MD_COLUMNS) <= set(table.columns) and "seed" not in table.columns
    md = (out / "sweep.md").read_text()
    assert all(c in md for c in LATENCY_MD_COLUMNS)
