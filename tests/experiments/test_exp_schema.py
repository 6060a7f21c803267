"""Experiment YAML validation: every error names the YAML path of the bad field, before anything runs."""
import pytest
from exptest_helpers import CONFIGS, tiny, write_yaml

from servetwin.experiments.cli import main
from servetwin.experiments.config.schema import ConfigError, expand_sweep, load_config, validate_config


def _err(cfg) -> str:
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    return str(exc.value)


def test_unknown_engine_key_suggests_the_right_name():
    msg = _err(tiny(engine__max_num_seq=8))
    assert msg.startswith("engine.max_num_seq: unknown key (did you mean max_num_seqs?)")
    assert "max_num_batched_tokens" in msg  # lists what is allowed


def test_unknown_top_level_and_workload_keys():
    assert _err(tiny(backend=["sim"])).startswith("backend: unknown key (did you mean backends?)")
    cfg = tiny()
    cfg["workload"]["prompt_len"] = 32
    assert _err(cfg).startswith("workload.prompt_len: unknown key (did you mean prompt_tokens?)")
    cfg = tiny(workload__shared_prefix={"groups": 2, "per_group": 2, "prefix_tokens": 32, "suffix_len": 4})
    del cfg["workload"]["prompt_tokens"]
    assert _err(cfg).startswith("workload.shared_prefix.suffix_len: unknown key (did you mean suffix_tokens?)")


