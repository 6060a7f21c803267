"""The `cluster:` section of the experiment YAML: typed, validated with errors naming the field."""
from __future__ import annotations

import copy

import pytest

from servetwin.core.config_error import ConfigError
from servetwin.experiments.config.schema import validate_config
from servetwin.sim.links import LINK_PRESETS

BASE = {"name": "c", "model": "tiny-llama", "hardware": "h100-sxm",
        "engine": {"max_num_seqs": 16, "max_model_len": 512}, "workload": {"requests": 4}}


def _cfg(cluster):
    raw = copy.deepcopy(BASE)
    raw["cluster"] = cluster
    return validate_config(raw)


def test_a_cluster_parses_into_typed_instances_router_and_links():
    exp = _cfg({"instances": [{"name": "a", "count": 2, "engine": {"max_num_seqs": 8}},
                              {"name": "b", "data_parallel_size": 2, "hardware": "h200"}],
                "router": {"type": "llm_d", "scorers": [{"type": "queue", "weight": 2}, "kv-cache-utilization"]},
                "links": {"kv_transfer": "roce-400g", "cpu_tier": {"preset": "pcie5-x16", "efficiency": 0.8}}})
    c = exp.cluster
    assert [n for n, _ in c.expanded()] == ["a-0", "a-1", "b"]
    assert c.num_gpus() == 4 and c.num_gpus(2) == 8 and c.instances[0].engine == {"max_num_seqs": 8}
    assert c.instances[1].hardware_spec.name != exp.hardware_spec.name
    assert [s.type for s in c.router.scorers] == ["queue", "kv-cache-utilization"] and c.router.scorers[0].weight == 2
    assert c.links["kv_transfer"] is LINK_PRESETS["roce-400g"] and c.links["cpu_tier"].efficiency == 0.8
    assert c.router.pd_threshold_tokens == 16


@pytest.mark.parametrize("cluster, path", [
    ({"instances": []}, "cluster.instances"),
    ({"instances": [{"count": 0}]}, "cluster.instances[0].count"),
    ({"instances": [{"role": "prefil"}]}, "cluster.instances[0].role"),
    ({"instances": [{"role": "prefill"}]}, "cluster.instances"),  # a P/D cluster needs a decode instance
    ({"instances": [{"replicas": 2}]}, "cluster.instances[0].replicas"),
    ({"instances": [{"engine": {"max_num_seqs": 0}}]}, "cluster.instances[0].engine.max_num_seqs"),
    ({"instances": [{"engine": {"max_num_seq": 4}}]}, "cluster.instances[0].engine.max_num_seq"),
    ({"instances": [{"hardware": "h1000"}]}, "cluster.instances[0].hardware"),
    ({"instances": [{"name": "x"}, {"name": "x"}]}, "cluster.instances[1].name"),
    ({"instances": [{}], "router": {"type": "llm_d"}}, "cluster.router.scorers"),
    ({"instances": [{}], "router": {"type": "round_robin", "scorers": ["queue"]}}, "cluster.router.type"),
    ({"instances": [{}], "router": {"type": "llmd", "scorers": ["queue"]}}, "cluster.router.type"),  # a typo
    ({"instances": [{}], "router": {"scrape_interval_s": 0}}, "cluster.router.scrape_interval_s"),
    ({"instances": [{}], "router": {"type": "fastest"}}, "cluster.router.type"),
    ({"instances": [{}], "router": {"type": "llm_d", "scorers": ["queu"]}}, "cluster.router.scorers[0].type"),
    ({"instances": [{}], "router": {"type": "llm_d", "scorers": [{"type": "load-aware", "treshold": 3}]}},
     "cluster.router.scorers[0]"),
    ({"instances": [{}], "links": {"kv_transfer": "nvlink9"}}, "cluster.links.kv_transfer"),
    ({"instances": [{}], "links": {"kv_transfer": {"latency_us": 2}}}, "cluster.links.kv_transfer.bandwidth_gbps"),
    ({"instances": [{}], "links": {"wan": "roce-400g"}}, "cluster.links.wan"),
    ({"instances": [{"data_parallel_lb": "spread"}]}, "cluster.instances[0].data_parallel_lb"),
    ({"instances": [{"data_parallel_size": 4, "data_parallel_lb": "hybrid"}]},
     "cluster.instances[0].data_parallel_size_local"),
    ({"instances": [{"data_parallel_size": 4, "data_parallel_lb": "hybrid", "data_parallel_size_local": 3}]},
     "cluster.instances[0].data_parallel_size_local"),
    ({"instances": [{"data_parallel_size": 4, "data_parallel_size_local": 2}]},
     "cluster.instances[0].data_parallel_size_local"),
    ({"instances": [{"role": "prefill"}, {"role": "decode"}],  # llm-d's in-flight load: not on the P/D path
      "prefill_router": {"type": "llm_d", "scorers": ["token-load"], "params": {"in_flight_load": {}}}},
     "cluster.prefill_router.params.in_flight_load"),
    ({"instances": [{"role": "prefill"}, {"role": "decode"}],
      "router": {"type": "llm_d", "scorers": ["token-load"], "params": {"in_flight_load": {}}}},
     "cluster.router.params.in_flight_load"),
])
def test_bad_fields_are_named(cluster, path):
    with pytest.raises(ConfigError) as err:
        _cfg(cluster)
    assert err.value.path == path


