"""The recorded vLLM 0.33.0 oracle scenarios replay step for step; the `servetwin replay` CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servetwin.core.testbed.replay import replay
from servetwin.core.testbed.scenario import load_scenario, parse_scenario

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.name[: -len(".json")] for p in DATA.glob("*.json"))

STEP_KEYS = [
    "arrived", "num_scheduled_tokens", "total_scheduled_tokens", "new", "new_prefix_hit_tokens", "running",
    "resumed", "resumed_prefix_hit_tokens", "preempted", "sampled", "num_free_blocks_after_schedule",
    "kv_usage_after_schedule", "prefix_cache", "waiting_ids", "finished", "num_free_blocks_after_update",
    "num_running_after", "num_waiting_after", "processed_output_of_step", "idle",
]
SUMMARY_KEYS = ["num_steps", "finish_step", "first_token_step", "unfinished", "output_token_ids",
                "num_free_blocks_end"]


def _load_expected(name: str) -> list[dict]:
    with open(DATA / f"{name}.expected.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _ours(name: str) -> list[dict]:
    return list(replay(load_scenario(str(DATA / f"{name}.json"))))


def _finished_pairs(rec: dict) -> list[list[str]]:
    return [[rid, rec["finish_reasons"][rid]] for rid in rec["finished"]]


def test_every_scenario_has_an_expected_trace():
    assert len(SCENARIOS) >= 7
    for name in SCENARIOS:
        assert (DATA / f"{name}.expected.jsonl").exists(), name


@pytest.mark.parametrize("name", SCENARIOS)
def test_replay_matches_vllm_oracle(name):
    expected = _load_expected(name)
    ours = _ours(name)
    assert [r["type"] for r in ours] == [r["type"] for r in expected]
    assert len(ours) == len(expected)
    for exp, got in zip(expected, ours):
        if exp["type"] == "config":
            for k in ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "block_size"):
                assert got["settings"][k] == exp["settings"][k]
            assert got["settings"]["max_model_len"] == exp["effective"]["max_model_len"]
            assert got["num_requests"] == exp["num_requests"]
            continue
        if exp["type"] == "summary":
            for k in SUMMARY_KEYS:
                assert got[k] == exp[k], (name, "summary", k)
                if isinstance(exp[k], dict):
                    assert list(got[k]) == list(exp[k]), (name, "summary order", k)
            continue
        where = (name, exp.get("step"))
        assert got.get("step") == exp.get("step"), where
        if exp.get("drain_only"):
            assert got.get("drain_only") is True, where
            assert got.get("processed_output_of_step") == exp.get("processed_output_of_step"), where
            continue
        for k in STEP_KEYS:
            if k not in exp:
                assert k not in got or k in ("finished",) or got[k] in (None, False), (where, k)
                continue
            if k == "finished":
                assert _finished_pairs(got) == exp[k], (where, k)
            elif k == "num_scheduled_tokens":
                # dict ORDER is part of the contract (running first, then new/resumed, scheduling order)
                assert list(got[k].items()) == list(exp[k].items()), (where, k)
            else:
                assert got[k] == exp[k], (where, k, got[k], exp[k])


def test_production_shaped_step0_annotation_and_late_a18():
    ours = _ours("a_production_shaped")
    steps = {r["step"]: r for r in ours if r["type"] == "step"}
    s0, s1 = steps[0], steps[1]
    assert s0["annotation"] == "execute_context_18(16117)_generation_0(0)"
    assert "a18" in s0["arrived"] and "a18" not in s0["num_scheduled_tokens"]
    assert s0["waiting_ids"] == ["a18"]
    assert s1["num_scheduled_tokens"]["a18"] == 900
    assert s1["new"] == ["a18"]
    # 18 decodes + one 900-token prefill
    assert s1["annotation"] == "execute_context_1(900)_generation_18(18)"


def test_replay_is_deterministic():
    assert _ours("c2_tight_kv_priority") == _ours("c2_tight_kv_priority")


# -- CLI --------------------------------------------------------------------------------------

def test_cli_replay_writes_file(tmp_path, capsys):
    from servetwin.experiments.cli import main

    out = tmp_path / "out.jsonl"
    rc = main(["replay", str(DATA / "b_shared_prefix.json"), "-o", str(out)])
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == json.loads(json.dumps(_ours("b_shared_prefix")))
    assert "wrote" in capsys.readouterr().err


def test_cli_replay_subprocess(tmp_path):
    out = tmp_path / "x.jsonl"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "servetwin.experiments.cli", "replay", str(DATA / "x_vllm_test_concurrent_partial.json"),
         "-o", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    expected = _load_expected("x_vllm_test_concurrent_partial")
    assert [r["num_scheduled_tokens"] for r in got if r["type"] == "step"] == \
        [r["num_scheduled_tokens"] for r in expected if r["type"] == "step"]


def _base_scenario() -> dict:
    return {"settings": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_gpu_blocks": 64,
                         "block_size": 16},
            "requests": [{"id": "r0", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}]}


def _bad(mutate) -> dict:
    d = _base_scenario()
    mutate(d)
    return d


BAD_SCENARIOS = {
    "unknown_setting": (_bad(lambda d: d["settings"].update(bogus_knob=1)), "bogus_knob"),
    "missing_required_setting": (_bad(lambda d: d["settings"].pop("num_gpu_blocks")), "num_gpu_blocks"),
    "invalid_setting_value": (_bad(lambda d: d["settings"].update(max_num_seqs=0)), "max_num_seqs"),
    "missing_prompt": (_bad(lambda d: d["requests"][0].pop("prompt_token_ids")), "prompt_token_ids"),
    "empty_prompt": (_bad(lambda d: d["requests"][0].update(prompt_token_ids=[])), "prompt_token_ids"),
    "duplicate_id": (_bad(lambda d: d["requests"].append(dict(d["requests"][0]))), "duplicate"),
    "missing_id": (_bad(lambda d: d["requests"][0].pop("id")), "id"),
    "unknown_request_key": (_bad(lambda d: d["requests"][0].update(temprature=0.5)), "temprature"),
    "bad_max_tokens": (_bad(lambda d: d["requests"][0].update(max_tokens=0)), "max_tokens"),
    "requests_not_list": (_bad(lambda d: d.update(requests={})), "requests"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCENARIOS))
def test_parse_scenario_errors_name_the_field(case):
    data, field = BAD_SCENARIOS[case]
    with pytest.raises(ValueError, match=field):
        parse_scenario(data)


@pytest.mark.parametrize("case", ["unknown_setting", "missing_prompt", "duplicate_id", "missing_required_setting"])
def test_cli_bad_scenario_exit_code_2(tmp_path, capsys, case):
    from servetwin.experiments.cli import main

    data, field = BAD_SCENARIOS[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "never.jsonl"
    rc = main(["replay", str(path), "-o", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert field in err
    assert "error" in err


def test_cli_not_json_and_missing_file(tmp_path, capsys):
    from servetwin.experiments.cli import main

    path = tmp_path / "broken.json"
    path.write_text("{not json")
    assert main(["replay", str(path)]) == 2
    assert "JSON" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "nope.json")]) == 2
    assert "not found" in capsys.readouterr().err


def test_scenario_with_n_fans_out_children():
    d = _base_scenario()
    d["settings"]["enable_prefix_caching"] = True
    d["requests"] = [{"id": "p", "prompt_token_ids": list(range(40)), "max_tokens": 2, "n": 3}]
    lines = list(replay(parse_scenario(d)))
    step0 = lines[1]
    assert step0["arrived"] == ["0_p", "1_p", "2_p"]
    assert list(step0["num_scheduled_tokens"]) == ["0_p", "1_p", "2_p"]
    # children share the prompt: the 2nd and 3rd hit the 1st's two full blocks in the same step
    assert step0["new_prefix_hit_tokens"] == {"0_p": 0, "1_p": 32, "2_p": 32}
    summary = lines[-1]
    assert sorted(summary["output_token_ids"]) == ["0_p", "1_p", "2_p"]
    assert summary["unfinished"] == []
