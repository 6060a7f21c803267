"""benchmarks/published_cluster/stage_breakdown.py on a small staged cluster run with a CPU tier: one row per
stage whose parts add up to the TTFT, cache shares ordered (GPU pool <= all caches <= 100%), and the routing
spread within the fleet (no figure of the real cases is asserted)."""
from __future__ import annotations

import re

import yaml
from inttest_helpers import load_benchmark

from servetwin.experiments.cli import main

CASE = {
    "name": "staged_tier", "model": "tiny-llama", "hardware": "h100-sxm",
    # 40 blocks of 16 tokens hold three 200-token prefixes; 12 groups share them: the prefix set exceeds HBM
    "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 16, "max_model_len": 512,
               "num_gpu_blocks": 40},
    "workload": {"requests": 120, "shared_prefix": {"groups": 12, "per_group": 5, "prefix_tokens": 200,
                                                    "suffix_tokens": 20, "order": "inference_perf"},
                 "output_tokens": 8,
                 "arrival": {"type": "stages", "stages": [{"rate": 20, "duration_s": 2}, {"rate": 40, "duration_s": 2}]}},
    "output": {"step_requests": False, "plots": False},
    "cluster": {"instances": [{"name": "r", "count": 3,
                               "engine": {"kv_transfer_config": {
                                   "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}}}],
                "router": {"type": "llm_d", "scorers": [{"type": "tiered-prefix-cache"}, {"type": "queue"}]}},
}


def test_stage_breakdown_rows_add_up(tmp_path):
    case = tmp_path / "staged_tier.yaml"
    case.write_text(yaml.safe_dump(CASE))
    run = tmp_path / "run"
    assert main(["run", str(case), "-o", str(run), "--no-progress", "--no-plots"]) == 0
    rows = load_benchmark("published_cluster/stage_breakdown").stage_rows(str(run))
    table = [r for r in rows if re.match(r"^\| \d", r)]
    assert [r.split("|")[1].strip() for r in table] == ["20", "40"]
    cpu_served = False
    for r in table:
        cached, gpu, served, queue, sched, front, ttft, kv_use, preempted = map(float, r.split("|")[2:-1])
        assert 0.0 <= gpu <= cached + 0.05 and cached <= 100.0 and 0.0 <= served <= 100.0
        assert queue >= 0 and sched > 0 and front >= 0 and abs(ttft - (queue + sched + front)) <= 1.5
        assert 0.0 < kv_use <= 1.0 and preempted >= 0
        cpu_served |= cached > gpu + 1.0
    assert cpu_served  # the CPU tier supplied prefixes the GPU pool did not hold
    # the second stage resends the first stage's prompts (inference_perf order): most come whole from a cache
    assert float(table[-1].split("|")[4]) >= 50.0
    spread = re.search(r"mean ([\d.]+), median ([\d.]+), max (\d+) \((\d+) groups\)", rows[-1])
    assert spread and 1.0 <= float(spread.group(1)) <= int(spread.group(3)) <= 3 and int(spread.group(4)) == 12
