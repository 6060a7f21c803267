"""`workload.lengths` and `workload.conversations` in the experiment YAML: parsing, errors, sweeps, runs."""
import json

import pandas as pd
import pytest
from exptest_helpers import CONFIGS, tiny, write_yaml

from servetwin.core.config_error import ConfigError
from servetwin.experiments.run.runner import run_experiment
from servetwin.experiments.config.schema import expand_sweep, load_config, validate_config

CONV = {"count": 6, "turns": 3, "first_prompt": {"type": "uniform", "low": 20, "high": 60},
        "message_tokens": {"type": "uniform", "low": 4, "high": 20}, "output_tokens": {"type": "uniform", "low": 4,
                                                                                      "high": 20}}


def _conv_cfg(**conv):
    cfg = tiny()
    cfg["engine"].update(max_model_len=512, num_gpu_blocks=256, max_num_batched_tokens=128)
    cfg["workload"] = {"conversations": {**CONV, **conv}, "arrival": {"type": "poisson", "rate": 50.0}}
    return cfg


def test_lengths_and_pairs_file_relative_to_the_config(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pairs.csv").write_text("prompt,output\n30,8\n50,5\n")
    cfg = tiny()
    cfg["workload"] = {"requests": 5, "lengths": {"type": "empirical", "path": "data/pairs.csv"}}
    exp = validate_config(cfg, tmp_path)
    assert exp.workload.spec.lengths.kind == "empirical"
    cfg["workload"]["lengths"] = {"type": "sharegpt_like", "prompt": {"type": "empirical", "path": "data/nope.txt"},
                                  "output": 8}
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, tmp_path)
    assert e.value.path == "workload.lengths.prompt.path"


@pytest.mark.parametrize("workload, field", [
    ({"requests": 3, "lengths": {"type": "sharegpt_like", "prompt": 10}}, "workload.lengths.output"),
    ({"requests": 3, "prompt_tokens": 5, "lengths": {"type": "sharegpt_like", "prompt": 10, "output": 5}},
     "workload.prompt_tokens"),
    ({"conversations": {**CONV, "count": -1}}, "workload.conversations.count"),
    ({"conversations": CONV, "requests": 4}, "workload.requests"),
    ({"multi_turn": CONV}, "workload.multi_turn"),
])
def test_bad_workload_fields_are_named(workload, field):
    cfg = tiny()
    cfg["workload"] = workload
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.path == field
    if field == "workload.multi_turn":
        assert "conversations" in e.value.message  # the hint


def test_torch_backend_refuses_conversations():
    cfg = _conv_cfg()
    cfg["backends"] = ["sim", "torch"]
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.path == "workload.conversations" and "sim backend" in e.value.message


def test_conversations_are_sweepable_and_requests_sets_the_count(tmp_path):
    cfg = _conv_cfg()
    cfg["sweep"] = {"workload.conversations.count": [2, 4], "workload.conversations.think_time_s": [0, 1.5]}
    points = expand_sweep(validate_config(cfg))
    assert sorted((p.config.workload.spec.conversations.count, p.config.workload.spec.conversations.think_time_s)
                  for p in points) == [(2, 0), (2, 1.5), (4, 0), (4, 1.5)]
    path = write_yaml(tmp_path / "c.yaml", _conv_cfg())
    notes = []
    exp = load_config(path, requests=9, notes=notes)
    assert exp.workload.spec.conversations.count == 9 and "9 conversations" in notes[0]


@pytest.mark.parametrize("caching", [True, False])
def test_run_shows_the_shared_history_in_the_prefix_cache(tmp_path, caching):
    cfg = _conv_cfg()
    cfg["engine"]["enable_prefix_caching"] = caching
    cfg["output"] = {"plots": False}
    exp = validate_config(cfg, tmp_path)
    summary = run_experiment(exp, str(tmp_path / "out"), progress=False)
    s = summary["backends"]["sim"]
    assert s["requests"] == s["completed"] == 18 and summary["workload"]["conversations"] == 6
    reqs = pd.read_parquet(tmp_path / "out" / "sim" / "requests.parquet")
    later = reqs[~reqs.request_id.str.endswith("-turn-1")]
    assert len(later) == 12 and reqs.request_id.str.fullmatch(r"conv-\d+-turn-[123]").all()
    conv = s["conversations"]
    assert (conv["first_turns"], conv["later_turns"]) == (6, 12)
    assert conv["later_turns_cached_share"] == pytest.approx(later.cached_tokens.sum() / later.prompt_tokens.sum())
    report = (tmp_path / "out" / "report.md").read_text()
    assert "multi-turn conversations" in report
    if caching:
        assert (later.cached_tokens >= 16).all() and s["prefix_hit_rate"] > 0.3
        assert conv["later_turns_cached_share"] > 0.5 and conv["first_turns_cached_share"] == 0
        assert "later conversation turns (12) found" in report
    else:
        assert (reqs.cached_tokens == 0).all() and not s["prefix_hit_rate"]
        assert conv["later_turns_cached_share"] == 0


def test_shipped_chat_config_parses_and_its_sweep_is_caching_on_off():
    exp = load_config(CONFIGS / "chat_multiturn.yaml")
    conv = exp.workload.spec.conversations
    assert conv.count == 200 and conv.max_context_tokens == 8192 and exp.backends == ["sim"]
    assert [p.assignments for p in expand_sweep(exp)] == [{"engine.enable_prefix_caching": True},
                                                          {"engine.enable_prefix_caching": False}]
    json.dumps(exp.to_dict())  # the config round-trips (config.yaml of a run)


def test_shipped_sharegpt_config_keeps_vllms_limits_and_its_limits_sweep():
    exp = load_config(CONFIGS / "sharegpt_like.yaml")
    lim = exp.workload.spec.lengths.limits
    assert (lim.min_tokens, lim.max_prompt_tokens, lim.max_total_tokens) == (4, 1024, 2048)
    raw = exp.to_dict()
    raw["sweep"] = {"workload.lengths.max_total_tokens": [1024, None]}
    points = expand_sweep(validate_config(raw, CONFIGS))
    assert [p.config.workload.spec.lengths.limits.max_total_tokens for p in points] == [1024, None]


def test_capacity_over_conversations_counts_conversation_starts():
    from servetwin.experiments.capacity.capacity_run import load_unit  # noqa: PLC0415

    conv = validate_config(_conv_cfg())
    assert load_unit(conv, "workload.arrival.rate") == ("conversations/s", "conversation start rate (conversations/s)")
    assert load_unit(conv, "workload.arrival.clients")[0] == "users"
    plain = validate_config(tiny())
    assert load_unit(plain, "workload.arrival.rate")[0] == "req/s"
    assert load_unit(plain, "workload.arrival.clients")[0] == "clients"
