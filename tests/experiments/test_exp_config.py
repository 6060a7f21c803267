"""The experiment YAML is parsed once into typed objects; errors are typed; paths are relative to the YAML."""
import json

import pytest
from exptest_helpers import SCENARIOS, tiny, write_yaml

from servetwin.core.config_error import ConfigError
from servetwin.experiments.config.schema import (SECTIONS, EngineConfig, ExperimentConfig, OutputConfig, WorkloadConfig,
                                          load_config, validate_config)
from servetwin.experiments.config.workloads import build_requests

TINY_QWEN = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 32000, "max_position_embeddings": 4096}


def test_config_error_carries_the_field_path_apart_from_the_message():
    with pytest.raises(ConfigError) as exc:
        validate_config(tiny(workload__arrival={"type": "poisson", "rate": -1}))
    assert exc.value.path == "workload.arrival.rate" and exc.value.message == "must be > 0, got -1"
    assert str(exc.value) == "workload.arrival.rate: must be > 0, got -1"
    with pytest.raises(ConfigError) as exc:  # an EngineArgs / scheduler error, placed under engine:
        validate_config(tiny(engine__max_model_len=2048))
    assert exc.value.path == "engine.max_model_len"
    with pytest.raises(ConfigError) as exc:  # a model error stays at the top level
        validate_config(tiny(model="no-such-model"))
    assert exc.value.path == "model"
    assert ConfigError("max_num_seqs", "m").within("engine").path == "engine.max_num_seqs"
    assert ConfigError("[2]", "m").within("backends").path == "backends[2]"
    from servetwin.core.testbed.scenario import ScenarioError  # noqa: PLC0415

    nested = ScenarioError("max_num_seqs", "m").within("settings")  # a subclass stays itself when nested
    assert type(nested) is ScenarioError and str(nested) == "settings.max_num_seqs: m"


def test_sections_parse_into_typed_objects():
    exp = validate_config(tiny(output={"plots": False}))
    assert isinstance(exp, ExperimentConfig) and isinstance(exp.engine, EngineConfig)
    assert isinstance(exp.workload, WorkloadConfig) and isinstance(exp.output, OutputConfig)
    assert exp.output == OutputConfig(step_requests=True, plots=False)
    args = exp.engine_args("sim")
    assert (args.backend, args.max_num_seqs, args.model, args.seed) == ("sim", 4, "tiny-llama", 0)
    assert args.hardware is exp.hardware_spec and exp.hardware_spec.name
    assert exp.engine_args("torch").hardware is None
    assert exp.engine.given["num_gpu_blocks"] == 64
    assert exp.workload.spec.requests == 6 and exp.workload.source == "synthetic"
    assert [s.key for s in SECTIONS][:2] == ["name", "description"]
    assert {s.key for s in SECTIONS} == set(ExperimentConfig.__dataclass_fields__) - {"raw", "base_dir",
                                                                                    "hardware_spec"}


def test_the_workload_is_parsed_once(monkeypatch):
    """Building the requests generates from the parsed spec; it never parses the YAML section again."""
    import servetwin.sim.workload as wl

    exp = validate_config(tiny())
    calls = []
    real = wl.WorkloadSpec.from_dict
    monkeypatch.setattr(wl.WorkloadSpec, "from_dict", classmethod(lambda cls, *a, **k: calls.append(a) or
                                                                  real.__func__(cls, *a, **k)))
    requests, arrival, _ = build_requests(exp, vocab_size=256)
    assert len(requests) == 6 and calls == [] and type(arrival).__name__ == "Offline"
    assert all(max(r.prompt_token_ids) < 256 for r in requests)


