"""`servetwin run` of the shipped MoE + hybrid-attention config (gpt-oss-20b on a simulated H100-SXM):
the pool is sized from the model's two KV cache groups and the report says so."""
import json

from exptest_helpers import CONFIGS

from servetwin.experiments.cli import main


def test_gpt_oss_20b_on_h100_runs_and_reports_its_kv_cache_groups(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", str(CONFIGS / "moe_gpt_oss_20b_h100.yaml"), "--requests", "60", "--output", str(out),
                 "--no-progress", "--no-plots"]) == 0
    summary = json.loads((out / "summary.json").read_text())["backends"]["sim"]
    assert summary["completed"] == summary["requests"] == 60
    pool = summary["kv_pool"]
    assert pool["kv_cache_groups"] == "sliding_window 128 + full_attention (2 KV cache groups x 12 layers)"
    # a block is a 16-token page of each of a group's 12 layers (8 KV heads x 64, bf16: K and V)
    assert pool["bytes_per_block"] == 12 * 16 * 2 * 8 * 64 * 2
    assert summary["num_gpu_blocks"] * pool["bytes_per_block"] <= pool["available_kv_bytes"]
    report = (out / "report.md").read_text()
    assert "its blocks serve the KV cache groups sliding_window 128 + full_attention" in report
