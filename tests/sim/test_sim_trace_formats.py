"""Trace import: Azure, BurstGPT and Mooncake files, a column mapping, and errors that list the columns."""
import json

import pytest

from servetwin.sim.trace_file import load_trace
from servetwin.sim.workload import build_workload


def _write(path, text):
    path.write_text(text)
    return path


def test_azure_datetimes_with_seven_fractional_digits(tmp_path):
    p = _write(tmp_path / "azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
               "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
               "2023-11-16 18:15:46.1805900,100,5\n")
    recs = load_trace(p)
    assert [r.arrival_s for r in recs] == pytest.approx([0.0, 0.5, 4.814579])
    assert [(r.prompt_tokens, r.output_tokens) for r in recs] == [(100, 5), (374, 44), (396, 109)]


def test_burstgpt_skips_failed_requests(tmp_path):
    p = _write(tmp_path / "burst.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
               "5,ChatGPT,472,18,490,Conversation log\n7.5,GPT-4,1087,0,1087,Conversation log\n"
               "9,ChatGPT,200,30,230,API log\n")
    recs = load_trace(p)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in recs] == [(0.0, 472, 18), (4.0, 200, 30)]


def test_mooncake_hash_ids_replay_through_the_prefix_cache(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1200, "output_length": 4, "hash_ids": [0, 1, 2]},
             {"timestamp": 3052, "input_length": 1100, "output_length": 4, "hash_ids": [0, 1, 3]},
             {"timestamp": 4000, "input_length": 600, "output_length": 4, "hash_ids": [7, 8]}]
    p = _write(tmp_path / "mc.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    recs = load_trace(p)
    assert [r.arrival_s for r in recs] == pytest.approx([0.0, 3.052, 4.0]) and recs[1].hash_ids == (0, 1, 3)
    _, reqs = build_workload({"arrival": {"type": "trace", "path": str(p)}, "seed": 0}, vocab_size=1000)
    a, b, c = (r.prompt_token_ids for r in reqs)
    assert len(a) == 1200 and len(b) == 1100 and len(c) == 600
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]  # blocks 0, 1 shared; 2 vs 3 differ
    assert a[:512] != c[:512]


def test_mooncake_sharing_gives_prefix_hits_in_the_simulator(tmp_path):
    from servetwin.experiments.cli import main

    lines = [{"timestamp": 1000 * i, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]} for i in range(3)]
    p = _write(tmp_path / "mc.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    cfg = {"name": "mc", "model": "tiny-llama", "hardware": "cpu", "backends": ["sim"],
           "engine": {"num_gpu_blocks": 512, "max_model_len": 2048, "block_size": 16},
           "workload": {"arrival": {"type": "trace", "path": str(p), "format": "mooncake"}}}
    import yaml
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "out"), "--no-progress", "--no-plots"]) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())["backends"]["sim"]
    assert s["cached_tokens"] >= 2 * 1008  # the 2nd and 3rd requests hit the first's blocks


def test_column_mapping_and_time_units(tmp_path):
    p = _write(tmp_path / "mine.csv", "t_ms,n_in,n_out\n100,10,3\n350,20,4\n")
    recs = load_trace(p, columns={"arrival_s": "t_ms", "prompt_tokens": "n_in", "output_tokens": "n_out"},
                      time_unit="ms")
    assert [r.arrival_s for r in recs] == pytest.approx([0.0, 0.25])


def test_a_wrong_file_lists_the_columns_found_and_accepted(tmp_path):
    p = _write(tmp_path / "bad.csv", "when,in,out\n1,2,3\n")
    with pytest.raises(ValueError) as e:
        load_trace(p)
    msg = str(e.value)
    assert "has columns when, in, out" in msg and "TIMESTAMP, ContextTokens, GeneratedTokens" in msg
    assert "Request tokens" in msg and "input_length" in msg and "workload.arrival.columns" in msg
    with pytest.raises(ValueError, match="not the azure columns"):
        load_trace(p, fmt="azure")
    with pytest.raises(ValueError, match=r"workload.arrival.columns.output_tokens: required"):
        load_trace(p, columns={"arrival_s": "when", "prompt_tokens": "in"})
    with pytest.raises(ValueError, match="bad.csv:2.when: not a datetime"):
        load_trace(p, columns={"arrival_s": "when", "prompt_tokens": "in", "output_tokens": "out"},
                   time_unit="datetime")
