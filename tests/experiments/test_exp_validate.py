"""`servetwin validate`: runs a published-case directory and prints/writes the comparison (no accuracy
assertion here: benchmarks/fit_gpu_presets.py and docs/published_vllm.md report accuracy)."""
import json

import pytest

from exptest_helpers import STAGED_CLUSTER
from servetwin.experiments.cli import main
from servetwin.experiments.validate.published import (group_medians, predicted_value, render_table, validate_cases,
                                             version_settings)

CASE = """\
name: tiny_latency
seed: 0
model: llama-3.1-8b
hardware: h100-sxm
backends: [sim]
engine: {max_num_seqs: 16, max_num_batched_tokens: 2048, max_model_len: 2048, gpu_memory_utilization: 0.9}
workload: {requests: 4, prompt_tokens: 32, output_tokens: 8, arrival: {type: offline}, seed: 0}
output: {step_requests: false, plots: false}
"""


def _case_dir(tmp_path, published):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "tiny_latency.yaml").write_text(CASE)
    (tmp_path / "published.json").write_text(json.dumps(
        {"tiny_latency": {"source": "made up for the test", "published": published}}))
    return tmp_path


def test_validate_runs_one_case_and_writes_the_table(tmp_path, capsys):
    d = _case_dir(tmp_path, {"lat_ms": 100.0, "tpot_mean": 5.0, "ttft_p50": 10.0, "e2e_mean": 90.0})
    out = tmp_path / "docs" / "table.md"
    assert main(["validate", str(d), "-o", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    for metric in ("lat_ms", "tpot_mean", "ttft_p50", "e2e_mean"):
        assert f"| tiny_latency | {metric} |" in text
    assert "median abs error" in text and "cases run: 1/1" in text
    assert out.read_text().startswith("# Published vLLM measurements vs servetwin predictions")
    results = validate_cases(d)
    errs = results[0].errors()
    assert set(errs) == {"lat_ms", "tpot_mean", "ttft_p50", "e2e_mean"}
    pred = dict((m, p) for m, _, p in results[0].rows)
    assert errs["lat_ms"] == pytest.approx(pred["lat_ms"] / 100.0 - 1)  # signed: (predicted - published) / published
    assert set(group_medians(results)) == {"throughput/duration", "TPOT/ITL", "TTFT", "E2E"}


def test_validate_on_other_hardware_changes_the_prediction(tmp_path):
    d = _case_dir(tmp_path, {"lat_ms": 100.0})
    h100 = validate_cases(d)[0].rows[0][2]
    a100 = validate_cases(d, hardware="a100-80g")[0].rows[0][2]
    assert a100 > h100


def test_validate_bad_directories_name_the_problem(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert "published.json" in capsys.readouterr().err
    d = _case_dir(tmp_path, {"lat_bogus": 1.0})
    assert main(["validate", str(d)]) == 2
    assert "unknown metric 'lat_bogus'" in capsys.readouterr().err


def test_metric_mapping():
    sim = {"duration_s": 2.0, "request_throughput_s": 3.0, "itl_s": {"p99": 0.04}}
    assert predicted_value("dur_s", sim) == 2.0 and predicted_value("lat_p99_ms", sim) == 2000.0
    assert predicted_value("itl_p99", sim) == pytest.approx(40.0) and predicted_value("req_s", sim) == 3.0


GATED_CASE = """\
name: gated
seed: 0
model: llama-3.1-8b
hardware: h100-sxm
backends: [sim]
engine: {max_num_seqs: 4, max_num_batched_tokens: 256, max_model_len: 1280, num_gpu_blocks: 100, block_size: 16%s}
workload: {requests: 2, prompt_tokens: 1000, output_tokens: 40, arrival: {type: offline}, seed: 0}
output: {step_requests: false, plots: false}
"""


def _gated_dir(tmp_path, engine_version, extra=""):
    (tmp_path / "cases").mkdir(parents=True)
    (tmp_path / "cases" / "gated.yaml").write_text(GATED_CASE % extra)
    entry = {"source": "made up for the test", "published": {"ttft_mean": 100.0}}
    if engine_version is not None:
        entry["engine_version"] = engine_version
    (tmp_path / "published.json").write_text(json.dumps({"gated": entry}))
    return tmp_path


def test_version_settings_follow_the_measured_vllm_version():
    assert version_settings("vLLM 0.11.0 (V1)") == {"engine.scheduler_reserve_full_isl": False}
    assert version_settings("vLLM v0.11.2") == {"engine.scheduler_reserve_full_isl": False}
    assert version_settings("vLLM 0.9.2 (V1)") == {"engine.scheduler_reserve_full_isl": False}  # older still
    assert version_settings("vLLM 0.10.1") == {"engine.scheduler_reserve_full_isl": False}
    assert version_settings("vLLM 0.12.0") == {}  # newer than any version the settings are known for
    assert version_settings("vLLM 0.33.0") == {}  # the version core/ implements
    assert version_settings("vLLM performance dashboard (2024, version not shown)") == {}
    assert version_settings(None) == {}


def test_a_case_measured_on_vllm_0_11_runs_without_the_full_prompt_admission_gate(tmp_path):
    # 2 x 1000-token prompts, 100 blocks of 16: the second prompt's first chunk fits beside the first
    # request (vLLM 0.11 admits it), its whole prompt does not (0.33 makes it wait): its TTFT differs
    modern = validate_cases(_gated_dir(tmp_path / "a", None))[0]
    old = validate_cases(_gated_dir(tmp_path / "b", "vLLM 0.11.0 (V1)"))[0]
    assert modern.error is None and old.error is None
    assert not modern.notes
    assert old.notes == ['engine.scheduler_reserve_full_isl=false (as vLLM 0.11.0 (V1))']
    assert old.rows[0][2] != modern.rows[0][2]
    # the case file's own setting and --set win over the version's, without a note
    explicit = validate_cases(_gated_dir(tmp_path / "c", "vLLM 0.11.0 (V1)", ", scheduler_reserve_full_isl: true"))[0]
    assert not explicit.notes and explicit.rows[0][2] == modern.rows[0][2]
    forced = validate_cases(_gated_dir(tmp_path / "d", "vLLM 0.11.0 (V1)"),
                            overrides=["engine.scheduler_reserve_full_isl=true"])[0]
    assert not forced.notes and forced.rows[0][2] == modern.rows[0][2]
    assert "Settings taken from the measured vLLM version" in render_table([old])


def test_the_published_cases_the_readme_cites_are_in_the_repository():
    import pathlib

    import yaml

    from servetwin.experiments.config.schema import load_config

    root = pathlib.Path(__file__).resolve().parents[2]
    for folder in ("benchmarks/gpu_reference", "benchmarks/published_cases"):
        assert folder in (root / "README.md").read_text()
        d = root / folder
        published = json.loads((d / "published.json").read_text())
        cases = {p.stem: p for p in (d / "cases").glob("*.yaml")}
        assert cases and set(published) <= set(cases) and (d / "README.md").is_file()
        for p in cases.values():  # each parses (models/ configs resolve), without running
            assert yaml.safe_load(p.read_text())["backends"] == ["sim"] and load_config(p).model


def test_the_held_out_moe_cases_are_the_artifacts_rows_minus_the_training_set(tmp_path):
    """benchmarks/published_moe_heldout is what build_cases.py writes from the verbatim artifact: every vLLM
    row of the run but the nine training cases, each case parsing (nothing is run here)."""
    import importlib.util
    import pathlib
    import shutil

    from servetwin.experiments.config.schema import load_config

    root = pathlib.Path(__file__).resolve().parents[2]
    src = root / "benchmarks" / "published_moe_heldout"
    work = tmp_path / "benchmarks"
    shutil.copytree(src, work / "published_moe_heldout", ignore=shutil.ignore_patterns("cases", "published.json"))
    shutil.copytree(root / "benchmarks" / "published_moe", work / "published_moe")
    spec = importlib.util.spec_from_file_location("build_cases", work / "published_moe_heldout" / "build_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    rebuilt = work / "published_moe_heldout"
    assert (rebuilt / "published.json").read_text() == (src / "published.json").read_text()
    names = sorted(p.name for p in (src / "cases").glob("*.yaml"))
    assert names == sorted(p.name for p in (rebuilt / "cases").glob("*.yaml")) and len(names) == 291
    for name in names:
        assert (rebuilt / "cases" / name).read_text() == (src / "cases" / name).read_text()
    training = set(json.loads((root / "benchmarks" / "published_moe" / "published.json").read_text()))
    held_out = set(json.loads((src / "published.json").read_text()))
    assert len(training) == 9 and not training & held_out
    for name in ("M_b200_tp8_1024x1024_c4_v013", "M_h200_tp1_8192x1024_c64_v013"):
        exp = load_config(src / "cases" / f"{name}.yaml")
        assert exp.model and exp.backends == ["sim"]




def _staged_dir(tmp_path):
    (tmp_path / "cases").mkdir(parents=True)
    per_stage = [{"rate": 3, "out_tok_s": 20.0, "ttft_mean": 30.0, "ttft_p90": 20_000.0, "itl_mean": 5.0},
                 {"rate": 4, "out_tok_s": 25.0, "ttft_mean": 30.0, "e2e_mean": 60.0}]
    pub = {}
    for name, router in (("a_rr", "{type: round_robin}"),
                         ("b_llmd", "{type: llm_d, filters: [{type: prefix-cache-affinity}], scorers: [{type: token-load}]}")):
        (tmp_path / "cases" / f"{name}.yaml").write_text(STAGED_CLUSTER.format(name=name, router=router))
        pub[name] = {"source": "made up", "published": {}, "stages": {"first": 1, "per_stage": per_stage}}
    pub["b_llmd"]["stages"] = {"first": 1, "per_stage": [{**s, "ttft_mean": 10.0} for s in per_stage]}
    pub["b_llmd"]["ranking"] = {"above": "a_rr"}
    pub["c_pd"] = {"source": "made up", "published": {"ttft_mean": 1.0}, "pending": "needs the KV connector (pending)"}
    (tmp_path / "published.json").write_text(json.dumps(pub))
    return tmp_path


def test_staged_cluster_cases_compare_per_stage_and_pending_cases_are_listed(tmp_path, capsys):
    d = _staged_dir(tmp_path)
    results = {r.name: r for r in validate_cases(d)}
    assert results["c_pd"].pending and not results["c_pd"].rows
    rows = {m: (pub, pred) for m, pub, pred in results["a_rr"].rows}
    # the stage after the first (published `first: 1`); a TTFT of 10 s or more is not compared
    assert set(rows) == {"out_tok_s@3", "ttft_mean@3", "itl_mean@3", "out_tok_s@4", "ttft_mean@4", "e2e_mean@4"}
    assert all(pred is not None and pred > 0 for _, pred in rows.values())
    assert main(["validate", str(d), "-q"]) == 0  # a pending case is reported, not an error
    text = capsys.readouterr().out
    assert "| c_pd | (not runnable yet) |" in text and "cases run: 2/3 (1 not runnable yet)" in text
    assert "- b_llmd vs a_rr" in text and "the predicted order holds at" in text


def test_stage_figures_follow_inference_perfs_report():
    import pandas as pd
    from servetwin.experiments.validate.cluster_stages import stage_figures
    reqs = pd.DataFrame({"request_id": ["req-0", "req-1", "req-2"], "finish_reason": ["length"] * 3,
                         "arrival_s": [0.0, 1.0, 10.0], "client_finish_s": [2.0, 4.0, 11.0],
                         "output_tokens": [10, 20, 5], "ttft_s": [0.5, 1.0, 0.2], "tpot_s": [0.1, 0.1, 0.2],
                         "e2e_s": [1.4, 2.9, 1.0]})
    s0, s1 = stage_figures(reqs, [2, 1])
    assert s0["out_tok_s"] == pytest.approx(30 / 4.0)  # output tokens / (last finish - first arrival)
    assert s0["itl_mean"] == pytest.approx(1000 * (0.9 + 1.9) / (9 + 19))  # every token gap pooled
    assert s0["ttft_mean"] == pytest.approx(750.0) and s1["e2e_mean"] == pytest.approx(1000.0)
    assert s0["ttft_p50"] == pytest.approx(750.0) and s1["ttft_p50"] == pytest.approx(200.0)  # held-out reports give p50


def test_bad_stage_metrics_are_named(tmp_path, capsys):
    d = _staged_dir(tmp_path)
    pub = json.loads((d / "published.json").read_text())
    pub["a_rr"]["stages"]["per_stage"][0]["ttft_bogus"] = 1.0
    (d / "published.json").write_text(json.dumps(pub))
    assert main(["validate", str(d)]) == 2
    assert "unknown metric 'ttft_bogus'" in capsys.readouterr().err


def test_validate_reads_earlier_runs_with_the_same_figures(tmp_path, capsys):
    d = _staged_dir(tmp_path / "cases_dir")
    runs = tmp_path / "runs"
    assert main(["run", str(d / "cases" / "a_rr.yaml"), "-o", str(runs / "a_rr")]) == 0
    direct = validate_cases(d, only=["a_rr"])[0]
    read = validate_cases(d, only=["a_rr"], runs_dir=runs)[0]
    assert read.rows == direct.rows  # the simulation is deterministic: reading the run changes nothing
    assert main(["validate", str(d), "--case", "b_llmd", "--runs", str(runs), "-q"]) == 1  # no run of it: reported
    assert "| b_llmd | (not run) |" in capsys.readouterr().out


def _arm(name, rows):
    from servetwin.experiments.validate.published import CaseResult
    return CaseResult(name, "made up", rows)


def test_ranking_checks_count_the_stages_where_the_published_arms_separate():
    from servetwin.experiments.validate.cluster_stages import ranking_checks
    a = _arm("a", [("ttft_mean@5", 100.0, 50.0), ("ttft_mean@10", 100.0, 120.0), ("ttft_mean@15", 100.0, 80.0),
                   ("out_tok_s@5", 1000.0, 700.0), ("e2e_mean@5", 100.0, None)])
    b = _arm("b", [("ttft_mean@5", 200.0, 90.0), ("ttft_mean@10", 200.0, 110.0), ("ttft_mean@15", 105.0, 300.0),
                   ("out_tok_s@5", 1200.0, 700.0), ("e2e_mean@5", 300.0, 10.0)])
    published = {"a": {"ranking": {"above": "b"}}, "b": {}, "c": {"ranking": {"above": "b"}}}
    line, missing = ranking_checks([a, b], published)
    # @5 held; @10 reversed; @15 published within 10% (not checked); out_tok_s@5 equal predictions; e2e not run
    assert line.endswith("holds at 1/3; reversed at ttft_mean@10; predicted equal at out_tok_s@5")
    assert missing == "- c above b: not checked (both arms must run)"


def test_the_shipped_rankings_pair_runnable_cases_the_offload_pair_among_them():
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "published_cluster"
    published = json.loads((root / "published.json").read_text())
    pairs = {name: e["ranking"]["above"] for name, e in published.items() if e.get("ranking")}
    assert pairs["offload_gptoss120b_h100_16xtp1_cpu_offload"] == "offload_gptoss120b_h100_16xtp1_baseline"
    for name, other in pairs.items():  # both arms are cases with per-stage or whole-run figures
        for arm in (name, other):
            assert (root / "cases" / f"{arm}.yaml").is_file() and not published[arm].get("pending")
            assert published[arm].get("published") or published[arm].get("stages")


def test_ranking_checks_do_not_depend_on_which_arm_names_the_other():
    import re

    from hypothesis import given, settings, strategies as st

    from servetwin.experiments.validate.cluster_stages import ranking_checks

    value = st.sampled_from([1.0, 1.05, 2.0, 3.0])  # ties and near-ties in both columns
    stage = st.tuples(value, value, value, value)

    @settings(max_examples=200, deadline=None)
    @given(st.lists(stage, min_size=1, max_size=6))
    def check(stages):
        a = _arm("a", [(f"ttft_mean@{i}", pa, qa) for i, (pa, qa, _, _) in enumerate(stages)])
        b = _arm("b", [(f"ttft_mean@{i}", pb, qb) for i, (_, _, pb, qb) in enumerate(stages)])
        counts = []
        for first, second in (("a", "b"), ("b", "a")):
            (line,) = ranking_checks([a, b], {first: {"ranking": {"above": second}}, second: {}})
            held, checked = map(int, re.search(r"holds at (\d+)/(\d+)", line).groups())
            named = sum(len(part.split(", ")) for part in re.findall(r"(?:reversed|predicted equal) at ([^;]+)", line))
            assert held + named == checked
            counts.append((held, checked))
        assert counts[0] == counts[1]

    check()
