"""`servetwin capacity` of a cluster config: the cheapest deployment meeting the SLOs at the config's load, or
(`--over`) the highest load of its deployment."""
import json

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetwin.experiments.capacity.deployments import search_deployments, worst_text
from servetwin.experiments.config.slo import parse_slo_args
from servetwin.core.config_error import ConfigError
from servetwin.experiments.cli import main

RAW = {"instances": [{"name": "r", "count": 2}], "router": {"type": "round_robin"}}


def _fake(need: dict[tuple[int, str], int]):
    """A deployment meets the SLO from need[(tp, router)] replicas on (monotone in replicas)."""
    calls = []

    def load(values):
        inst = values["cluster.instances"][0]
        return (inst["engine"]["tensor_parallel_size"], values["cluster.router"]["type"], inst["count"])

    def evaluate(exp):
        tp, router, n = exp
        calls.append(exp)
        ratio = need[(tp, router)] / n
        return [{"name": "ttft_p99_s", "limit": 2.0, "value": 2.0 * ratio, "met": ratio <= 1.0, "ratio": ratio}]
    return load, evaluate, calls


@settings(max_examples=60, deadline=None)
@given(need=st.dictionaries(st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from(["round_robin", "llm_d"])),
                            st.integers(1, 20), min_size=6, max_size=6), max_replicas=st.integers(1, 16))
def test_the_fewest_replicas_and_the_cheapest_first(need, max_replicas):
    load, evaluate, calls = _fake(need)
    routers = [{"type": "round_robin"}, {"type": "llm_d"}]
    res = search_deployments(load, RAW, [1, 2, 4], routers, max_replicas, evaluate=evaluate)
    assert len(res) == 6
    for r in res:
        n = need[(r.tp, r.router)]
        assert r.replicas == (n if n <= max_replicas else None)  # bisection finds the exact threshold
        assert r.gpus == (None if r.replicas is None else r.replicas * r.tp)
        assert len(r.probes) <= max_replicas.bit_length() + 1  # bisection, not a scan
    gpus = [r.gpus for r in res if r.gpus is not None]
    assert gpus == sorted(gpus)  # cheapest first, the ones that never meet the SLOs last
    assert all(r.gpus is None for r in res[len(gpus):])
    assert len(calls) == len(set(calls))  # no deployment simulated twice


def test_slo_milliseconds_become_seconds():
    assert parse_slo_args(["tpot_p99_ms=50", "ttft_p99_s=2"]) == {"tpot_p99_s": 0.05, "ttft_p99_s": "2"}
    with pytest.raises(ConfigError, match="--slo tpot_p99_ms"):
        parse_slo_args(["tpot_p99_ms=fast"])


def test_what_binds_names_an_attainment_as_a_share_of_requests():
    import numpy as np
    import pandas as pd

    from servetwin.experiments.config.slo import evaluate_slo, parse_slo

    spec = parse_slo({"ttft_s": 1.0, "min_attainment": 0.9})
    requests = pd.DataFrame({"ttft_s": [0.5] * 17 + [1.5] * 3, "tpot_s": [0.01] * 20, "e2e_s": [2.0] * 20})
    ev = evaluate_slo(spec, requests, np.array([0.01]), duration_s=10.0)
    assert not ev["met"] and ev["binding"] == "attainment"
    assert worst_text(ev["checks"]) == "deadlines met by 85% of requests, 90% required (missed)"
    spec = parse_slo({"ttft_p99_s": 2.0, "tpot_p99_s": 0.05})
    ev = evaluate_slo(spec, requests, np.array([0.01]), duration_s=10.0)
    assert worst_text(ev["checks"]) == "ttft_p99_s 1.5 s of 2 s (met)"


CLUSTER = """\
name: tiny_cluster
model: llama-3.1-8b
hardware: h100-sxm
engine: {max_num_seqs: 16, max_num_batched_tokens: 2048, max_model_len: 2048}
workload: {requests: 24, prompt_tokens: 256, output_tokens: 16, arrival: {type: poisson, rate: 40}}
output: {step_requests: false, plots: false}
cluster:
  instances: [{name: r, count: 1}]
  router: {type: round_robin}
"""


