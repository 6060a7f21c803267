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
    assert c.num_gpus == 4 and c.instances[0].engine == {"max_num_seqs": 8}
    assert c.instances[1].hardware_spec.name != exp.hardware_spec.name
    assert [s.type for s in c.router.scorers] == ["queue", "kv-cache-utilization"] and c.router.scorers[0].weight == 2
    assert c.links["kv_transfer"] is LINK_PRESETS["roce-400g"] and c.links["cpu_tier"].efficiency == 0.8
    assert c.router.pd_threshold_tokens == 16


@pytest.mark.parametrize("cluster, path", [
    ({"instances": []}, "cluster.instances"),
    ({"instances": [{"count": 0}]}, "cluster.instances[0].count"),
    ({"instances": [{"role": "prefil"}]}, "cluster.instances[0].role"),
    ({"instances": [{"role": "prefill"}]}, "cluster.instances[0].role"),
    ({"instances": [{"replicas": 2}]}, "cluster.instances[0].replicas"),
    ({"instances": [{"engine": {"max_num_seqs": 0}}]}, "cluster.instances[0].engine.max_num_seqs"),
    ({"instances": [{"engine": {"max_num_seq": 4}}]}, "cluster.instances[0].engine.max_num_seq"),
    ({"instances": [{"hardware": "h1000"}]}, "cluster.instances[0].hardware"),
    ({"instances": [{"name": "x"}, {"name": "x"}]}, "cluster.instances[1].name"),
    ({"instances": [{}], "router": {"type": "llm_d"}}, "cluster.router.scorers"),
    ({"instances": [{}], "router": {"type": "round_robin", "scorers": ["queue"]}}, "cluster.router.scorers"),
    ({"instances": [{}], "router": {"scrape_interval_s": 0}}, "cluster.router.scrape_interval_s"),
    ({"instances": [{}], "router": {"type": "fastest"}}, "cluster.router.type"),
    ({"instances": [{}], "router": {"type": "llm_d", "scorers": ["queu"]}}, "cluster.router.scorers[0].type"),
    ({"instances": [{}], "router": {"type": "llm_d", "scorers": [{"type": "load-aware", "treshold": 3}]}},
     "cluster.router.scorers[0]"),
    ({"instances": [{}], "links": {"kv_transfer": "nvlink9"}}, "cluster.links.kv_transfer"),
    ({"instances": [{}], "links": {"kv_transfer": {"latency_us": 2}}}, "cluster.links.kv_transfer.bandwidth_gbps"),
    ({"instances": [{}], "links": {"wan": "roce-400g"}}, "cluster.links.wan"),
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
