"""What limits a result: the binding-resource line of run / sweep / capacity, engine-side SLOs, and
`--api-server-count`."""
import json
import re

import pandas as pd
import pytest
from exptest_helpers import tiny, write_yaml

from servetwin.experiments.run.binding import binding_resource, cluster_binding
from servetwin.experiments.run.steady_state import steady_state
from servetwin.experiments.cli import main
from servetwin.experiments.config.slo import parse_slo


def _summary(fe_util=0.3, kv=0.2, preemptions=0, fe_wait=0.02, q_wait=0.005, completed=100):
    return {"frontend": {"type": "api_server", "cpu_utilization": fe_util, "api_server_count": 1},
            "kv_peak_usage": kv, "preemptions": preemptions, "frontend_in_s": {"mean": fe_wait},
            "queue_s": {"mean": q_wait}, "ttft_s": {"mean": fe_wait + q_wait + 0.05},
            "step_duration_s": {"mean": 0.02, "p50": 0.02, "count": 500}, "engine_duration_s": 20.0,
            "requests": 100, "completed": completed, "rejected": 0, "request_throughput_s": 5.0}


def _state(frontend, engine, in_system=(50.0, 50.0), floor=0.1):
    """A steady_state verdict with these (third quarter, last quarter) waits and in-system counts."""
    w3, w4 = frontend[0] + engine[0], frontend[1] + engine[1]
    q, w = (in_system[1] - in_system[0]) / in_system[0], (w4 - w3) / (w3 + floor)
    return {"in_system": list(in_system), "waits_s": {"frontend": list(frontend), "engine": list(engine)},
            "in_system_growth": q, "wait_growth": w, "floor_s": floor, "growth": max(q, w), "limit": 0.2,
            "steady": max(q, w) <= 0.2}


STEADY = _state((0.02, 0.021), (0.005, 0.006))


def test_a_server_that_keeps_up_is_bound_by_the_arrival_rate():
    b = binding_resource(_summary(), 5.0, STEADY)
    assert b["resource"] == "arrival_rate" and "cannot differ" in b["line"] and "offered 5 req/s" in b["line"]


def test_a_busy_front_end_binds_before_the_gpu():
    # the case: the API server 80% busy, KV 9% used, requests waiting in the front end
    b = binding_resource(_summary(fe_util=0.8, kv=0.09, fe_wait=0.2), 29.0, STEADY)
    assert b["resource"] == "api_server_cpu" and "API server busy 80%" in b["line"] and "KV peak 9%" in b["line"]


def test_growing_queues_name_where_they_grow():
    engine_grows = _state((0.02, 0.02), (0.1, 3.0))
    fe_grows = _state((0.02, 0.9), (0.005, 0.005))
    assert binding_resource(_summary(q_wait=1.5), 29.0, engine_grows)["resource"] == "gpu_compute"
    assert binding_resource(_summary(kv=0.97, q_wait=1.5), 29.0, engine_grows)["resource"] == "kv_capacity"
    assert binding_resource(_summary(preemptions=3), 29.0, engine_grows)["resource"] == "kv_capacity"
    assert binding_resource(_summary(fe_util=0.5, fe_wait=0.4), 29.0, fe_grows)["resource"] == "api_server_cpu"
    assert "waits 25 ms -> 905 ms" in binding_resource(_summary(fe_wait=0.4), 29.0, fe_grows)["line"]


def test_a_queue_still_filling_is_not_keeping_up():
    # the 1,000-request probe: waits flat, but the requests in the system still climb over the
    # second half (the batch has not reached its level): no "keeps up", whatever the waits say
    filling = _state((0.02, 0.02), (0.012, 0.013), in_system=(155.0, 189.0))
    b = binding_resource(_summary(), 30.0, filling)
    assert b["resource"] == "gpu_compute" and "keeps up" not in b["line"]
    assert "requests in the system 155 -> 189 (+22%)" in b["line"]


def test_an_offline_batch_is_never_bound_by_the_arrival_rate():
    s = _summary()
    s["frontend"] = {"type": "offline"}
    assert binding_resource(s, None, STEADY)["resource"] == "gpu_compute"
    assert binding_resource(dict(s, kv_peak_usage=0.95), None, STEADY)["resource"] == "kv_capacity"


def _requests(n, wait, finish_after):
    """`n` requests one per second; request i waits wait(i) and finishes finish_after(i) s after arriving."""
    arrival = [float(i) for i in range(n)]
    return pd.DataFrame({"arrival_s": arrival, "frontend_in_s": [0.0] * n,
                         "queue_s": [wait(i) for i in range(n)],
                         "finish_s": [a + finish_after(i) for i, a in enumerate(arrival)],
                         "client_finish_s": [float("nan")] * n})


