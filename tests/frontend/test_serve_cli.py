"""`servetwin serve` command line: options, engine-argument mapping, start-up errors."""
from __future__ import annotations

import subprocess

import pytest

from servetwin.experiments.cli import build_parser
from servetwin.experiments.serve.serve_cli import engine_args_from
from frontend_utils import PY, REPO, free_port


def test_serve_help_lists_server_and_engine_options(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--model", "--backend", "--host", "--port", "--time-scale", "--max-num-seqs",
                "--enable-prefix-caching", "--num-gpu-blocks", "--async-scheduling"):
        assert opt in out, opt


def test_one_profiler_flag_with_vllm_spelling_and_its_alias(capsys):
    for flag in ("--profiler-dir", "--profile-dir"):
        ns = build_parser().parse_args(["serve", "--backend", "sim", flag, "/tmp/p"])
        assert ns.profiler_dir == "/tmp/p" and engine_args_from(ns).profile_dir is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--profiler-dir DIR, --profile-dir DIR" in out and "PROFILE_DIR" not in out  # one flag, not two


def test_engine_arguments_are_mapped_with_vllm_names(capsys):
    ns = build_parser().parse_args(["serve", "--backend", "sim", "--model", "qwen3-8b", "--max-num-seqs", "7",
                                    "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                                    "--hardware", "h100-sxm", "--time-scale", "0.1"])
    args = engine_args_from(ns)
    assert (args.backend, args.model, args.max_num_seqs, args.enable_prefix_caching) == ("sim", "qwen3-8b", 7, False)
    assert args.gpu_memory_utilization == 0.5 and args.hardware == "h100-sxm" and args.multiprocess
    assert args.tokenizer == "toy" and ns.time_scale == 0.1  # fake / sim answer text through the toy tokenizer
    assert "counts text with the toy tokenizer" in capsys.readouterr().err  # and say so
    ns = build_parser().parse_args(["serve", "--backend", "torch"])
    assert engine_args_from(ns).tokenizer is None


def test_serve_on_a_simulated_gpu_takes_vllm_serves_batch_defaults():
    def limits(*flags: str) -> tuple:
        args = engine_args_from(build_parser().parse_args(["serve", "--backend", "sim", *flags]))
        return args.max_num_batched_tokens, args.max_num_seqs

    assert limits() == (8192, 1024)  # the default simulated GPU, an H100 SXM
    assert limits("--hardware", "a100-80g") == (2048, 256)
    assert limits("--hardware", "a100-80g", "--max-num-seqs", "64") == (2048, 64)
    assert limits("--hardware", "cpu") == (None, 128)  # not a GPU: servetwin's own defaults


def test_serve_takes_an_experiment_yaml_and_flags_override_it(tmp_path):
    (tmp_path / "hw.yaml").write_text("base: cpu\nname: my-cpu\n")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("model: qwen3-0.6b\nhardware: hw.yaml\nbackends: [sim]\nseed: 3\n"
                   "engine: {max_num_seqs: 5, num_gpu_blocks: 64, max_model_len: 256}\n"
                   "workload: {requests: 1, prompt_tokens: 8, output_tokens: 2}\n")
    args = engine_args_from(build_parser().parse_args(["serve", "--config", str(cfg)]))
    assert (args.backend, args.model, args.seed, args.max_num_seqs, args.num_gpu_blocks) == ("sim", "qwen3-0.6b", 3, 5, 64)
    assert args.hardware.name == "my-cpu" and args.tokenizer == "toy" and args.multiprocess  # hw.yaml next to the YAML
    args = engine_args_from(build_parser().parse_args(["serve", "--config", str(cfg), "--max-num-seqs", "9",
                                                       "--model", "tiny-llama"]))
    assert (args.max_num_seqs, args.model) == (9, "tiny-llama")


def test_engine_startup_error_exits_with_the_message():
    # (a bad --policy is now refused by argparse's choices; this one only the engine's config sees)
    res = subprocess.run([PY, "-m", "servetwin.experiments.cli", "serve", "--backend", "fake",
                          "--max-num-batched-tokens", "2", "--port", str(free_port())], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2
    assert "servetwin serve: error: max_num_batched_tokens: 2 must be >= max_num_seqs (128)" in res.stderr


def test_a_port_in_use_or_a_bad_host_fails_before_the_engine_loads():
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        res = subprocess.run([PY, "-m", "servetwin.experiments.cli", "serve", "--backend", "torch", "--port", str(port)],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert f"servetwin serve: error: port: cannot listen on 127.0.0.1:{port}" in res.stderr
    assert time.monotonic() - t0 < 30  # no model load first (it used to load the engine, then exit 3)
    res = subprocess.run([PY, "-m", "servetwin.experiments.cli", "serve", "--backend", "fake", "--host", "256.1.1.1",
                          "--port", str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "servetwin serve: error: host: cannot resolve '256.1.1.1'" in res.stderr


def test_serve_help_explains_engine_flags_with_vllm_metavars(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    assert "ENGINE_" not in text and "--num-gpu-blocks-override N, --num-gpu-blocks N" in text
    assert "\n  --num-gpu-blocks N" not in text  # one option, two spellings (no second entry)
    assert "most requests running at once (default on a simulated GPU: vLLM's" in " ".join(text.split())
    assert "tokens per KV-cache block (default: 16)" in text  # a plain default is appended to the help text
    for spelling in ("--num-gpu-blocks", "--num-gpu-blocks-override"):
        ns = build_parser().parse_args(["serve", "--backend", "fake", spelling, "64", "--scheduling-policy", "priority"])
        args = engine_args_from(ns)
        assert args.num_gpu_blocks == 64 and args.policy == "priority"


def test_scheduling_policy_and_policy_are_one_setting(tmp_path):
    from servetwin.core.config_error import ConfigError  # noqa: PLC0415
    from servetwin.core.engine.engine_args import FIELD_HELP, EngineArgs  # noqa: PLC0415

    parse = build_parser().parse_args
    assert engine_args_from(parse(["serve", "--backend", "fake", "--policy", "priority"])).policy == "priority"
    with pytest.raises(ConfigError, match=r"^scheduling_policy: given together with 'policy'"):
        engine_args_from(parse(["serve", "--backend", "fake", "--policy", "fcfs", "--scheduling-policy", "priority"]))
    with pytest.raises(SystemExit):  # a fixed set of values is offered as argparse choices
        parse(["serve", "--scheduling-policy", "lifo"])
    # a config's policy is overridden by the flag under either name (no "both given" from the config)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny-llama\nhardware: cpu\nbackends: [sim]\nengine: {policy: fcfs, num_gpu_blocks: 64, max_model_len: 256}\n"
                   "workload: {requests: 1, prompt_tokens: 8, output_tokens: 4}\n")
    ns = parse(["serve", "--config", str(cfg), "--backend", "fake", "--scheduling-policy", "priority"])
    assert engine_args_from(ns).policy == "priority"
    assert EngineArgs.from_kwargs(scheduling_policy="priority", backend="fake").policy == "priority"  # LLM(...) too
    # every engine flag has its own help line
    from dataclasses import fields  # noqa: PLC0415

    from servetwin.experiments.serve.serve_cli import OWN_ARGS  # noqa: PLC0415  (flags serve defines itself)

    assert {f.name for f in fields(EngineArgs)} - OWN_ARGS <= set(FIELD_HELP)


def test_speculative_config_flag_takes_vllms_json():
    ns = build_parser().parse_args(["serve", "--backend", "torch", "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}'])
    spec = engine_args_from(ns).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 2, 2, 2)


def test_kv_transfer_config_flag_takes_vllms_json():
    ns = build_parser().parse_args(["serve", "--backend", "sim", "--kv-transfer-config",
                                    '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}'])
    kv = engine_args_from(ns).kv_transfer_config
    assert (kv.kv_connector, kv.kv_role, kv.kv_load_failure_policy) == ("NixlConnector", "kv_consumer", "fail")
    with pytest.raises(ValueError, match="^kv_transfer_config.kv_role: must be one of"):
        engine_args_from(build_parser().parse_args(["serve", "--backend", "sim", "--kv-transfer-config",
                                                    '{"kv_connector": "NixlConnector", "kv_role": "x"}']))
