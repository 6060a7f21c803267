"""`servetwin run` / `servetwin sweep` on the sim backend: files, columns, summary, shipped scenarios."""
import json

import pandas as pd
import pytest
from exptest_helpers import CONFIGS, CORE_DATA, SCENARIOS, tiny, write_yaml

from servetwin.core.testbed.replay import replay
from servetwin.core.testbed.scenario import load_scenario
from servetwin.core.testbed.trace import REQUEST_COLUMNS, STEP_COLUMNS, STEP_REQUEST_COLUMNS
from servetwin.experiments.cli import main
from servetwin.experiments.run.runner import run_experiment
from servetwin.experiments.config.schema import validate_config

DIST_KEYS = {"mean", "p50", "p90", "p99"}
SUMMARY_KEYS = {"requests", "completed", "wall_s", "simulated_s", "throughput_tok_s", "output_tok_s", "ttft_s",
                "tpot_s", "itl_s", "e2e_s", "preemptions", "prefix_hit_rate", "num_gpu_blocks", "max_model_len",
                "prefill_tokens_computed", "interrupted"}


def test_run_writes_tables_summary_report_and_plots(tmp_path):
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny())
    out = tmp_path / "out"
    assert main(["run", str(cfg), "-o", str(out), "--no-progress"]) == 0
    for name in ("summary.json", "report.md", "config.yaml", "latency_cdf.png", "timeline.png", "step_time.png",
                 "sim/steps.parquet", "sim/step_requests.parquet", "sim/requests.parquet", "sim/trace.json",
                 "sim/summary.json"):
        assert (out / name).is_file(), name
    steps = pd.read_parquet(out / "sim/steps.parquet")
    step_reqs = pd.read_parquet(out / "sim/step_requests.parquet")
    reqs = pd.read_parquet(out / "sim/requests.parquet")
    assert list(steps.columns) == STEP_COLUMNS
    assert list(step_reqs.columns) == STEP_REQUEST_COLUMNS
    assert list(reqs.columns) == REQUEST_COLUMNS
    assert (steps.backend == "sim").all() and (steps.run == "tiny").all()
    assert steps.annotation.str.fullmatch(r"execute_context_\d+\(\d+\)_generation_\d+\(\d+\)").all()
    # the long-form rows add up to the step rows
    per_step = step_reqs.groupby("step").num_tokens.sum()
    assert per_step.to_dict() == dict(zip(steps.step, steps.total_tokens))
    combined = json.loads((out / "summary.json").read_text())
    assert combined["interrupted"] is False and list(combined["backends"]) == ["sim"]
    s = combined["backends"]["sim"]
    assert SUMMARY_KEYS <= set(s)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert DIST_KEYS <= set(s[key]) and s[key]["p50"] is not None and s[key]["p50"] <= s[key]["p99"]
    assert s["requests"] == s["completed"] == 6 == len(reqs)
    assert s["prefill_tokens_computed"] == int(steps.num_context_tokens.sum()) == int(reqs.prompt_tokens.sum())
    assert s["simulated_s"] == pytest.approx(float(steps.t_end_s.max()))
    assert s["num_gpu_blocks"] == 64 and s["max_model_len"] == 256
    assert s["output_tok_s"] == pytest.approx(reqs.output_tokens.sum() / s["simulated_s"])
    assert json.loads((out / "sim/summary.json").read_text())["completed"] == 6
    trace = json.loads((out / "sim/trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 1]
    assert [e["name"] for e in slices] == steps.annotation.tolist()
    report = (out / "report.md").read_text()
    assert "## Summary" in report and "## Key observations" in report and "latency_cdf.png" in report
    assert steps.annotation.iloc[0] in report


def test_seed_production_config_admits_18_requests_then_the_19th(tmp_path):
    out = tmp_path / "seed"
    assert main(["run", str(CONFIGS / "seed_production_example.yaml"), "-o", str(out), "--backend", "sim",
                 "--no-progress"]) == 0
    steps = pd.read_parquet(out / "sim/steps.parquet")
    step_reqs = pd.read_parquet(out / "sim/step_requests.parquet")
    s0, s1 = steps.iloc[0], steps.iloc[1]
    assert s0.step == 0 and s0.num_context_reqs == 18 and s0.num_context_tokens == 16117
    assert s0.annotation == "execute_context_18(16117)_generation_0(0)"
    assert s0.num_waiting == 1
    first = step_reqs[step_reqs.phase == "context"].groupby("request_id").step.min()
    assert (first.drop("a18") == 0).all() and first["a18"] == 1
    a18 = step_reqs[(step_reqs.request_id == "a18") & (step_reqs.step == 1)].iloc[0]
    assert a18.num_tokens == 900 and a18.phase == "context"
    assert s1.annotation == "execute_context_1(900)_generation_18(18)"
    summary = json.loads((out / "summary.json").read_text())["backends"]["sim"]
    assert summary["completed"] == 19 and summary["kv_pool"]["num_gpu_blocks"] == summary["num_gpu_blocks"]


def test_reward_sweep_with_2_workers_shows_the_prefix_caching_saving(tmp_path):
    out = tmp_path / "reward"
    rc = main(["sweep", str(CONFIGS / "reward_prefix_caching.yaml"), "-o", str(out), "-j", "2", "--no-progress",
               "--set", "workload.shared_prefix.groups=8", "--set", "workload.output_tokens=4",
               "--set", "workload.shared_prefix.prefix_tokens=2000", "--no-plots"])
    assert rc == 0
    table = pd.read_csv(out / "sweep.csv")
    assert len(table) == 2 and (table.status == "ok").all() and (table.completed == 32).all()
    assert table["engine.enable_prefix_caching"].tolist() == [True, False]
    on, off = table.iloc[0], table.iloc[1]
    ratio = off.prefill_tokens_computed / on.prefill_tokens_computed
    assert 3.5 < ratio <= 4.0  # the prefix is computed once per group of 4
    assert on.prompt_tokens == off.prompt_tokens == off.prefill_tokens_computed
    assert on.duration_s < off.duration_s
    assert (out / "sweep.md").is_file()
    assert "enable_prefix_caching=true" in (out / "sweep.md").read_text()
    for point in table.point:
        assert (out / point / "sim" / "steps.parquet").is_file() and (out / point / "report.md").is_file()
    steps = pd.read_parquet(out / "enable_prefix_caching=true" / "sim" / "steps.parquet")
    ctx = steps[steps.num_context_reqs > 0]
    near_total = ctx[ctx.num_context_tokens <= 16 * ctx.num_context_reqs]
    assert len(near_total) > 0  # steps like execute_context_1(4)_...: only the short suffix is computed
    assert "near-total prefix hits" in (out / "enable_prefix_caching=true" / "report.md").read_text()


def _scenario_config(path, tmp_path):
    sc = load_scenario(str(path))
    sched, cache = sc.scheduler_config, sc.cache_config
    blocks = cache.num_gpu_blocks
    fits = (blocks - 1) * cache.block_size >= sched.max_model_len
    return {
        "name": path.stem, "model": "llama-3.1-8b", "hardware": "h100-sxm", "backends": ["sim"],
        "engine": {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
                   "enable_chunked_prefill": sched.enable_chunked_prefill,
                   "long_prefill_token_threshold": sched.long_prefill_token_threshold,
                   "enable_prefix_caching": cache.enable_prefix_caching, "block_size": cache.block_size,
                   "num_gpu_blocks": blocks, "policy": sched.policy, "async_scheduling": sched.async_scheduling,
                   "max_model_len": sched.max_model_len if fits else -1},
        "workload": {"scenario": str(path), "arrival": {"type": "offline"}},
    }


@pytest.mark.parametrize("path", [SCENARIOS / "a_production_shaped.json", CORE_DATA / "a2_production_shaped_chunked.json",
                                  SCENARIOS / "c_tight_kv.json", CORE_DATA / "c2_tight_kv_priority.json"],
    ids=lambda p: p.stem)
def test_simulator_trace_equals_replay_decisions(path, tmp_path):
    exp = validate_config(_scenario_config(path, tmp_path))
    run_experiment(exp, str(tmp_path / "out"), progress=False, log=lambda m: None)
    step_reqs = pd.read_parquet(tmp_path / "out" / "sim" / "step_requests.parquet")
    sim = [(int(step), dict(zip(g.request_id, g.num_tokens.astype(int))))
           for step, g in step_reqs.groupby("step", sort=True)]
    expected = [(rec["step"], rec["num_scheduled_tokens"]) for rec in replay(load_scenario(str(path)))
                if rec.get("type") == "step" and rec.get("num_scheduled_tokens")]
    assert len(sim) == len(expected) > 3
    assert sim == expected
    steps = pd.read_parquet(tmp_path / "out" / "sim" / "steps.parquet")
    if path.stem.startswith("c_"):
        assert steps.num_preempted.sum() > 0  # the tight pool preempts, in the same steps as replay


@pytest.mark.pure_python("interrupts the run by patching EngineCore.step")
def test_ctrl_c_leaves_complete_files_marked_interrupted(tmp_path, monkeypatch):
    from servetwin.core.engine.engine_core import EngineCore

    real_step = EngineCore.step
    calls = {"n": 0}

    def step(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return real_step(self, *a, **kw)

    monkeypatch.setattr(EngineCore, "step", step)
    exp = validate_config(tiny(workload__requests=12))
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_experiment(exp, str(out), progress=False, log=lambda m: None)
    steps = pd.read_parquet(out / "sim/steps.parquet")
    assert len(steps) == 9 and list(steps.columns) == STEP_COLUMNS
    reqs = pd.read_parquet(out / "sim/requests.parquet")
    assert len(reqs) == 12 and reqs.finish_s.isna().any()  # some requests never finished
    combined = json.loads((out / "summary.json").read_text())
    assert combined["interrupted"] is True and combined["backends"]["sim"]["interrupted"] is True
    assert combined["backends"]["sim"]["completed"] < 12
    assert "Interrupted" in (out / "report.md").read_text()


def test_trace_file_gives_lengths_and_an_explicit_arrival_replaces_its_times(tmp_path):
    from servetwin.experiments.config.workloads import build_requests

    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.5,12,3\n0.1,30,5\n0.9,20,2\n")
    exp = validate_config(tiny(workload={"file": str(trace)}))
    reqs, arrival, _ = build_requests(exp, vocab_size=256)
    assert [(r.arrival_s, len(r.prompt_token_ids), r.max_tokens) for r in reqs] == [(0.1, 30, 5), (0.5, 12, 3), (0.9, 20, 2)]
    exp = validate_config(tiny(workload={"file": str(trace), "arrival": {"type": "offline"}, "requests": 2}))
    reqs, arrival, _ = build_requests(exp, vocab_size=256)
    assert [(r.arrival_s, len(r.prompt_token_ids)) for r in reqs] == [(0.0, 30), (0.0, 12)]
    run_experiment(exp, str(tmp_path / "out"), progress=False, log=lambda m: None)
    assert len(pd.read_parquet(tmp_path / "out" / "sim" / "requests.parquet")) == 2