@pytest.mark.parametrize("key,value,expected", [
    ("engine__max_num_seqs", "x", "engine.max_num_seqs: must be an integer >= 1, got 'x'"),
    ("engine__max_num_seqs", 0, "engine.max_num_seqs: must be an integer >= 1, got 0"),
    ("engine__enable_prefix_caching", "yes", "engine.enable_prefix_caching: must be true or false, got 'yes'"),
    ("engine__gpu_memory_utilization", 1.5, "engine.gpu_memory_utilization: must be a number in (0.0, 1.0]"),
    ("engine__policy", "lifo", "engine.policy: must be one of 'fcfs', 'priority', got 'lifo'"),
    ("engine__dtype", "int3", "engine.dtype: must be one of"),
    ("engine__device", "tpu", "engine.device: must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ("seed", -1, "seed: must be an integer >= 0, got -1"),
    ("backends", ["sim", "gpu"], "backends[1]: must be one of 'sim', 'torch', got 'gpu'"),
    ("hardware", "tpu-v9", "hardware: 'tpu-v9' is neither a preset"),
    ("model", "no-such-model", "model: unknown model 'no-such-model'"),
    ("workload__requests", 0, "workload.requests: must be >= 1, got 0"),
    ("workload__prompt_tokens", {"type": "zipf"}, "workload.prompt_tokens.type: must be one of"),
    ("workload__output_tokens", {"type": "uniform", "low": 5}, "workload.output_tokens.high: required"),
])
def test_bad_values_name_their_path(key, value, expected):
    assert _err(tiny(**{key: value})).startswith(expected)


@pytest.mark.parametrize("arrival,expected", [
    ({"type": "poison", "rate": 2}, "workload.arrival.type: must be one of 'offline', 'poisson'"),
    ({"type": "poisson"}, "workload.arrival.rate: required field is missing"),
    ({"type": "poisson", "rate": -1}, "workload.arrival.rate: must be > 0, got -1"),
    ({"type": "gamma", "rate": 2, "cv": 1, "burst": 3}, "workload.arrival.burst: unknown field"),
    ({"type": "trace", "path": "/nonexistent/trace.csv"}, "workload.arrival.path: file not found"),
])
def test_bad_arrival_names_its_path(arrival, expected):
    assert _err(tiny(workload__arrival=arrival)).startswith(expected)


def test_closed_loop_is_refused_for_the_torch_backend():
    cfg = tiny(backends=["sim", "torch"], workload__arrival={"type": "closed_loop", "clients": 2})
    assert _err(cfg).startswith("workload.arrival.type: 'closed_loop' is only supported by the sim backend")
    validate_config(tiny(workload__arrival={"type": "closed_loop", "clients": 2}))  # fine for sim alone


def test_engine_cross_checks_run_before_anything():
    # the simulator sizes nothing here (num_gpu_blocks given): 64 blocks cannot hold 2048 tokens
    msg = _err(tiny(engine__max_model_len=2048))
    assert msg.startswith("engine.max_model_len: 2048 tokens need 128 blocks")
    msg = _err(tiny(engine__enable_chunked_prefill=False))  # budget 64 < max_model_len 256
    assert msg.startswith("engine.max_num_batched_tokens: 64 is smaller than max_model_len (256)")


@pytest.mark.parametrize("sweep,expected", [
    ({"engine.max_num_seq": [2, 4]}, "sweep.engine.max_num_seq: unknown key (did you mean max_num_seqs?)"),
    ({"engin.max_num_seqs": [2]}, "sweep.engin.max_num_seqs: unknown top-level key 'engin' (did you mean engine?)"),
    ({"engine.max_num_seqs": []}, "sweep.engine.max_num_seqs: must be a non-empty list of values"),
    ({"engine.max_num_seqs": 4}, "sweep.engine.max_num_seqs: must be a non-empty list of values, got 4"),
    ({"engine..x": [1]}, "sweep.engine..x: must be a dotted key"),
    ({"workload.prompt_len": [8]}, "sweep.workload.prompt_len: unknown key (did you mean prompt_tokens?)"),
])
def test_bad_sweep_keys_name_their_path(sweep, expected):
    assert _err(tiny(sweep=sweep)).startswith(expected)


def test_every_point_of_the_grid_is_validated():
    exp = validate_config(tiny(sweep={"engine.max_num_seqs": [2, 0]}))
    with pytest.raises(ConfigError) as exc:
        expand_sweep(exp)
    assert str(exc.value).startswith("sweep.engine.max_num_seqs[1]: value 0 gives an invalid config: "
                                     "engine.max_num_seqs: must be an integer >= 1, got 0")
    exp = validate_config(tiny(sweep={"workload.arrival.type": ["offline", "poisson"]}))
    with pytest.raises(ConfigError) as exc:
        expand_sweep(exp)  # poisson without a rate
    assert "workload.arrival.rate: required field is missing" in str(exc.value)
    exp = validate_config(tiny(sweep={"engine.max_num_seqs": [2, 4], "engine.enable_prefix_caching": [True, False]}))
    points = expand_sweep(exp)
    assert [p.name for p in points] == [
        "max_num_seqs=2__enable_prefix_caching=true", "max_num_seqs=2__enable_prefix_caching=false",
        "max_num_seqs=4__enable_prefix_caching=true", "max_num_seqs=4__enable_prefix_caching=false"]
    assert points[3].raw["engine"]["max_num_seqs"] == 4 and points[3].raw["engine"]["enable_prefix_caching"] is False
    assert "sweep" not in points[0].raw


def test_cli_reports_the_path_and_exits_2(tmp_path, capsys):
    path = write_yaml(tmp_path / "bad.yaml", tiny(engine__max_num_seqs="x"))
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "servetwin run: error: engine.max_num_seqs: must be an integer >= 1, got 'x'" in err
    assert not (tmp_path / "out").exists()  # nothing ran
    assert main(["run", str(tmp_path / "good.yaml"), "--no-progress"]) == 2
    assert "config: file not found" in capsys.readouterr().err
    good = write_yaml(tmp_path / "good.yaml", tiny())
    assert main(["run", str(good), "--set", "engine.max_num_seqs=-3", "--no-progress"]) == 2
    assert "engine.max_num_seqs: must be an integer >= 1, got -3" in capsys.readouterr().err


def test_shipped_configs_validate():
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert {"default.yaml", "seed_production_example.yaml", "reward_prefix_caching.yaml",
            "bench_h100_llama8b.yaml"} <= set(names)
    for name in names:
        exp = load_config(CONFIGS / name)
        if exp.sweep:
            assert len(expand_sweep(exp)) >= 2
    default = load_config(CONFIGS / "default.yaml")
    assert default.backends == ["sim", "torch"] and default.model == "smollm2-135m"
    assert default.workload.source == "prompts" and len(default.workload.prompts) >= 40
    bench = load_config(CONFIGS / "bench_h100_llama8b.yaml")
    assert bench.workload.spec.requests == 10000 and type(bench.workload.arrival).__name__ == "Poisson"


def test_requests_override_keeps_shared_prefix_groups_whole():
    notes = []
    exp = load_config(CONFIGS / "reward_prefix_caching.yaml", requests=32, notes=notes)
    assert exp.workload.spec.shared_prefix.groups == 8 and exp.workload.spec.shared_prefix.per_group == 4
    assert notes and "8 groups x 4" in notes[0]
    exp = load_config(CONFIGS / "default.yaml", requests=3)
    assert [r.id for r in exp.workload.prompts] == ["chat-00", "chat-01", "chat-02"]


def test_scheduling_policy_is_vllms_name_of_policy(tmp_path):
    exp = validate_config(tiny(engine__scheduling_policy="priority"))
    assert exp.engine.args.policy == "priority"
    assert exp.engine.given.get("policy") == "priority" and "scheduling_policy" not in exp.engine.given  # one field
    assert exp.raw["engine"]["policy"] == "priority"
    assert validate_config(tiny(engine__policy="priority")).engine.args.policy == "priority"
    msg = _err(tiny(engine__scheduling_policy="priority", engine__policy="fcfs"))
    assert msg.startswith("engine.scheduling_policy: given together with 'policy'")
    assert _err(tiny(engine__scheduling_policy="lifo")).startswith("engine.scheduling_policy: must be one of")
    # sweeps over vLLM's name work
    points = expand_sweep(validate_config(tiny(sweep={"engine.scheduling_policy": ["fcfs", "priority"]})))
    assert [p.config.engine.args.policy for p in points] == ["fcfs", "priority"]


@pytest.mark.parametrize("hardware, frontend, expected", [
    ("h100-sxm", "offline", (16384, 1024)),  # vLLM's LLM class on a GPU of >= 70 GiB
    ("h100-sxm", "api_server", (8192, 1024)),  # vllm serve there
    ("h200", "api_server", (8192, 1024)),
    ("a100-80g", "offline", (8192, 256)),  # an A100 keeps the small set whatever its memory
    ("a100-80g", "api_server", (2048, 256)),
    ("l40s", "api_server", (2048, 256)),  # 44.5 GiB
])
def test_gpu_runs_take_vllms_batch_defaults_for_that_gpu(hardware, frontend, expected):
    exp = validate_config({"model": "llama-3.1-8b", "hardware": hardware, "backends": ["sim"],
                           "frontend": {"type": frontend},
                           "workload": {"requests": 2, "prompt_tokens": 16, "output_tokens": 2}})
    assert (exp.engine.args.max_num_batched_tokens, exp.engine.args.max_num_seqs) == expected
    # recorded in config.yaml, and what the scheduler runs with
    assert (exp.raw["engine"]["max_num_batched_tokens"], exp.raw["engine"]["max_num_seqs"]) == expected
    assert exp.engine_args("sim").scheduler_config(4096).max_num_batched_tokens == expected[0]


def test_given_batch_limits_win_and_cpu_runs_keep_servetwins_defaults():
    work = {"requests": 2, "prompt_tokens": 16, "output_tokens": 2}
    exp = validate_config({"model": "llama-3.1-8b", "hardware": "a100-80g", "backends": ["sim"],
                           "engine": {"max_num_seqs": 512}, "workload": work})
    assert (exp.engine.args.max_num_seqs, exp.engine.args.max_num_batched_tokens) == (512, 8192)  # budget >= seqs
    exp = validate_config({"model": "llama-3.1-8b", "hardware": "a100-80g", "backends": ["sim"],
                           "engine": {"max_num_batched_tokens": 4096}, "workload": work})
    assert (exp.engine.args.max_num_seqs, exp.engine.args.max_num_batched_tokens) == (256, 4096)
    exp = validate_config({"model": "tiny-llama", "hardware": "cpu", "backends": ["sim"], "workload": work})
    assert (exp.engine.args.max_num_seqs, exp.engine.args.max_num_batched_tokens) == (128, None)
    assert "max_num_seqs" not in exp.raw["engine"]


def test_max_cudagraph_capture_size_is_checked():
    from servetwin.core.config_error import ConfigError
    from servetwin.experiments.config.schema import validate_config

    base = {"name": "x", "model": "llama-3.1-8b", "hardware": "h100-sxm", "backends": ["sim"],
            "workload": {"requests": 2, "prompt_tokens": 8, "output_tokens": 2}}
    ok = validate_config({**base, "engine": {"max_cudagraph_capture_size": 2048}})
    assert ok.engine.args.max_cudagraph_capture_size == 2048
    with pytest.raises(ConfigError) as e:
        validate_config({**base, "engine": {"max_cudagraph_capture_size": 0}})
    assert e.value.path == "engine.max_cudagraph_capture_size"


def test_speculative_config_is_vllms_mapping_checked_by_path():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    exp = validate_config(tiny(backends=["torch"], engine__speculative_config=spec))
    assert exp.engine_args("torch").speculative_config.prompt_lookup_min == 4
    assert _err(tiny(engine__speculative_config={"method": "medusa", "num_speculative_tokens": 3})).startswith(
        "engine.speculative_config.method: must be one of ngram, eagle, mtp, draft_model")
    assert _err(tiny(engine__speculative_config={"num_speculative_tokens": 3, "lookup": 2})).startswith(
        "engine.speculative_config.lookup: unknown key")


def test_kv_transfer_config_is_vllms_mapping_checked_by_path():
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 24}}
    exp = validate_config(tiny(backends=["sim"], engine__kv_transfer_config=kv))
    assert exp.engine_args("sim").kv_transfer_config.kv_connector == "OffloadingConnector"
    assert _err(tiny(engine__kv_transfer_config={"kv_connector": "NixlConnector", "role": "x"})).startswith(
        "engine.kv_transfer_config.role: unknown key")
    assert _err(tiny(engine__kv_transfer_config={"kv_role": "kv_both"})).startswith(
        "engine.kv_transfer_config.kv_connector: required")


