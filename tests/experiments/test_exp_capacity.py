"""The capacity search (bracket + k-section, confidence over seeds) and `servetwin capacity` end to end."""
import json

import numpy as np
import pandas as pd
import pytest
from exptest_helpers import tiny, write_yaml

from servetwin.experiments.capacity.capacity import CapacitySearch, judge
from servetwin.experiments.cli import main


def _ev(value: float, limit: float = 1.0, queue: float = None, wait: float = 0.0) -> dict:
    ev = {"met": value <= limit, "checks": [{"name": "ttft_p99_s", "kind": "target", "limit": limit,
                                             "value": value, "met": value <= limit, "ratio": value / limit}]}
    if queue is not None:  # the run's steady_state: its growth from the third to the last quarter
        ev["steady_state"] = {"in_system_growth": queue, "wait_growth": wait}
    return ev


def _drive(search: CapacitySearch, f, seeds: int, k: int = 1) -> dict:
    while not search.done:
        for load in search.next_loads(k):
            search.record(load, [_ev(f(load, s)) for s in range(seeds)])
    return search.result()


def test_judge_needs_the_bound_over_seeds_within_the_limit():
    assert judge(1.0, [_ev(0.5), _ev(0.6), _ev(0.55)], 0.9).passed
    # every seed within the limit, but too spread out to be sure at 90% confidence
    p = judge(1.0, [_ev(0.3), _ev(0.99), _ev(0.6)], 0.9)
    assert not p.passed and p.ratios["ttft_p99_s"] > 1 and p.worst == "ttft_p99_s"
    assert not judge(1.0, [_ev(0.5), None], 0.9).passed  # a failed run fails its probe


def test_a_probe_whose_queue_grows_fails_whatever_its_percentiles():
    # a waiting queue that grows: each request waits longer than the last, well within the percentiles
    growing = judge(1.0, [_ev(0.2, queue=0.0, wait=0.3), _ev(0.25, queue=0.1, wait=0.25), _ev(0.2, queue=0.0, wait=0.35)],
                    0.9)
    assert growing.slo_passed and growing.steady is False
    assert not growing.passed and growing.worst == "steady_state" and growing.ratios["steady_state"] > 1
    # steady: growths are noise of either sign, their mean within 20% / sqrt(seeds)
    steady = judge(1.0, [_ev(0.2, queue=0.15, wait=0.12), _ev(0.2, queue=-0.12, wait=-0.1),
                         _ev(0.2, queue=0.05, wait=0.02), _ev(0.2, queue=-0.1, wait=-0.05)], 0.9)
    assert steady.passed and steady.steady and steady.settled and steady.growth["limit"] == pytest.approx(0.1)
    # the requests in the system still climbing (a batch still filling) with flat waits: passes as it is,
    # but is not settled - the search runs it again, longer
    filling = judge(1.0, [_ev(0.2, queue=0.3, wait=0.0), _ev(0.2, queue=0.25, wait=0.01)], 0.9)
    assert filling.passed and filling.settled is False
    assert not judge(1.0, [_ev(2.0, queue=0.0), _ev(2.0, queue=0.0)], 0.9).slo_passed
    # a failing SLO binds before the growth
    assert judge(1.0, [_ev(2.0, wait=0.5, queue=0.0)] * 2, 0.9).worst == "ttft_p99_s"


def test_a_probe_meeting_its_slo_but_growing_runs_again_longer_then_fails():
    search = CapacitySearch(10.0, requests=1000, max_extend=2)
    assert search.next_loads() == [10.0] and search.length(10.0) == 1000
    p = search.record(10.0, [_ev(0.5, queue=0.0, wait=0.4)] * 2)
    assert not p.passed and 10.0 not in search.probes  # not judged yet: it runs again, twice as long
    assert search.next_loads(3) == [10.0] and search.length(10.0) == 2000
    search.record(10.0, [_ev(0.5, queue=0.4, wait=0.0)] * 2)  # a batch still filling: longer again
    assert search.length(10.0) == 4000 and search.next_loads() == [10.0]
    last = search.record(10.0, [_ev(0.5, queue=0.0, wait=0.4)] * 2)  # waits still grow after 2 extensions: fails
    assert search.probes[10.0] is last and not last.passed and last.requests == 4000 and last.extended == 2
    assert search.next_loads() == [5.0] and search.length(5.0) == 1000  # the search moves on, at its length
    # a probe that turns steady when longer passes at that length, which the answer reports
    search.record(5.0, [_ev(0.5, queue=0.4)] * 2)
    search.record(5.0, [_ev(0.5, queue=0.02, wait=0.01)] * 2)
    assert search.probes[5.0].passed and search.probes[5.0].requests == 2000
    assert search.result()["probe_requests"] == [2000, 4000]
    # a failing SLO is not extended (a longer run only queues more), nor a search without a length
    other = CapacitySearch(10.0)
    other.record(10.0, [_ev(0.5, queue=0.0, wait=0.4)] * 2)
    assert 10.0 in other.probes and not other.probes[10.0].passed
    failing = CapacitySearch(10.0, requests=100)
    failing.record(10.0, [_ev(3.0, queue=0.0, wait=0.4)] * 2)
    assert 10.0 in failing.probes and not failing.pending