def test_capacity_of_a_cluster_config_prints_the_cheapest_deployment(tmp_path, capsys):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(CLUSTER)
    folder = tmp_path / "cap"
    assert main(["capacity", str(cfg), "--slo", "ttft_p99_s=5", "--slo", "tpot_p99_ms=500", "--tp", "1,2",
                 "--max-replicas", "2", "-o", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "| rank | deployment | TP | router | instances | GPUs | what binds |" in out
    assert "cheapest: 1 x TP1 behind round_robin = 1 GPUs" in out and "runner-up: 1 x TP2" in out
    # the run folder: what was printed, every deployment simulated, the answer written last
    answer = json.loads((folder / "capacity.json").read_text())
    assert answer["interrupted"] is False and answer["slo"] == {"ttft_p99_s": 5.0, "tpot_p99_s": 0.5}
    assert answer["cheapest"]["deployment"] == "1 x TP1" and answer["runner_up"]["deployment"] == "1 x TP2"
    assert [d["rank"] for d in answer["deployments"]] == [1, 2]
    assert "cheapest: 1 x TP1 behind round_robin = 1 GPUs" in (folder / "capacity.md").read_text()
    probes = pd.read_csv(folder / "probes.csv")
    assert len(probes) == answer["probes"] and set(probes.deployment) >= {"1 x r (TP1)", "2 x r (TP2)"}
    assert probes.passed.all() and (probes.tpot_p99_s < 0.5).all()
    assert main(["capacity", str(cfg), "--slo", "ttft_p99_s=5", "-o", str(folder)]) == 2  # (not over it unasked)
    assert "--overwrite" in capsys.readouterr().err
    assert main(["capacity", str(cfg), "--slo", "tpot_p99_ms=fast"]) == 2
    assert "--slo tpot_p99_ms" in capsys.readouterr().err


PD_CLUSTER = CLUSTER.replace("instances: [{name: r, count: 1}]",
                             "instances: [{name: prefill, count: 2, role: prefill}, {name: decode, count: 1, role: decode}]")


def test_capacity_of_a_pd_config_searches_pd_and_aggregated(tmp_path, capsys):
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(PD_CLUSTER)
    assert main(["capacity", str(cfg), "--slo", "ttft_p99_s=5", "--slo", "tpot_p99_ms=500", "--max-replicas", "2",
                 "-o", str(tmp_path / "cap")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    # loose SLOs: one aggregated replica (1 GPU) first, the smallest P/D deployment (1P:1D, 2 GPUs) next
    assert rows[0].startswith("| 1 | aggregated | 1 | round_robin | 1 | 1 |")
    assert rows[1].startswith("| 2 | P/D | P1:D1 | round_robin | 1P:1D | 2 |")
    assert "prefill: at its minimum (1); decode: at its minimum (1)" in rows[1]
    assert "runner-up: 1 prefill x TP1 + 1 decode x TP1 behind round_robin = 2 GPUs" in out


def test_bad_deployment_flags_name_the_flag(tmp_path, capsys):
    agg = tmp_path / "agg.yaml"
    agg.write_text(CLUSTER)
    single = tmp_path / "single.yaml"
    single.write_text(PD_CLUSTER.split("cluster:")[0])
    slo = ["--slo", "ttft_p99_s=5"]
    for argv, flag in ([str(agg), "--prefill-tp", "1"], "--prefill-tp"), ([str(agg), "--max-decode", "2"], "--max-decode"), \
                      ([str(agg), "--pd", "--max-decode", "0"], "--max-decode"), \
                      ([str(agg), "--pd", "--decode-tp", "2,x"], "--decode-tp"), \
                      ([str(agg), "--pd-only", "--tp", "1"], "--tp"), ([str(single), "--pd"], "--pd"), \
                      ([str(single), "--tp", "2"], "--tp"):
        assert main(["capacity", *argv, *slo]) == 2, argv
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err, (argv, err)


def test_a_config_that_cannot_take_a_pd_shape_fails_before_any_simulation(tmp_path, capsys, monkeypatch):
    import servetwin.experiments.run.cluster_run as cluster_run

    cfg = tmp_path / "offload.yaml"
    cfg.write_text(CLUSTER.replace("instances: [{name: r, count: 1}]", "instances: [{name: r, count: 1, engine: {kv_transfer_config: "
                                   "{kv_connector: OffloadingConnector, kv_role: kv_both, "
                                   "kv_connector_extra_config: {cpu_bytes_to_use: 1000000000}}}}]"))
    monkeypatch.setattr(cluster_run, "simulate_cluster", lambda *a, **k: pytest.fail("simulated before the check"))
    assert main(["capacity", str(cfg), "--slo", "ttft_p99_s=5", "--pd"]) == 2
    err = capsys.readouterr().err
    assert "cluster.instances[0].engine.kv_transfer_config.kv_connector" in err and "NixlConnector" in err


def test_deployment_flags_on_a_single_engine_config_fail_before_loading_it(tmp_path, capsys, monkeypatch):
    """`hardware: auto` can calibrate for minutes while a config loads: a flag that cannot apply is refused first."""
    import servetwin.experiments.run.run_cli as run_cli

    single = tmp_path / "single.yaml"
    single.write_text(PD_CLUSTER.split("cluster:")[0])
    monkeypatch.setattr(run_cli, "_load", lambda *a, **k: pytest.fail("loaded the config before checking the flags"))
    assert main(["capacity", str(single), "--slo", "ttft_p99_s=5", "--pd"]) == 2
    assert "--pd" in capsys.readouterr().err


def test_a_config_that_is_not_a_mapping_is_a_clear_error_with_deployment_flags(tmp_path, capsys):
    cfg = tmp_path / "list.yaml"
    cfg.write_text("- not\n- a mapping\n")
    assert main(["capacity", str(cfg), "--slo", "ttft_p99_s=5", "--pd"]) == 2
    err = capsys.readouterr().err
    assert "must hold a mapping at the top level" in err and "Traceback" not in err


def test_an_interrupted_deployment_search_keeps_the_probes_that_ran(tmp_path, capsys, monkeypatch):
    """Ctrl-C inside the third probe's simulation (which returns its run cut short, `interrupted`) stops the
    search there: that probe is not judged on part of its load."""
    import servetwin.experiments.run.cluster_run as cluster_run

    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(CLUSTER)
    real, calls = cluster_run.simulate_cluster, []

    def stop_in_the_third(exp, progress=False):
        calls.append(exp)
        sim, runs, requests, interrupted = real(exp, progress)
        return sim, runs, requests, interrupted or len(calls) == 3
    monkeypatch.setattr(cluster_run, "simulate_cluster", stop_in_the_third)
    folder = tmp_path / "cap"
    assert main(["capacity", str(cfg), "--slo", "ttft_p99_s=5", "--tp", "1,2", "--max-replicas", "2",
                 "-o", str(folder)]) == 130
    assert "2 deployments simulated so far" in capsys.readouterr().out
    answer = json.loads((folder / "capacity.json").read_text())
    assert answer["interrupted"] is True and answer["deployments"] is None and answer["probes"] == 2
    assert len(pd.read_csv(folder / "probes.csv")) == 2 and "Interrupted" in (folder / "capacity.md").read_text()


def test_over_searches_the_highest_load_of_the_configs_deployment(tmp_path, capsys):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(CLUSTER.replace("count: 1", "count: 2"))
    folder = tmp_path / "load"
    code = main(["capacity", str(cfg), "--slo", "ttft_p99_s=0.5", "--over", "workload.arrival.rate", "--seeds", "1",
                 "--lo", "20", "--hi", "4000", "--max-probes", "6", "--no-plots", "--no-progress", "-o", str(folder)])
    assert code in (0, 1)  # (1: the probes ran out before the bracket closed; the answer is still its bracket)
    answer = json.loads((folder / "capacity.json").read_text())
    (search,) = answer["searches"]
    assert search["interval"][0] >= 20 and search["binding"] == "ttft_p99_s"
    probes = pd.read_csv(folder / "probes.csv")
    assert probes.status.eq("ok").all() and probes.load.nunique() <= 6  # (a row per run: extended probes too)


@pytest.mark.parametrize("argv, flag", [
    (["--over", "workload.arrival.rate", "--tp", "1,2"], "--tp"),  # one search at a time
    (["--over", "workload.arrival.rate", "--router", "llm_d"], "--router"),
    (["--grid", "engine.max_num_seqs=[4,8]"], "--grid"),  # the load search's flags need --over
    (["--seeds", "3"], "--seeds"),
    (["--lo", "5"], "--lo"),
])
def test_flags_of_the_other_search_are_refused_on_a_cluster_config(tmp_path, capsys, argv, flag):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(CLUSTER)
    assert main(["capacity", str(cfg), "--slo", "ttft_p99_s=5", *argv, "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