def _layout(tmp_path):
    """configs/exp.yaml next to models/, hw/, traces/, scenarios/: every path written relative to configs/."""
    for d in ("configs", "models/q", "hw", "traces", "scen", "elsewhere"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    (tmp_path / "models/q/config.json").write_text(json.dumps(TINY_QWEN))
    (tmp_path / "hw/my.yaml").write_text("base: cpu\nname: my-cpu\n")
    (tmp_path / "traces/t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,12,3\n0.5,20,4\n")
    (tmp_path / "traces/lens.txt").write_text("8\n9\n10\n")
    (tmp_path / "scen/s.json").write_text((SCENARIOS / "c_tight_kv.json").read_text())
    return tmp_path / "configs"


@pytest.mark.parametrize("workload,source", [
    ({"file": "../traces/t.csv"}, "file"),
    ({"requests": 2, "arrival": {"type": "trace", "path": "../traces/t.csv"}}, "synthetic"),
    ({"requests": 3, "prompt_tokens": {"type": "empirical", "path": "../traces/lens.txt"}, "output_tokens": 2},
     "synthetic"),
    ({"scenario": "../scen/s.json"}, "scenario"),
])
def test_every_path_is_relative_to_the_yaml_file(tmp_path, monkeypatch, workload, source):
    cfg_dir = _layout(tmp_path)
    monkeypatch.chdir(tmp_path / "elsewhere")  # the working directory must not matter
    cfg = tiny(model="../models/q", hardware="../hw/my.yaml", workload=workload)
    cfg["engine"]["max_model_len"] = 512
    exp = load_config(write_yaml(cfg_dir / "exp.yaml", cfg))
    assert exp.model == str((tmp_path / "models/q").resolve())
    assert exp.hardware == str((tmp_path / "hw/my.yaml").resolve()) and exp.hardware_spec.name == "my-cpu"
    assert exp.workload.source == source
    requests, _, _ = build_requests(exp, vocab_size=32000)
    assert requests and all(max(r.prompt_token_ids) < 32000 for r in requests)


def test_a_relative_path_is_not_looked_up_in_the_working_directory(tmp_path, monkeypatch):
    cfg_dir = _layout(tmp_path)
    monkeypatch.chdir(tmp_path)  # "models/q" exists here, but not next to the YAML
    with pytest.raises(ConfigError) as exc:
        load_config(write_yaml(cfg_dir / "a.yaml", tiny(model="./models/q")))
    assert exc.value.path == "model" and "relative to the config file's folder" in exc.value.message
    with pytest.raises(ConfigError) as exc:
        load_config(write_yaml(cfg_dir / "b.yaml", tiny(workload={"file": "traces/t.csv"})))
    assert exc.value.path == "workload.file"
    with pytest.raises(ConfigError) as exc:
        load_config(write_yaml(cfg_dir / "c.yaml", tiny(hardware="hw/my.yaml")))
    assert exc.value.path == "hardware"


def test_file_with_an_arrival_process_keeps_the_lengths_and_replaces_the_times(tmp_path):
    _layout(tmp_path)
    trace = str(tmp_path / "traces/t.csv")
    exp = validate_config(tiny(workload={"file": trace, "arrival": {"type": "poisson", "rate": 2.0}}))
    requests, arrival, _ = build_requests(exp, vocab_size=256)
    assert type(arrival).__name__ == "Poisson"
    assert [len(r.prompt_token_ids) for r in requests] == [12, 20] and requests[0].arrival_s > 0


def test_a_workload_vocab_larger_than_the_model_is_a_typed_error():
    exp = validate_config(tiny(workload__vocab_size=1000))
    with pytest.raises(ConfigError) as exc:
        build_requests(exp, vocab_size=256)
    assert exc.value.path == "workload.vocab_size"


def test_the_simulation_reports_through_callbacks():
    from servetwin.experiments.run.runner import create_engine
    from servetwin.sim.engine import Simulation

    exp = validate_config(tiny(workload__requests=4))
    engine, info = create_engine(exp, "sim")
    requests, arrival, rng = build_requests(exp, info.vocab_size)
    requests.append(type(requests[0])("too-long", 0.0, [11] * 400, 4))  # > max_model_len 256: never servable
    done, rejected = [], []
    sim = Simulation(engine, requests, arrival, rng=rng, on_complete=lambda rid, t: done.append((rid, t)),
                     on_reject=lambda rid, why: rejected.append(rid))
    result = sim.run()
    assert sorted(r for r, _ in done) == sorted(result.completion_s) and len(done) == 4
    assert all(t == result.completion_s[r] for r, t in done)
    assert rejected == ["too-long"] == list(result.rejected)