@pytest.mark.parametrize("k", [1, 3])
def test_search_finds_a_noiseless_threshold_within_tolerance(k):
    res = _drive(CapacitySearch(10.0, rel_tol=0.01), lambda x, s: x / 37.0, seeds=3, k=k)
    lo, hi = res["interval"]
    assert res["status"] == "ok" and lo <= 37.0 < hi and hi - lo <= 0.01 * lo
    assert res["capacity"] == lo and res["binding"] == "ttft_p99_s"
    assert all(c == pytest.approx(37.0, rel=0.01) for c in res["per_seed_capacity"])


def test_search_under_noise_is_conservative_and_reports_the_seed_spread():
    rng = np.random.default_rng(0)
    scale = {s: 1 + 0.1 * rng.standard_normal() for s in range(4)}  # each seed its own capacity
    f = lambda x, s: x / (50.0 * scale[s])  # noqa: E731
    res = _drive(CapacitySearch(80.0, confidence=0.9), f, seeds=4)
    caps = sorted(50.0 * v for v in scale.values())
    assert res["capacity"] < np.mean(caps)  # the mean of the seeds' limits, bounded at 90%: below their mean
    ci = res["per_seed_capacity_ci95"]
    assert ci["n"] == 4 and ci["ci_lo"] < np.mean(caps) < ci["ci_hi"]
    assert [c for c in res["per_seed_capacity"]] == pytest.approx([50.0 * scale[s] for s in range(4)], rel=0.02)


def test_search_edges_and_integer_loads():
    res = _drive(CapacitySearch(4.0, integer=True), lambda x, s: x / 6.5, seeds=2)
    assert res["interval"] == [6.0, 7.0]
    res = _drive(CapacitySearch(4.0), lambda x, s: 2.0, seeds=2)
    assert res["status"] == "below_range" and res["capacity"] is None and "misses" in res["note"]


def test_capacity_command_on_the_simulator(tmp_path, capsys):
    cfg = tiny(workload__requests=30, workload__arrival={"type": "poisson", "rate": 20.0},
               engine__max_num_seqs=4)
    path = write_yaml(tmp_path / "c.yaml", cfg)
    out = tmp_path / "cap"
    rc = main(["capacity", str(path), "--slo", "ttft_p90_s=0.03", "--seeds", "2", "-o", str(out), "--no-progress",
               "--tol", "0.1", "--grid", "engine.max_num_seqs=[1,4]"])
    assert rc == 0
    answer = json.loads((out / "capacity.json").read_text())
    caps = {r["point"]: r for r in answer["searches"]}
    assert set(caps) == {"max_num_seqs=1", "max_num_seqs=4"}
    for r in caps.values():
        lo, hi = r["interval"]
        assert r["status"] == "ok" and lo < hi <= lo * 1.1 + 1e-9 and r["binding"] == "ttft_p90_s"
        # the answer holds in the probes: the capacity passed, the upper end failed
        assert [p["passed"] for p in r["curve"] if p["load"] == lo] == [True]
        assert [p["passed"] for p in r["curve"] if p["load"] == hi] == [False]
    assert caps["max_num_seqs=4"]["capacity"] > caps["max_num_seqs=1"]["capacity"]
    ci4, ci1 = (caps[k]["per_seed_capacity_ci95"] for k in ("max_num_seqs=4", "max_num_seqs=1"))
    assert ci4["ci_lo"] >= 0 and ci1["ci_lo"] >= 0  # a load interval is clipped at 0
    separated = ci4["ci_lo"] > ci1["ci_hi"]  # a winner only when the intervals separate
    assert (answer["best"] or {}).get("point") == ("max_num_seqs=4" if separated else None)
    probes = pd.read_csv(out / "probes.csv")
    assert {"load", "seed", "requests", "in_system_growth", "wait_growth", "steady", "ttft_p90_s", "check_ttft_p90_s",
            "worst_ratio", "host"} <= set(probes.columns)
    assert set(probes.requests) <= {30, 60, 120, 240}  # 30, or extended while not steady
    assert (probes.status == "ok").all() and set(probes.seed) == {0, 1}
    md = (out / "capacity.md").read_text()
    assert "## Latency vs load: max_num_seqs=4 [sim]" in md
    assert ("Serves the most" in md) == separated and ("No configuration is clearly ahead" in md) != separated
    assert "## What limits the answer" in md and "the mean TTFT" in md  # keeps up: the latency's largest part
    assert (out / "capacity.png").is_file()
    printed = capsys.readouterr().out
    assert ("Serves the most: `max_num_seqs=4`" in printed) == separated and "TTFT" in printed