def test_a_cluster_runs_in_the_simulator_only():
    raw = copy.deepcopy(BASE)
    raw.update(backends=["sim", "torch"], cluster={"instances": [{}]})
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    assert err.value.path == "backends"


def test_every_link_preset_names_its_source():
    for link in LINK_PRESETS.values():
        assert link.source and link.bandwidth_gbps > 0
        assert link.transfer_s(10**9) > link.latency_us * 1e-6


def test_one_engine_commands_refuse_a_cluster_and_the_cli_names_the_field(tmp_path, capsys):
    import yaml

    from servetwin.experiments.cli import main
    from servetwin.experiments.run.runner import run_backends

    with pytest.raises(ConfigError) as err:
        run_backends(_cfg({"instances": [{"count": 2}]}), progress=False, log=lambda m: None)
    assert err.value.path == "cluster"
    raw = copy.deepcopy(BASE)
    raw["cluster"] = {"instances": [{"role": "decode"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["run", str(path), "-o", str(tmp_path / "out")]) == 2
    assert "cluster.instances: a prefill/decode cluster needs a prefill instance" in capsys.readouterr().err


def test_servetwin_run_writes_the_cluster_outputs(tmp_path):
    import json

    import pandas as pd
    import yaml

    from servetwin.experiments.cli import main

    raw = copy.deepcopy(BASE)
    raw["workload"] = {"requests": 12, "prompt_tokens": 64, "output_tokens": 8, "arrival": {"type": "poisson", "rate": 50}}
    raw["output"] = {"step_requests": False, "plots": False}
    raw["cluster"] = {"instances": [{"name": "a", "count": 2}, {"name": "b", "data_parallel_size": 2}],
                      "router": {"type": "round_robin"}, "links": {"kv_transfer": "nvlink4"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert main(["run", str(path), "-o", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    whole = summary["backends"]["sim"]
    assert whole["completed"] == 12 and whole["num_engines"] == 4 and whole["num_gpus"] == 4
    assert set(summary["cluster"]["engines"]) == {"a-0", "a-1", "b-r0", "b-r1"}
    assert sum(s["requests"] for s in summary["cluster"]["engines"].values()) == 12
    decisions = pd.read_parquet(out / "sim" / "router_decisions.parquet")
    assert sorted(decisions.request_id) == sorted(set(decisions.request_id)) and len(decisions) == 12
    assert list(decisions.pick[:3]) == ["a-0", "a-1", "b"]
    assert whole["links"]["kv_transfer"]["name"] == "nvlink4"
    for label in summary["cluster"]["engines"]:
        assert (out / "sim" / "instances" / label / "requests.parquet").exists()
    # the trace: one Perfetto process per engine (its steps and requests), then the router's decisions
    trace = json.loads((out / "sim" / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert [names[p].split(" ")[0] for p in sorted(names)] == ["a-0", "a-1", "b-r0", "b-r1", "router"]
    steps = [e for e in trace["traceEvents"] if e.get("tid") == 1 and e["ph"] == "X"]
    assert {e["pid"] for e in steps} == {1, 2, 3, 4}  # every engine stepped
    for pid, label in zip((1, 2, 3, 4), ("a-0", "a-1", "b-r0", "b-r1")):
        served = {e["name"] for e in trace["traceEvents"]
                  if e["pid"] == pid and e["ph"] == "X" and e["name"].startswith("req-")}
        assert len(served) == summary["cluster"]["engines"][label]["requests"]
    routed = [e for e in trace["traceEvents"] if e["pid"] == 5 and e["ph"] == "i"]
    assert len(routed) == 12
    report = (out / "report.md").read_text()
    assert "## Whole cluster" in report and all(f"| {label} |" in report for label in summary["cluster"]["engines"])


def test_cluster_figures_are_drawn(tmp_path):
    import yaml

    from servetwin.experiments.cli import main

    raw = copy.deepcopy(BASE)
    raw["workload"] = {"requests": 6, "prompt_tokens": 64, "output_tokens": 4, "arrival": {"type": "poisson", "rate": 50}}
    raw["output"] = {"step_requests": False, "plots": True}
    raw["cluster"] = {"instances": [{"name": "a", "count": 2}], "router": {"type": "round_robin"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]) == 0
    png = tmp_path / "out" / "sim" / "cluster_engines.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sim/cluster_engines.png" in (tmp_path / "out" / "report.md").read_text()