def test_steady_state_judges_the_second_half_only():
    # a warm-up whose waits fall (the first half) is not judged; a flat second half is steady
    r = _requests(400, lambda i: 2.0 if i < 200 else 0.01, lambda i: 5.0)
    st = steady_state(r, step_p50_s=0.01)
    assert st["steady"] and abs(st["wait_growth"]) < 1e-9 and st["in_system"][0] == pytest.approx(st["in_system"][1], rel=0.02)
    assert st["window"] == [pytest.approx(199.5), 399.0]


def test_steady_state_sees_waits_and_the_queue_grow():
    # a server serving 0.9 of the arrivals: each request waits 0.1 s longer than the one before
    waits = steady_state(_requests(400, lambda i: 0.1 * i, lambda i: 0.1 * i + 5.0), step_p50_s=0.01)
    assert not waits["steady"] and waits["wait_growth"] > 0.2
    # no queue yet, but each request stays longer: the requests in the system climb (a batch still filling)
    filling = steady_state(_requests(400, lambda i: 0.0, lambda i: 0.05 * i), step_p50_s=0.01)
    assert not filling["steady"] and filling["in_system_growth"] > 0.2 and filling["wait_growth"] == 0.0
    unfinished = _requests(400, lambda i: 0.0, lambda i: 5.0)
    unfinished.loc[300:, "finish_s"] = float("nan")  # never finished: they stay in the system
    assert not steady_state(unfinished, step_p50_s=0.01)["steady"]
    assert steady_state(_requests(10, lambda i: 0.0, lambda i: 1.0), 0.01) is None  # too few to judge
    burst = _requests(50, lambda i: 0.0, lambda i: 1.0).assign(arrival_s=0.0)
    assert steady_state(burst, 0.01) is None  # an offline batch has no arrival window


def test_run_reports_what_binds_and_accepts_engine_slos(tmp_path, capsys):
    cfg = tiny(workload__requests=30, workload__arrival={"type": "poisson", "rate": 20.0},
               slo={"engine_ttft_p99_s": 5.0, "engine_ttft_s": 5.0})
    out = tmp_path / "out"
    assert main(["run", str(write_yaml(tmp_path / "c.yaml", cfg)), "-o", str(out), "--no-progress", "--no-plots",
                 "--api-server-count", "2"]) == 0
    printed = capsys.readouterr().out
    assert "sim: bound by " in printed and "busiest of 2 API servers" in printed
    s = json.loads((out / "summary.json").read_text())["backends"]["sim"]
    assert s["binding"]["resource"] in ("arrival_rate", "gpu_compute", "kv_capacity", "api_server_cpu")
    assert s["frontend"]["api_server_count"] == 2
    assert {c["name"] for c in s["slo"]["checks"]} >= {"engine_ttft_p99_s", "engine_ttft_s"} and s["slo"]["met"]
    assert "## What limits this result" in (out / "report.md").read_text()


def test_engine_slo_names_parse_and_typos_suggest_them():
    spec = parse_slo({"engine_tpot_p50_s": 0.05, "engine_e2e_s": 10})
    assert [t.name for t in spec.targets] == ["engine_tpot_p50_s"] and spec.deadlines[0].name == "engine_e2e_s"
    with pytest.raises(Exception, match="did you mean engine_ttft_p99_s"):
        parse_slo({"engine_ttft_p999_s": 1})


def test_a_sweep_of_arrival_bound_points_says_throughput_cannot_differ(tmp_path, capsys):
    cfg = tiny(workload__requests=20, workload__arrival={"type": "poisson", "rate": 2.0},
               sweep={"engine.max_num_seqs": [4, 8]})
    out = tmp_path / "sw"
    assert main(["sweep", str(write_yaml(tmp_path / "c.yaml", cfg)), "-o", str(out), "--no-progress",
                 "--no-plots"]) == 0
    df = pd.read_csv(out / "sweep.csv")
    assert list(df.bound_by) == ["arrival_rate", "arrival_rate"]
    assert "throughputs are that rate and cannot differ" in (out / "sweep.md").read_text()
    assert "Every point is bound by the arrival rate" in capsys.readouterr().out  # the console says it too


def _engine(resource: str) -> dict:
    return {"binding": {"resource": resource, "line": f"bound by {resource}: why (facts)"}}