def test_capacity_command_errors(tmp_path, capsys):
    path = write_yaml(tmp_path / "c.yaml", tiny())
    assert main(["capacity", str(path), "--slo", "ttft_p99_s=1", "-o", str(tmp_path / "o")]) == 2
    assert "--over: workload.arrival is 'offline'" in capsys.readouterr().err
    path = write_yaml(tmp_path / "p.yaml", tiny(workload__arrival={"type": "poisson", "rate": 5.0}))
    assert main(["capacity", str(path), "-o", str(tmp_path / "o")]) == 2
    assert "--slo: no SLO to search under" in capsys.readouterr().err
    assert main(["capacity", str(path), "--slo", "ttft_p9_s=1", "-o", str(tmp_path / "o")]) == 2
    assert "--slo.ttft_p9_s: unknown SLO" in capsys.readouterr().err
    assert main(["capacity", str(path), "--slo", "ttft_p99_s=1", "--grid", "engine.max_num_seqs=4",
                 "-o", str(tmp_path / "o")]) == 2
    assert "--grid engine.max_num_seqs: must be a non-empty YAML list" in capsys.readouterr().err
    assert main(["capacity", str(path), "--slo", "ttft_p99_s=1", "--max-extend", "-1", "-o", str(tmp_path / "o")]) == 2
    assert "--max-extend: must be an integer >= 0" in capsys.readouterr().err


def test_capacity_help_names_its_default_folder(capsys):
    with pytest.raises(SystemExit):
        main(["capacity", "--help"])
    assert "(default: runs/<name>.capacity)" in " ".join(capsys.readouterr().out.split())


def test_ray_missing_says_how_to_install(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    path = write_yaml(tmp_path / "s.yaml", tiny(sweep={"engine.max_num_seqs": [1, 2]}))
    assert main(["sweep", str(path), "-o", str(tmp_path / "o"), "--ray", "--no-progress"]) == 2
    assert "--ray: Ray is not installed: pip install 'servetwin[ray]'" in capsys.readouterr().err


def test_the_capacity_is_confirmed_at_the_longest_probe():
    # a server that holds 12 req/s for 100 requests but only 9 for 200: the answer must hold at 200
    search = CapacitySearch(8.0, rel_tol=0.05, requests=100, max_extend=1)
    while not search.done:
        for load in search.next_loads():
            limit = 12.0 if search.length(load) == 100 else 9.0
            search.record(load, [_ev(load / limit, queue=0.0) for _ in range(3)])
    res = search.result()
    assert res["capacity"] <= 9.0 < res["interval"][1] and res["probe_requests"][0] == 200
    assert search.confirmed_from  # the short passes it re-ran


def test_a_probe_whose_runs_all_fail_is_reported_not_a_crash(tmp_path, capsys, monkeypatch):
    """capacity.md listed every probe's SLO values by name: a probe whose every run raised has none (a KeyError
    lost the whole search's report before)."""
    import servetwin.experiments.run.experiment as experiment

    real = experiment.run_summary

    def fails_above_20(exp, log=None):
        if exp.workload.arrival.rate > 20:
            raise RuntimeError("a run that failed")
        return real(exp, log)
    monkeypatch.setattr(experiment, "run_summary", fails_above_20)
    path = write_yaml(tmp_path / "p.yaml", tiny(workload__requests=20, workload__arrival={"type": "poisson", "rate": 5.0}))
    out = tmp_path / "o"
    main(["capacity", str(path), "--slo", "ttft_p99_s=10", "--seeds", "1", "--retries", "0", "--max-extend", "0",
          "--no-plots", "--no-progress", "-o", str(out)])
    md = (out / "capacity.md").read_text()
    assert "Probe runs that failed" in md and "RuntimeError: a run that failed" in md
    assert json.loads((out / "capacity.json").read_text())["searches"][0]["interval"][0] <= 20


def test_capacity_extends_a_shared_prefix_workload_by_repeating_it():
    from servetwin.experiments.config.schema import extend_requests, validate_config

    raw = {"workload": {"requests": 600, "shared_prefix": {"groups": 60, "per_group": 10, "prefix_tokens": 8,
                                                           "order": "shuffled"}}}
    extend_requests(raw, 2400)
    assert raw["workload"] == {"shared_prefix": {"groups": 60, "per_group": 10, "prefix_tokens": 8,
                                                 "order": "shuffled", "repeat": 4}}
    odd = {"workload": {"shared_prefix": {"groups": 60, "per_group": 10, "prefix_tokens": 8}}}
    extend_requests(odd, 900)  # (not a whole number of patterns: --requests' rule, more groups)
    assert odd["workload"]["shared_prefix"]["groups"] == 90 and "repeat" not in odd["workload"]["shared_prefix"]
    plain = {"workload": {"requests": 100, "prompt_tokens": 8}}
    extend_requests(plain, 200)
    assert plain["workload"]["requests"] == 200
    exp = validate_config({"name": "x", "model": "tiny-llama", "hardware": "h100-sxm", **raw})  # (a key the file takes)
    assert exp.workload.spec.shared_prefix.repeat == 4 and exp.workload.spec.requests == 2400