def test_set_reaches_list_items_by_index_and_names_a_missing_one():
    from servetwin.experiments.config.schema import parse_override, set_dotted

    raw = {"cluster": {"instances": [{"name": "p", "count": 2}, {"name": "d"}]}}
    key, value = parse_override("cluster.instances[1].engine.tensor_parallel_size=4")
    set_dotted(raw, key, value)
    set_dotted(raw, *parse_override("cluster.instances[0].count=3"))
    assert raw["cluster"]["instances"] == [{"name": "p", "count": 3},
                                           {"name": "d", "engine": {"tensor_parallel_size": 4}}]
    for key, path in [("cluster.instances[2].count", "cluster.instances[2]"),  # no third instance
                      ("cluster.router[0].type", "cluster.router"),  # (missing: a list is never made up)
                      ("cluster.instances.count", "cluster.instances"),  # a list, not a mapping
                      ("cluster.instances[0].count.x", "cluster.instances[0].count")]:
        with pytest.raises(ConfigError) as err:
            set_dotted(raw, key, 1)
        assert err.value.path == path
    for text in ("cluster.instances[-1].count=1", "cluster.instances[x].count=1", "cluster..x=1", "[0]=1"):
        with pytest.raises(ConfigError, match="is not a dotted key"):
            parse_override(text)