def test_a_cluster_that_keeps_up_is_bound_by_the_arrival_rate_whatever_its_engines_guess():
    engines = {f"r-{i}": _engine("arrival_rate") for i in range(4)}
    b = cluster_binding(engines, unfinished=0, state=STEADY)
    assert b["resource"] == "arrival_rate" and "the cluster keeps up" in b["line"]
    assert cluster_binding(engines, 0, None)["line"].count("each of its 4 engines does") == 1  # (no pooled verdict)
    # an engine's own verdict on its short share says it was still filling: the pooled one decides, and says so
    engines["r-2"] = _engine("gpu_compute")
    b = cluster_binding(engines, 0, STEADY)
    assert b["resource"] == "arrival_rate" and "1 of 4 engines (r-2) looked still filling" in b["line"]
    assert cluster_binding(engines, 0, None)["resource"] == "gpu_compute"  # (no pooled verdict: theirs)
    assert cluster_binding({}, 0, STEADY) is None


def test_a_cluster_that_does_not_keep_up_is_bound_by_what_binds_most_of_its_engines():
    engines = {"r-0": _engine("arrival_rate"), "r-1": _engine("gpu_compute"), "r-2": _engine("arrival_rate"),
               "r-3": _engine("kv_capacity"), "r-4": _engine("gpu_compute")}
    growing = _state((0.02, 0.03), (0.005, 0.3))
    b = cluster_binding(engines, 0, growing)
    assert b["resource"] == "gpu_compute" and b["engines"]["gpu_compute"] == ["r-1", "r-4"]
    assert b["line"].startswith("bound by engine compute (the model's steps on its GPU, or CPU) at 2 of 5 engines (r-1, r-4)")
    assert "the arrival rate at 2" in b["line"] and "KV-cache capacity at 1" in b["line"]
    assert b["line"].endswith("r-1: bound by gpu_compute: why (facts)")  # (the first such engine's reasons)
    # a saturated KV pool rules the arrival rate out even where the pooled requests keep up
    assert cluster_binding(engines, 0, STEADY)["resource"] == "gpu_compute"
    assert cluster_binding({"r-0": _engine("arrival_rate"), "r-1": _engine("kv_capacity")}, 0, STEADY)["resource"] \
        == "kv_capacity"
    even = {"r-0": _engine("gpu_compute"), "r-1": _engine("kv_capacity")}  # as many: the more severe
    assert cluster_binding(even, 0, growing)["resource"] == "kv_capacity"
    # every engine keeps up with its share and the whole does not (or requests did not end): compute
    calm = {f"r-{i}": _engine("arrival_rate") for i in range(3)}
    b = cluster_binding(calm, 0, growing)
    assert b["resource"] == "gpu_compute" and "the cluster does not keep up (requests in the system" in b["line"]
    assert "2 requests did not end" in cluster_binding(calm, 2, STEADY)["line"]


def test_a_cluster_run_says_what_limits_it_and_each_engine_is_offered_its_share(tmp_path, capsys):
    cfg = tiny(workload__requests=40, workload__arrival={"type": "poisson", "rate": 20.0},
               cluster={"instances": [{"name": "r", "count": 2}], "router": {"type": "round_robin"}})
    out = tmp_path / "out"
    assert main(["run", str(write_yaml(tmp_path / "c.yaml", cfg)), "-o", str(out), "--no-progress",
                 "--no-plots"]) == 0
    assert "sim: bound by " in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    whole = summary["backends"]["sim"]
    assert whole["binding"]["resource"] in ("arrival_rate", "gpu_compute", "kv_capacity", "api_server_cpu")
    assert "## What limits this result" in (out / "report.md").read_text()
    for s in summary["cluster"]["engines"].values():  # each engine got every other request: ~10 req/s, not 20
        offered = float(re.search(r"offered ([0-9.]+) req/s", s["binding"]["line"]).group(1))
        assert 5.0 < offered < 15.0


def test_a_sweep_of_cluster_points_sets_a_list_item_and_names_what_binds(tmp_path):
    cfg = tiny(workload__requests=20, workload__arrival={"type": "poisson", "rate": 2.0},
               cluster={"instances": [{"name": "r", "count": 1}], "router": {"type": "round_robin"}},
               sweep={"cluster.instances[0].count": [1, 2]})
    out = tmp_path / "sw"
    assert main(["sweep", str(write_yaml(tmp_path / "c.yaml", cfg)), "-o", str(out), "--no-progress",
                 "--no-plots"]) == 0
    df = pd.read_csv(out / "sweep.csv")
    assert list(df.status) == ["ok", "ok"] and df.bound_by.notna().all()
    assert "No point finished" not in (out / "sweep.md").read_text()
    engines = [json.loads((out / p / "summary.json").read_text())["backends"]["sim"]["num_engines"]
               for p in ("count=1", "count=2")]
    assert engines == [1, 2]
