"""The experiment YAML, parsed once into typed config objects that every command consumes.

    name: my-run                      # default: the config file's stem
    description: free text            # optional
    seed: 0                           # engine seed and default workload seed
    model: tiny-llama                 # required. A model preset / HF id the loaders know, or a path (relative to this file)
    hardware: cpu                     # sim: a hardware preset, a hardware/calibration YAML path, or a mapping
    backends: [sim, torch]            # any non-empty subset of sim, torch
    engine:                           # vLLM engine-argument names (servetwin.core.engine.engine_args.EngineArgs)
      max_num_seqs: 128
      scheduling_policy: priority     # vLLM's name of `policy` (fcfs | priority); give one of the two
      ...
    workload:
      requests: 100                   # number of requests (the count of a file/scenario to use)
      arrival: {type: poisson, rate: 4.0}        # offline | poisson | gamma | closed_loop | trace
      prompt_tokens: {type: uniform, low: 16, high: 96}   # an integer or a servetwin.sim.lengths distribution
      output_tokens: 32
      shared_prefix: {groups: 8, per_group: 4, prefix_tokens: 512, suffix_tokens: 16, order: grouped}
      n: 1                            # parallel sampling
      file: trace.csv                 # request trace (arrival_s, prompt_tokens, output_tokens, ...)
      scenario: scenario.json         # a replay scenario's requests (exact token ids)
      timeout_s: 30                   # sim only: the client aborts a request not finished 30 s after arrival
      seed / vocab_size / max_prompt_tokens / max_output_tokens / priority / finish   (servetwin.sim.workload)
    frontend: {type: api_server, endpoint: completions}   # sim: the modelled front end (default by arrival)
    output: {step_requests: true, plots: true}
    sweep:                            # a grid: every combination of the lists is one run
      engine.enable_prefix_caching: [true, false]

`load_config(path)` / `validate_config(mapping, base_dir)` return an `ExperimentConfig`: one typed field
per top-level key (`engine: EngineConfig`, `workload: WorkloadConfig`, `output: OutputConfig`, ...).
Nothing downstream parses the YAML again: `run`, `sweep` and `compare` build engines from
`exp.engine_args(backend)` and requests from `exp.workload` (`servetwin.experiments.config.workloads`).
Every bad field raises `ConfigError(path, message)` (`servetwin.core.config_error`), whose `path` is the
field's YAML path. Every path in the file (model, hardware, workload.file, workload.arrival.path,
workload.scenario, length files) is relative to the YAML file's folder (`base_dir`), never to the
working directory.

Adding a top-level section (e.g. `slo:`):
  1. a dataclass (slots) holding the parsed section, with defaults for an absent section;
  2. a parse function `parse_slo(value, ctx) -> SloConfig` that validates `value` (None when the key is
     absent) and raises `ConfigError` naming `slo.<field>`; `ctx.base_dir` resolves paths,
     `ctx.parsed` holds the sections parsed before it (table order), e.g. `ctx.parsed["backends"]`;
  3. one `Section("slo", parse_slo)` entry in `SECTIONS` and one field `slo: SloConfig` on
     `ExperimentConfig` (same name). The key is then allowed at the top level, sweepable as
     `slo.<field>` (unless `sweepable=False`), and present in every point of a sweep.
Checks across sections go into `CROSS_CHECKS` (functions of the finished `ExperimentConfig`).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import itertools
import json
import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import (MOE_BACKENDS, EngineArgs, apply_batch_defaults, not_supported_yet,
                                               resolve_aliases)
from servetwin.core.kv_cache.hashing import HASH_ALGOS
from servetwin.core.sched.spec_decode import SpeculativeConfig
from servetwin.core.kv_connector.config import KVTransferConfig

__all__ = ["ConfigError", "ExperimentConfig", "EngineConfig", "WorkloadConfig", "OutputConfig", "ParseContext",
           "Section", "SECTIONS", "load_config", "validate_config", "expand_sweep", "SweepPoint"]


# -- small validators ---------------------------------------------------------------------------
_SHORT = reprlib.Repr()  # bounded: formats a few items and levels of a value, never the whole of it
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 3, 6, 6


def _fmt(v: Any) -> str:
    """A value for an error message: bounded, whatever its size (an aliased YAML list may stand for
    millions of items)."""
    try:
        return _SHORT.repr(v)
    except ValueError:  # an integer over Python's 4300-digit formatting limit
        return f"an integer of {v.bit_length()} bits" if isinstance(v, int) else type(v).__name__


# vLLM 0.33 takes any block_size > 0 in CacheConfig (vllm/config/cache.py:187), then the attention
# backend must support it: every CUDA one (FlashAttention, Triton, FlexAttention) advertises
# `MultipleOf(16)` (vllm/v1/attention/backends/flash_attn.py:367, triton_attn.py:340,
# flex_attention.py:154), so `--block-size 3` starts no server. An experiment models such a server.
KV_BLOCK_SIZE_MULTIPLE = 16


def _kv_block_size(v: Any, path: str) -> int:
    size = _int(1)(v, path)
    if size % KV_BLOCK_SIZE_MULTIPLE:
        raise ConfigError(path, f"must be a multiple of {KV_BLOCK_SIZE_MULTIPLE} (vLLM's GPU attention backends "
                                f"support no other KV block size), got {size}")
    return size


def _int(low: Optional[int] = None, nullable: bool = False, also: tuple = ()) -> Callable[[Any, str], Any]:
    def check(v: Any, path: str) -> Any:
        if v is None and nullable:
            return None
        if v in also and not isinstance(v, bool):
            return v
        ok = isinstance(v, int) and not isinstance(v, bool)
        if not ok and isinstance(v, float) and v.is_integer():
            v, ok = int(v), True
        if not ok and isinstance(v, str) and re.fullmatch(r"[0-9.]+[eE][+]?[0-9]+", v.strip()):
            f = float(v)  # YAML 1.1 reads 1e9 as a string
            if f.is_integer():
                v, ok = int(f), True
        what = "an integer" + (f" >= {low}" if low is not None else "")
        if also:
            what += " or " + " or ".join(map(str, also))
        if nullable:
            what += " (or null)"
        if not ok or (low is not None and v < low):
            raise ConfigError(path, f"must be {what}, got {_fmt(v)}")
        return v
    return check


def _float(low: float, high: float, low_open: bool = False, high_open: bool = False,
           nullable: bool = False) -> Callable[[Any, str], Any]:
    def check(v: Any, path: str) -> Any:
        if v is None and nullable:
            return None
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        what = f"a number in {lo}{low}, {high}{hi}"
        x = v
        if isinstance(x, str):
            try:
                x = float(x)
            except ValueError:
                pass
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ConfigError(path, f"must be {what}, got {_fmt(v)}")
        if x < low or x > high or (low_open and x == low) or (high_open and x == high):
            raise ConfigError(path, f"must be {what}, got {_fmt(v)}")
        return float(x)
    return check


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(path, f"must be true or false, got {_fmt(v)}")
    return v


def _choice(*allowed: str) -> Callable[[Any, str], str]:
    def check(v: Any, path: str) -> str:
        if v not in allowed:
            raise ConfigError(path, f"must be one of {', '.join(map(repr, allowed))}, got {_fmt(v)}")
        return v
    return check


def _optional_choice(*allowed: str) -> Callable[[Any, str], Optional[str]]:
    def check(v: Any, path: str) -> Optional[str]:
        if v is not None and v not in allowed:
            raise ConfigError(path, f"must be null or one of {', '.join(map(repr, allowed))}, got {_fmt(v)}")
        return v
    return check


def _device(v: Any, path: str) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
        raise ConfigError(path, f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {_fmt(v)}")
    return v


def _nonempty_str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(path, f"must be a non-empty string, got {_fmt(v)}")
    return v


def _mapping(v: Any, path: str) -> Mapping:
    if not isinstance(v, Mapping):
        raise ConfigError(path, f"must be a mapping, got {type(v).__name__} {_fmt(v)}")
    return v


def _check_keys(cfg: Mapping, allowed: Mapping | set | tuple, path: str,
                hints: Optional[dict[str, str]] = None,
                unsupported: Optional[Callable[[str], Optional[str]]] = None) -> None:
    """Refuse a key not in `allowed`, naming the closest allowed one; `unsupported(key)`: a known key not
    implemented yet gets that message instead (vLLM engine arguments: `not_supported_yet`)."""
    names = sorted(allowed)
    for key in cfg:
        if key in allowed:
            continue
        if unsupported is not None and isinstance(key, str) and unsupported(key):
            raise ConfigError(f"{path}.{key}" if path else key, unsupported(key))
        hint = (hints or {}).get(key) if isinstance(key, str) else None
        if hint is None and isinstance(key, str):
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = close[0] if close else None
        where = f"{path}.{key}" if path else str(key)
        dym = f" (did you mean {hint}?)" if hint else ""
        raise ConfigError(where, f"unknown key{dym}; allowed: {', '.join(names)}")


def _engine_key_unsupported(key: str) -> Optional[str]:
    """An engine key a single-engine YAML does not take: vLLM's DP sizes belong to a cluster instance (the
    simulator runs DP ranks as engines behind vLLM's balancer there); else `not_supported_yet`."""
    if key in ("data_parallel_size", "data_parallel_size_local"):
        return (f"vLLM's {key} is set per instance in a cluster section: cluster: {{instances: [{{{key}: 2}}]}} "
                "(docs/cluster.md); the engine section describes one engine")
    return not_supported_yet(key)


# -- paths --------------------------------------------------------------------------------------
def resolve_path(value: Any, path: str, base_dir: Path, what: str = "file") -> str:
    """A path from the YAML, relative to the YAML's folder; must exist. Returns it absolute."""
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"must be a {what} path, got {_fmt(value)}")
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = base_dir / p
    if not p.exists():
        raise ConfigError(path, f"{what} not found: {value} (relative paths are relative to the config "
                                f"file's folder {base_dir})")
    return str(p.resolve())


def _looks_like_path(value: str) -> bool:
    return value.startswith(("./", "../", "~", "/")) or value.endswith((".json", ".yaml", ".yml"))


@dataclass(slots=True)
class ParseContext:
    """What a section's parse function may use: the YAML's folder and the sections parsed before it."""
    base_dir: Path
    parsed: dict[str, Any] = field(default_factory=dict)


# -- the sections -------------------------------------------------------------------------------
BACKENDS = ("sim", "torch")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float")
ATTENTION_BACKENDS = ("auto", "torch-paged", "flash-attn")  # servetwin.gpu.attention.selector

ENGINE_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "max_num_seqs": _int(1),
    "max_num_batched_tokens": _int(1, nullable=True),
    "enable_chunked_prefill": _bool,
    "long_prefill_token_threshold": _int(0),
    "enable_prefix_caching": _bool,
    "prefix_caching_hash_algo": _choice(*HASH_ALGOS),
    "block_size": _kv_block_size,
    "gpu_memory_utilization": _float(0.0, 1.0, low_open=True),
    "num_gpu_blocks": _int(2, nullable=True),
    "max_model_len": _int(2, nullable=True, also=(-1,)),
    "policy": _choice("fcfs", "priority"),
    "scheduling_policy": _choice("fcfs", "priority"),  # vLLM's name of `policy` (ENGINE_ARG_ALIASES)
    "async_scheduling": _bool,
    "tensor_parallel_size": _int(1),
    "pipeline_parallel_size": _int(1),
    "dtype": _choice(*DTYPES),
    "enforce_eager": _bool,
    "max_cudagraph_capture_size": _int(1, nullable=True),
    "scheduler_reserve_full_isl": _bool,
    "watermark": _float(0.0, 1.0, high_open=True),
    "kv_cache_memory_bytes": _int(1, nullable=True),
    "quantization": _optional_choice("fp8"),
    "kv_cache_dtype": _choice("auto", "fp8"),
    "fuse_allreduce_rms": _bool,
    "moe_backend": _choice(*MOE_BACKENDS),
    "enable_fi_allreduce_fusion": _bool,  # vLLM 0.11's name of `fuse_allreduce_rms` (ENGINE_ARG_ALIASES)
    "attention_backend": _choice(*ATTENTION_BACKENDS),
    "device": _device,
    "speculative_config": lambda v, path: _speculative_config(v),
    "spec_acceptance_rates": lambda v, path: v,  # EngineArgs checks it (errors name engine.spec_acceptance_rates)
    "kv_transfer_config": lambda v, path: _kv_transfer_config(v, path),
    "disable_hybrid_kv_cache_manager": _bool,  # vLLM --disable-hybrid-kv-cache-manager: one full-attention group
}
OUTPUT_FIELDS: dict[str, Callable[[Any, str], Any]] = {"step_requests": _bool, "plots": _bool}
# servetwin.sim.workload's fields (same names), plus `scenario` (a replay scenario's requests)
WORKLOAD_KEYS = ("requests", "arrival", "prompt_tokens", "output_tokens", "shared_prefix", "n", "file", "seed",
                 "vocab_size", "max_prompt_tokens", "max_output_tokens", "priority", "finish", "timeout_s",
                 "scenario", "lengths", "conversations", "prompts")
WORKLOAD_HINTS = {"num_requests": "requests", "prompt_len": "prompt_tokens", "output_len": "output_tokens",
                  "prefix": "shared_prefix", "trace": "file", "prefix_len": "shared_prefix",
                  "sharegpt": "lengths", "multi_turn": "conversations", "multiturn": "conversations",
                  "chat": "conversations"}
SHARED_PREFIX_KEYS = ("groups", "per_group", "prefix_tokens", "suffix_tokens", "order", "repeat")
# EngineArgs fields an experiment YAML sets at the top level, not under `engine:`
TOP_LEVEL_ENGINE_ARGS = ("model", "seed", "hardware", "backend")


def _speculative_config(value: Any) -> Any:
    """vLLM's `speculative_config` mapping, checked here (errors name `engine.speculative_config.<key>`)
    and kept as given (config.yaml writes it back as a mapping)."""
    try:
        SpeculativeConfig.from_dict(value)
    except ConfigError as e:
        raise e.within("engine") from None
    return value


def _kv_transfer_config(value: Any, path: str = "engine.kv_transfer_config") -> Any:
    """vLLM's `kv_transfer_config` mapping, checked here (errors name `<engine section>.kv_transfer_config.<key>`;
    the connector's extra config once the block size is known, in EngineArgs) and kept as given."""
    try:
        KVTransferConfig.from_dict(value)
    except ConfigError as e:
        raise e.within(path.rsplit(".", 1)[0]) from None
    return value


def engine_field_path(err: ConfigError) -> ConfigError:
    """An `EngineArgs`/executor error (path = the argument's name) as the YAML path of that argument."""
    head = re.split(r"[.\[]", err.path, maxsplit=1)[0]
    return err if head in TOP_LEVEL_ENGINE_ARGS else err.within("engine")


def parse_name(value: Any, ctx: ParseContext) -> str:
    name = _nonempty_str(value, "name")
    if not re.fullmatch(r"[A-Za-z0-9._+=-]+", name):
        raise ConfigError("name", f"must use only letters, digits and . _ + = -, got {name!r}")
    return name


def parse_description(value: Any, ctx: ParseContext) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError("description", f"must be a string, got {_fmt(value)}")
    return value


def parse_seed(value: Any, ctx: ParseContext) -> int:
    return _int(0)(0 if value is None else value, "seed")


def parse_model(value: Any, ctx: ParseContext) -> str:
    """A name the loaders know (preset, HF id alias), or a model folder / config.json relative to the YAML."""
    if value is None:  # no silent default: the model decides sizes, KV pool and step costs
        raise ConfigError("model", "required field is missing (a built-in name such as tiny-llama, "
                                   "smollm2-135m or llama-3.1-8b, or a model folder)")
    model = _nonempty_str(value, "model")
    if _looks_like_path(model) or (ctx.base_dir / model).exists():
        return resolve_path(model, "model", ctx.base_dir, "model path")
    return model


def parse_hardware(value: Any, ctx: ParseContext) -> Any:
    """A preset name, a hardware/calibration YAML path (relative to the YAML) or an inline mapping."""
    from servetwin.sim.hardware import HARDWARE_PRESETS  # noqa: PLC0415  (no torch: cheap)

    from servetwin.experiments.calibrate.auto_calibration import AUTO  # noqa: PLC0415
    from servetwin.sim.hardware import preset_name, unknown_hardware  # noqa: PLC0415

    hw = "h100-sxm" if value is None else value
    if isinstance(hw, Mapping):
        return copy.deepcopy(dict(hw))
    if not isinstance(hw, str) or not hw:
        raise ConfigError("hardware", f"must be a preset name, a YAML path or a mapping, got {_fmt(hw)}")
    if hw in HARDWARE_PRESETS:
        return hw
    if hw.strip().lower() == AUTO:  # this machine's CPU, calibrated on first use (experiments/calibrate/auto_calibration.py)
        return AUTO
    p = Path(hw).expanduser()
    p = p if p.is_absolute() else ctx.base_dir / p
    if not p.is_file():
        preset = preset_name(hw)  # `H100`, `A100`: any case, the common names
        if preset is not None:
            return preset
        raise unknown_hardware(hw, f" (relative to the config file's folder {ctx.base_dir}); `auto` calibrates "
                                   "this machine's CPU")
    return str(p.resolve())


def parse_backends(value: Any, ctx: ParseContext) -> list[str]:
    backends = ["sim"] if value is None else value
    if isinstance(backends, str):
        backends = [backends]
    if not isinstance(backends, list) or not backends:
        raise ConfigError("backends", f"must be a non-empty list of {', '.join(BACKENDS)}, got {_fmt(backends)}")
    for i, b in enumerate(backends):
        if b not in BACKENDS:
            raise ConfigError(f"backends[{i}]", f"must be one of {', '.join(map(repr, BACKENDS))}, got {_fmt(b)}")
    if len(set(backends)) != len(backends):
        raise ConfigError("backends", f"duplicate entries in {backends}")
    return list(backends)


@dataclass(slots=True)
class EngineConfig:
    """`engine:` plus the top-level model and seed, as vLLM engine arguments."""
    args: EngineArgs  # every argument (defaults filled in); `backend` is set per run by `engine_args`
    given: dict[str, Any] = field(default_factory=dict)  # the fields the YAML sets (validated values)


def parse_engine(value: Any, ctx: ParseContext) -> EngineConfig:
    engine = dict(_mapping(value or {}, "engine"))
    _check_keys(engine, ENGINE_FIELDS, "engine", {"num_gpu_blocks_override": "num_gpu_blocks"},
                _engine_key_unsupported)
    for key, check in ENGINE_FIELDS.items():
        if key in engine:
            engine[key] = check(engine[key], f"engine.{key}")
    try:
        engine = resolve_aliases(engine)  # one field per setting from here on (`given`, config.yaml)
        args = EngineArgs.from_kwargs(**engine, model=ctx.parsed["model"], seed=ctx.parsed["seed"],
                                      backend=ctx.parsed["backends"][0])
    except ConfigError as e:
        raise engine_field_path(e) from None
    return EngineConfig(args, engine)


@dataclass(slots=True)
class OutputConfig:
    step_requests: bool = True  # the per-request rows of every step (step_requests.parquet)
    plots: bool = True


def parse_output(value: Any, ctx: ParseContext) -> OutputConfig:
    output = _mapping(value or {}, "output")
    _check_keys(output, OUTPUT_FIELDS, "output")
    return OutputConfig(**{key: check(output[key], f"output.{key}") for key, check in OUTPUT_FIELDS.items()
                           if key in output})


@dataclass(slots=True)
class WorkloadConfig:
    """The requests of a run: a synthetic/trace workload (`spec`) or a replay scenario's requests."""
    seed: int
    spec: Any = None  # servetwin.sim.workload.WorkloadSpec (None with a scenario)
    scenario: Any = None  # servetwin.core.testbed.scenario.Scenario
    scenario_path: Optional[str] = None
    scenario_arrival: Any = None  # the arrival process that re-times a scenario's requests (None: its times)
    requests: Optional[int] = None  # a scenario's (or a prompt file's) first N requests
    given: dict[str, Any] = field(default_factory=dict)  # the section as written (paths resolved)
    prompts: Optional[list] = None  # servetwin.experiments.config.prompt_file.PromptRecord (text prompts)

    @property
    def arrival(self) -> Any:
        """The arrival process of the run."""
        from servetwin.sim.arrivals import Offline  # noqa: PLC0415

        if self.spec is not None:
            return self.spec.arrival
        return self.scenario_arrival or Offline()

    @property
    def source(self) -> str:
        if self.prompts is not None:
            return "prompts"
        return "scenario" if self.scenario is not None else "file" if "file" in self.given else "synthetic"


def parse_workload(value: Any, ctx: ParseContext) -> WorkloadConfig:
    if value is None:
        raise ConfigError("workload", "required field is missing")
    w = dict(_mapping(value, "workload"))
    _check_keys(w, WORKLOAD_KEYS, "workload", WORKLOAD_HINTS)
    sources = [src for src in ("file", "scenario", "prompts") if src in w]
    if len(sources) > 1:
        raise ConfigError(f"workload.{sources[1]}", f"not allowed together with workload.{sources[0]} (give one source)")
    for src in sources:
        w[src] = resolve_path(w[src], f"workload.{src}", ctx.base_dir)
        for key in ("prompt_tokens", "output_tokens", "shared_prefix", "lengths", "conversations"):
            if key in w and not (src == "prompts" and key == "output_tokens"):
                raise ConfigError(f"workload.{key}", f"not allowed with workload.{src} (the file gives the lengths)")
    if "shared_prefix" in w:
        sp = _mapping(w["shared_prefix"], "workload.shared_prefix")
        _check_keys(sp, SHARED_PREFIX_KEYS, "workload.shared_prefix",
                    {"suffix_len": "suffix_tokens", "prefix_len": "prefix_tokens"})
    arrival = w.get("arrival")
    if isinstance(arrival, Mapping) and arrival.get("type") == "trace" and "path" in arrival:
        w["arrival"] = {**arrival, "path": resolve_path(arrival["path"], "workload.arrival.path", ctx.base_dir)}
    for key in ("prompt_tokens", "output_tokens"):  # `{type: empirical, path: ...}` length files
        dist = w.get(key)
        if isinstance(dist, Mapping) and "path" in dist:
            w[key] = {**dist, "path": resolve_path(dist["path"], f"workload.{key}.path", ctx.base_dir)}
    for section, keys in (("shared_prefix", ("suffix_tokens",)), ("lengths", ("prompt", "output")),
                          ("conversations", ("turns", "first_prompt", "message_tokens", "output_tokens"))):
        if section in w:
            w[section] = _resolve_dist_paths(w[section], section, keys, ctx)
    if isinstance(w.get("lengths"), Mapping) and isinstance(w["lengths"].get("path"), str):  # a pairs file
        w["lengths"] = {**w["lengths"], "path": resolve_path(w["lengths"]["path"], "workload.lengths.path",
                                                             ctx.base_dir)}
    if "conversations" in w and "torch" in ctx.parsed["backends"]:
        raise ConfigError("workload.conversations", "multi-turn conversations are only supported by the sim "
                          "backend (each turn waits for the previous answer's tokens)")
    seed = _int(0)(w.get("seed", ctx.parsed["seed"]), "workload.seed")
    if "scenario" in w:
        return _parse_scenario_workload(w, seed, ctx)
    if "prompts" in w:
        return _parse_prompt_workload(w, seed, ctx)
    from servetwin.sim.workload import WorkloadSpec  # noqa: PLC0415  (no torch: cheap)

    if w.get("timeout_s") is not None and "torch" in ctx.parsed["backends"]:
        raise ConfigError("workload.timeout_s", "client timeouts are only modelled by the sim backend")
    spec = WorkloadSpec.from_dict({"seed": seed, **w}, "workload")
    if spec.arrival.closed_loop and "torch" in ctx.parsed["backends"]:
        raise ConfigError("workload.arrival.type", "'closed_loop' is only supported by the sim backend "
                                                   "(the torch backend replays open-loop arrival times)")
    return WorkloadConfig(seed=seed, spec=spec, given=w)


def _resolve_dist_paths(section: Any, name: str, keys: tuple[str, ...], ctx: ParseContext) -> Any:
    """`section` with the `path` of each `{type: empirical, path: ...}` length form under `keys`
    resolved against the config's folder (the section itself is validated by its parser)."""
    if not isinstance(section, Mapping):
        return section
    out = dict(section)
    for key in keys:
        dist = out.get(key)
        if isinstance(dist, Mapping) and isinstance(dist.get("path"), str):
            out[key] = {**dist, "path": resolve_path(dist["path"], f"workload.{name}.{key}.path", ctx.base_dir)}
    return out


def _file_workload_common(w: dict[str, Any], src: str, ctx: ParseContext) -> tuple[Optional[int], Any]:
    """(first N requests, the arrival process or None) of a workload whose file gives every request."""
    from servetwin.sim.arrivals import parse_arrival  # noqa: PLC0415

    for key in ("n", "priority", "finish", "max_prompt_tokens", "max_output_tokens", "vocab_size", "timeout_s"):
        if key in w:
            raise ConfigError(f"workload.{key}", f"not allowed with workload.{src} "
                                                 f"(the {src} file gives every request's fields)")
    requests = _int(1)(w["requests"], "workload.requests") if "requests" in w else None
    arrival = parse_arrival(w["arrival"], "workload.arrival") if w.get("arrival") is not None else None
    if arrival is not None and arrival.closed_loop and "torch" in ctx.parsed["backends"]:
        raise ConfigError("workload.arrival.type", "'closed_loop' is only supported by the sim backend "
                                                   "(the torch backend replays open-loop arrival times)")
    return requests, arrival


def _parse_prompt_workload(w: dict[str, Any], seed: int, ctx: ParseContext) -> WorkloadConfig:
    from servetwin.experiments.config.prompt_file import load_prompt_file  # noqa: PLC0415

    requests, arrival = _file_workload_common(w, "prompts", ctx)
    default_max = w.get("output_tokens")
    if default_max is not None and (isinstance(default_max, bool) or not isinstance(default_max, int)
                                    or default_max < 1):
        raise ConfigError("workload.output_tokens", "with workload.prompts: a constant integer >= 1 (the output "
                                                    "length of lines without max_tokens)")
    records = load_prompt_file(w["prompts"], default_max)
    if requests is not None:
        records = records[:requests]
    from servetwin.sim.arrivals import Offline  # noqa: PLC0415

    return WorkloadConfig(seed=seed, scenario_arrival=arrival or Offline(), requests=requests, given=w,
                          prompts=records)


def _parse_scenario_workload(w: dict[str, Any], seed: int, ctx: ParseContext) -> WorkloadConfig:
    from servetwin.core.testbed.scenario import load_scenario  # noqa: PLC0415

    requests, arrival = _file_workload_common(w, "scenario", ctx)
    try:
        sc = load_scenario(w["scenario"])
    except ConfigError as e:
        raise ConfigError("workload.scenario", f"{w['scenario']}: {e}") from None
    if sc.uses_events:  # scripted tokens and step-indexed aborts have no meaning on a real model
        raise ConfigError("workload.scenario", f"{w['scenario']} uses scenario events (aborts, stop_at, "
                          "stop_token_ids, min_tokens, ignore_eos), which only `servetwin replay` plays")
    if arrival is None:
        late = [r.id for r in sc.requests if r.arrival_step > 0 and r.arrival_time is None]
        if late:
            raise ConfigError("workload.scenario",
                              f"request {late[0]!r} arrives at a later step; step-indexed arrivals "
                              "have no time here: set workload.arrival (e.g. {type: offline}) or use `servetwin replay`")
    return WorkloadConfig(seed=seed, scenario=sc, scenario_path=w["scenario"], scenario_arrival=arrival,
                          requests=requests, given=w)


def parse_frontend_section(value: Any, ctx: ParseContext) -> Any:
    """`frontend: {type: api_server, endpoint: chat|completions, coefficients: ...}` or `{type: offline}`
    (`servetwin.sim.frontend.FrontendConfig`); absent: an API server for online arrivals, the offline LLM
    for an offline batch."""
    from servetwin.sim.frontend import default_frontend, parse_frontend  # noqa: PLC0415  (no torch)

    if value is None:
        w = ctx.parsed["workload"]
        from servetwin.sim.arrivals import Offline  # noqa: PLC0415

        offline = isinstance(w.arrival, Offline)
        return default_frontend(online=not offline)
    if isinstance(value, Mapping) and "type" not in value and value:  # `--api-server-count 4` alone: a server
        value = {"type": "api_server", **value}
    if isinstance(value, Mapping) and isinstance(value.get("coefficients"), str):
        cand = Path(value["coefficients"]).expanduser()
        if not cand.is_absolute() and (ctx.base_dir / cand).is_file():
            value = dict(value, coefficients=str((ctx.base_dir / cand).resolve()))
    return parse_frontend(value, "frontend")


def parse_seeds(value: Any, ctx: ParseContext) -> list[int]:
    """`seeds: [0, 1, 2]` (distinct integers >= 0), or `seeds: N` for N seeds from `seed` on; null or
    absent: one run with `seed`."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError("seeds", f"a count must be >= 1, got {value}")
        if value > MAX_RUNS:  # built as a list below; --seeds N with --max-runs allows more
            raise ConfigError("seeds", f"{value:,} seeds, more than the limit of {MAX_RUNS:,} runs")
        return list(range(ctx.parsed["seed"], ctx.parsed["seed"] + value))
    if not isinstance(value, list) or not value:
        raise ConfigError("seeds", f"must be a non-empty list of integers (or a count), got {_fmt(value)}")
    out = [_int(0)(s, f"seeds[{i}]") for i, s in enumerate(value)]
    if len(set(out)) != len(out):
        raise ConfigError("seeds", f"duplicate seeds in {out}")
    return out


def parse_slo_section(value: Any, ctx: ParseContext) -> Any:
    """`slo:` targets and deadlines (`servetwin.experiments.config.slo.SloSpec`; empty: no SLO)."""
    from servetwin.experiments.config.slo import parse_slo  # noqa: PLC0415

    return parse_slo(value, "slo")


def _instance_engine(value: Any, path: str) -> dict[str, Any]:
    """A cluster instance's `engine:` overrides, checked as the top-level `engine:` fields are."""
    engine = dict(_mapping(value, path))
    _check_keys(engine, ENGINE_FIELDS, path, {"num_gpu_blocks_override": "num_gpu_blocks"})
    for key, check in ENGINE_FIELDS.items():
        if key in engine:
            engine[key] = check(engine[key], f"{path}.{key}")
    try:
        return resolve_aliases(engine)
    except ConfigError as e:
        raise e.within(path) from None


def parse_cluster_section(value: Any, ctx: ParseContext) -> Any:
    from servetwin.experiments.config.cluster import parse_cluster  # noqa: PLC0415

    return parse_cluster(value, _instance_engine)


def parse_sweep(value: Any, ctx: ParseContext) -> dict[str, list[Any]]:
    return _validate_sweep_shape(value or {})


@dataclass(frozen=True, slots=True)
class Section:
    """One top-level key: `parse(value or None, ctx)` gives the `ExperimentConfig` field of that name."""
    key: str
    parse: Callable[[Any, ParseContext], Any]
    sweepable: bool = True


# Parsed in this order (a section sees the ones above it in `ctx.parsed`).
SECTIONS: tuple[Section, ...] = (
    Section("name", parse_name, sweepable=False),
    Section("description", parse_description, sweepable=False),
    Section("seed", parse_seed),
    Section("seeds", parse_seeds, sweepable=False),
    Section("model", parse_model),
    Section("hardware", parse_hardware),
    Section("backends", parse_backends),
    Section("engine", parse_engine),
    Section("workload", parse_workload),
    Section("frontend", parse_frontend_section),
    Section("cluster", parse_cluster_section),
    Section("output", parse_output),
    Section("slo", parse_slo_section),
    Section("sweep", parse_sweep, sweepable=False),
)
TOP_KEYS = tuple(s.key for s in SECTIONS)


@dataclass(slots=True)
class ExperimentConfig:
    name: str
    description: str
    seed: int
    model: str  # a loader name or an absolute path
    hardware: Any  # preset name, absolute YAML path, or an inline mapping
    backends: list[str]
    engine: EngineConfig
    workload: WorkloadConfig
    output: OutputConfig
    sweep: dict[str, list[Any]]
    seeds: list[int]  # repeat the run per seed (empty: once, with `seed`)
    slo: Any  # servetwin.experiments.config.slo.SloSpec (empty: no SLO)
    frontend: Any  # servetwin.sim.frontend.FrontendConfig
    raw: dict[str, Any] = field(default_factory=dict)  # the validated input (paths resolved)
    base_dir: str = "."
    hardware_spec: Any = None  # servetwin.sim.hardware.HardwareSpec, parsed when a backend is "sim"
    cluster: Any = None  # servetwin.experiments.config.cluster.ClusterConfig (None: one engine)

    def engine_args(self, backend: str) -> EngineArgs:
        """The engine arguments of one backend (the simulator's carry the parsed hardware)."""
        return dataclasses.replace(self.engine.args, backend=backend,
                                   hardware=self.hardware_spec if backend == "sim" else None)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)


def _resolve_auto_hardware(exp: ExperimentConfig) -> None:
    """`hardware: auto`: this machine's CPU calibration for the model, measured on first use and cached
    (experiments/calibrate/auto_calibration.py); config.yaml keeps `auto`, the run's provenance names the file."""
    from servetwin.experiments.calibrate.auto_calibration import AUTO, ensure_calibration  # noqa: PLC0415

    if exp.hardware != AUTO:
        return
    device = str(exp.engine.given.get("device", "cpu"))
    if device.startswith("cuda"):
        raise ConfigError("hardware", "auto calibrates this machine's CPU; for a GPU give its preset, or "
                                      "calibrate it with `servetwin calibrate --device cuda`")
    if "sim" not in exp.backends:
        exp.hardware = "cpu"  # nothing is simulated: no calibration needed (torch runs use its own threads)
        return
    dtype = str(exp.engine.given.get("dtype", "auto"))
    exp.hardware = ensure_calibration(exp.model, "float32" if dtype == "auto" else dtype)


def _check_hardware(exp: ExperimentConfig) -> None:
    """The simulator's hardware and model spec (cheap: no torch)."""
    if "sim" not in exp.backends:
        return
    from servetwin.sim.hardware import hardware_from_dict, load_hardware  # noqa: PLC0415
    from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

    hw = exp.hardware
    exp.hardware_spec = hardware_from_dict(hw, "hardware") if isinstance(hw, dict) else load_hardware(hw)
    load_model_spec(exp.model)


def _apply_vllm_batch_defaults(exp: ExperimentConfig) -> None:
    """`max_num_batched_tokens` / `max_num_seqs` left out of `engine:` take vLLM's defaults for the
    simulated GPU and the entry point (an API-server front end: `vllm serve`'s, else the offline
    `LLM`'s), as the run would get from vLLM; config.yaml records the values."""
    if exp.hardware_spec is None:
        return
    given = exp.engine.given
    filled = apply_batch_defaults({**given, "backend": "sim", "hardware": exp.hardware_spec},
                                  api_server=exp.frontend.type == "api_server")
    new = {k: filled[k] for k in ("max_num_batched_tokens", "max_num_seqs") if k in filled and k not in given}
    if new:
        exp.engine = EngineConfig(dataclasses.replace(exp.engine.args, **new), {**given, **new})
        exp.raw["engine"] = dict(exp.engine.given)


SIM_ONLY_ENGINE_ARGS = {"quantization": None, "kv_cache_dtype": "auto", "fuse_allreduce_rms": False,
                        "moe_backend": "auto"}  # name -> the value every backend runs


def _check_sim_only_engine_args(exp: ExperimentConfig) -> None:
    for backend in exp.backends:
        if backend == "sim":
            continue
        for key, plain in SIM_ONLY_ENGINE_ARGS.items():
            if exp.engine.given.get(key, plain) != plain:
                raise ConfigError(f"engine.{key}", f"{exp.engine.given[key]!r} is simulated only (the {backend} "
                                                   "backend runs the model's own dtype); use backends: [sim]")


def _check_engine_semantics(exp: ExperimentConfig) -> None:
    """Cross-field checks that need the model (cheap for the sim: sizes its KV pool, no torch)."""
    if "sim" not in exp.backends:
        return
    from servetwin.sim.kv_pool import build_sim_executor  # noqa: PLC0415

    args = exp.engine_args("sim")
    try:
        info = build_sim_executor(args)
        args.scheduler_config(info.max_model_len)
        args.cache_config(info.num_gpu_blocks, info.kv_cache_groups)
    except ConfigError as e:
        raise engine_field_path(e) from None


def _check_cluster(exp: ExperimentConfig) -> None:
    """A cluster runs in the simulator only; each instance's hardware and engine settings are checked as
    the experiment's are (its KV pool sized, cheap)."""
    if exp.cluster is None:
        return
    if exp.backends != ["sim"]:
        raise ConfigError("backends", f"a cluster runs in the simulator only (backends: [sim]), got {exp.backends}")
    import numpy as np  # noqa: PLC0415

    from servetwin.experiments.config.cluster import instance_engine_args  # noqa: PLC0415
    from servetwin.sim.hardware import hardware_from_dict, load_hardware  # noqa: PLC0415
    from servetwin.sim.kv_pool import build_sim_executor  # noqa: PLC0415
    from servetwin.sim.routers import build_router  # noqa: PLC0415

    build_router(exp.cluster.router, np.random.default_rng(0))  # unknown routers, scorers, bad parameters
    if exp.cluster.prefill_router is not None:  # P/D: the prefill profile too
        build_router(exp.cluster.prefill_router, np.random.default_rng(0))

    for i, inst in enumerate(exp.cluster.instances):
        path = f"cluster.instances[{i}]"
        hw = inst.hardware
        if hw is None:
            inst.hardware_spec = exp.hardware_spec
        else:
            try:
                inst.hardware_spec = hardware_from_dict(hw, "hardware") if isinstance(hw, Mapping) else load_hardware(hw)
            except ConfigError as e:
                raise ConfigError(f"{path}.hardware", e.message) from None
        try:
            args = instance_engine_args(exp.engine_args("sim"), inst, inst.hardware_spec, exp.cluster.links)
            info = build_sim_executor(args)
            args.scheduler_config(info.max_model_len)
            args.cache_config(info.num_gpu_blocks, info.kv_cache_groups)
        except ConfigError as e:
            raise engine_field_path(e).within(path) from None


def _check_backend_args(exp: ExperimentConfig) -> None:
    """Each backend's own cheap checks (`ExecutorBackend.check_args`: e.g. the torch backend's
    `max_model_len` against the model's config.json), before any model load."""
    from servetwin.core.engine.executor import check_engine_args  # noqa: PLC0415

    for backend in exp.backends:
        try:
            check_engine_args(exp.engine_args(backend))
        except ConfigError as e:
            e = engine_field_path(e)
            raise ConfigError(e.path, f"{e.message} [{backend} backend]") from None


CROSS_CHECKS: tuple[Callable[[ExperimentConfig], None], ...] = (_check_sim_only_engine_args, _resolve_auto_hardware,
                                                                 _check_hardware,
                                                                 _apply_vllm_batch_defaults,
                                                                 _check_engine_semantics, _check_cluster,
                                                                 _check_backend_args)


def validate_config(raw: Any, base_dir: str | Path = ".", default_name: str = "experiment") -> ExperimentConfig:
    """Parse a YAML document (a mapping) into an `ExperimentConfig`; raises `ConfigError` naming the YAML path
    of the first bad field. Relative paths in it are relative to `base_dir`."""
    cfg = dict(_mapping(raw, "config")) if raw is not None else {}
    _check_keys(cfg, TOP_KEYS, "", {"backend": "backends", "engine_args": "engine"})
    ctx = ParseContext(Path(base_dir))
    for section in SECTIONS:
        value = cfg.get(section.key, default_name if section.key == "name" else None)
        ctx.parsed[section.key] = section.parse(value, ctx)
    p = ctx.parsed
    resolved = copy.deepcopy(cfg)
    resolved.update(name=p["name"], seed=p["seed"], model=p["model"], backends=list(p["backends"]),
                    hardware=p["hardware"], engine=dict(p["engine"].given), workload=dict(p["workload"].given))
    exp = ExperimentConfig(**p, raw=resolved, base_dir=str(ctx.base_dir))
    for check in CROSS_CHECKS:
        check(exp)
    return exp


# -- sweeps -------------------------------------------------------------------------------------
# `a.b.c`, with list items by index: `cluster.instances[0].count`
DOTTED_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[0-9]+\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[[0-9]+\])*)*")


def dotted_parts(key: str) -> list[str | int]:
    """`cluster.instances[0].count` -> ["cluster", "instances", 0, "count"] (a `DOTTED_KEY`)."""
    return [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"[A-Za-z0-9_]+|\[[0-9]+\]", key)]


def _key_text(parts: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(parts))


def _validate_sweep_shape(sweep: Any) -> dict[str, list[Any]]:
    sweep = _mapping(sweep, "sweep")
    out: dict[str, list[Any]] = {}
    for key, values in sweep.items():
        path = f"sweep.{key}"
        if not isinstance(key, str) or not DOTTED_KEY.fullmatch(key):
            raise ConfigError(path, "must be a dotted key like engine.max_num_seqs (list items by index: "
                                    "cluster.instances[0].count)")
        head = key.split(".")[0].split("[")[0]
        allowed = [s.key for s in SECTIONS if s.sweepable]
        if head not in allowed:
            close = difflib.get_close_matches(head, allowed, n=1)
            dym = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(path, f"unknown top-level key {head!r}{dym}; sweepable: {', '.join(allowed)}")
        parts = key.split(".")
        if head == "engine":
            if len(parts) != 2:
                raise ConfigError(path, "engine keys have one level (engine.<arg>)")
            _check_keys({parts[1]: None}, ENGINE_FIELDS, "sweep.engine", unsupported=_engine_key_unsupported)
        if head == "output":
            if len(parts) != 2:
                raise ConfigError(path, "output keys have one level (output.<field>)")
            _check_keys({parts[1]: None}, OUTPUT_FIELDS, "sweep.output")
        if head == "workload" and len(parts) >= 2:
            _check_keys({parts[1]: None}, WORKLOAD_KEYS, "sweep.workload", WORKLOAD_HINTS)
        if not isinstance(values, list) or not values:
            raise ConfigError(path, f"must be a non-empty list of values, got {_fmt(values)}")
        out[key] = list(values)
    return out


def set_dotted(cfg: dict[str, Any], key: str, value: Any) -> None:
    """Set `a.b.c` (or `a.b[i].c`) in nested dicts, creating missing mapping levels; a list item must exist."""
    parts = dotted_parts(key)
    node: Any = cfg
    for i, part in enumerate(parts):
        where = _key_text(parts[:i + 1])
        if isinstance(part, int):
            if not isinstance(node, list):
                raise ConfigError(_key_text(parts[:i]), f"is not a list, cannot set {key}")
            if part >= len(node):
                raise ConfigError(where, f"no such item: the list has {len(node)}, cannot set {key}")
        elif not isinstance(node, dict):
            raise ConfigError(_key_text(parts[:i]), f"is not a mapping, cannot set {key}")
        if i == len(parts) - 1:
            node[part] = value
            return
        child = node[part] if isinstance(part, int) else node.get(part)
        if child is None:
            if isinstance(parts[i + 1], int):
                raise ConfigError(where, f"is not a list, cannot set {key}")
            child = node[part] = {}
        node = child


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, (str, int, float)) or v is None:
        s = "null" if v is None else str(v)
    else:
        s = json.dumps(v, separators=(",", ":"), sort_keys=True)
    s = re.sub(r"[^A-Za-z0-9.+-]+", "-", str(s)).strip("-")
    return s or "x"


def point_name(assignments: Mapping[str, Any]) -> str:
    """Directory name of a sweep point: `key=value` pairs (last key component, unless ambiguous)."""
    lasts = [k.split(".")[-1] for k in assignments]
    parts = []
    for key, value in assignments.items():
        short = key.split(".")[-1]
        label = short if lasts.count(short) == 1 else key
        parts.append(f"{label}={_fmt_value(value)}")
    return "__".join(parts) or "base"


@dataclass(slots=True)
class SweepPoint:
    name: str
    assignments: dict[str, Any]
    raw: dict[str, Any]  # the full config of this point (no sweep)
    config: Optional[ExperimentConfig] = None  # `raw`, parsed


# Runs one command may start: sweep points x seeds, capacity grid points, `--seeds N`. Counted from the
# list lengths before anything is expanded (a 1000 x 1000 x 1000 grid is refused at once, not built);
# `--max-runs N` raises it.
MAX_RUNS = 10_000
_PROGRESS_EVERY = 500  # points validated between progress lines


def check_run_count(count: int, what: str, where: str, limit: Optional[int] = None) -> int:
    """`count`, or a `ConfigError` at `where` when it passes `limit` (default MAX_RUNS)."""
    limit = MAX_RUNS if limit is None else limit
    if count > limit:
        raise ConfigError(where, f"{what} make {count:,} runs, more than the limit of {limit:,} "
                                 "(give --max-runs N to allow more)")
    return count


def sweep_run_count(sweep: Mapping[str, list], seeds: int = 1) -> int:
    return math.prod(len(v) for v in sweep.values()) * max(seeds, 1)


def expand_sweep(exp: ExperimentConfig, max_runs: Optional[int] = None, seeds: int = 1,
                 log: Optional[Callable[[str], None]] = None) -> list[SweepPoint]:
    """Every combination of the sweep lists; each point's config is validated (errors name the point).
    The count (x `seeds`) is checked against `max_runs` first; `log` gets a progress line every
    `_PROGRESS_EVERY` points of a large grid."""
    check_run_count(sweep_run_count(exp.sweep, seeds), "the sweep's points x seeds", "sweep", max_runs)
    base = exp.to_dict()
    base.pop("sweep", None)
    base_dir = exp.base_dir
    keys = list(exp.sweep)
    total = sweep_run_count(exp.sweep)
    # one key at a time first, so an error names the sweep entry that causes it
    checked = 0
    for key in keys:
        for i, value in enumerate(exp.sweep[key]):
            checked += 1
            if log is not None and checked % _PROGRESS_EVERY == 0:
                log(f"sweep: {checked:,} sweep values checked")
            trial = copy.deepcopy(base)
            set_dotted(trial, key, value)
            try:
                validate_config(trial, base_dir, exp.name)
            except ConfigError as e:
                raise ConfigError(f"sweep.{key}[{i}]", f"value {_fmt(value)} gives an invalid config: {e}") from None
    points = []
    seen: dict[str, int] = {}
    for combo in itertools.product(*(exp.sweep[k] for k in keys)) if keys else [()]:
        assignments = dict(zip(keys, combo))
        raw = copy.deepcopy(base)
        for key, value in assignments.items():
            set_dotted(raw, key, value)
        name = point_name(assignments)
        if name in seen:
            seen[name] += 1
            name = f"{name}__{seen[name]}"
        else:
            seen[name] = 0
        raw["name"] = f"{exp.name}.{name}" if keys else exp.name
        raw["name"] = re.sub(r"[^A-Za-z0-9._+=-]", "-", raw["name"])
        try:
            config = validate_config(raw, base_dir, exp.name)
        except ConfigError as e:
            raise ConfigError("sweep", f"point {name}: {e}") from None
        points.append(SweepPoint(name, assignments, config.to_dict(), config))
        if log is not None and len(points) % _PROGRESS_EVERY == 0:
            log(f"sweep: {len(points):,}/{total:,} grid points checked")
    return points


# -- loading ------------------------------------------------------------------------------------
def seeds_for(exp: ExperimentConfig, count: Optional[int] = None, max_runs: Optional[int] = None) -> list[int]:
    """The seeds to run: `--seeds N` (N seeds from the config's `seed` on), else the config's `seeds`;
    [] for a single run with the config's own seed."""
    if count is not None:
        if not isinstance(count, int) or count < 1:
            raise ConfigError("--seeds", f"must be an integer >= 1, got {count!r}")
        check_run_count(count, f"--seeds {count}", "--seeds", max_runs)
        return list(range(exp.seed, exp.seed + count))
    return list(exp.seeds)


def with_seed(raw: dict[str, Any], seed: int) -> dict[str, Any]:
    """A copy of a config drawn with `seed`: the run's seed and its workload's (which otherwise defaults
    to it), without `seeds`."""
    out = copy.deepcopy(raw)
    out.pop("seeds", None)
    out["seed"] = seed
    if isinstance(out.get("workload"), dict):
        out["workload"]["seed"] = seed
    return out


def check_output_file(path: str | Path, flag: str = "-o/--output") -> None:
    """Fail before any work when the output file cannot be written: it is a folder, or a file sits
    where one of its folders should be."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(flag, f"{path} is a folder; give the file to write")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(flag, f"cannot create {path}: {parent} is a file, not a folder")
    check_output_dir(parent, flag)


def check_output_dir(path: str | Path, flag: str = "-o/--output") -> None:
    """Fail before any work when the output folder cannot be a folder (a file is in the way) or the
    nearest existing folder above it is not writable. An existing folder is fine: files are replaced."""
    import os  # noqa: PLC0415

    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(flag, f"{path} exists and is not a folder")
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(flag, f"cannot create {path}: {probe} is a file, not a folder")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(flag, f"cannot write to {probe} (permission denied)")


def ensure_output_dir(path: str | Path, flag: str = "-o/--output") -> bool:
    """`check_output_dir`, then create the folder (and its parents); True if this call created it.
    Any OS refusal (`/sys`, `/proc`, read-only mounts) is a `ConfigError` naming the flag."""
    import os  # noqa: PLC0415

    check_output_dir(path, flag)
    p = Path(path).expanduser()
    existed = p.is_dir()
    try:
        os.makedirs(p, exist_ok=True)
    except OSError as e:
        raise ConfigError(flag, f"cannot create {path}: {e.strerror or e}") from None
    return not existed


def ensure_output_file(path: str | Path, flag: str = "-o/--output") -> None:
    """`check_output_file`, then prove a file can be created in its (existing) folder with a probe file,
    removed at once, so a refusal is reported naming the flag before any work."""
    import os  # noqa: PLC0415

    from servetwin.core.testbed.atomic import temp_path  # noqa: PLC0415

    check_output_file(path, flag)
    p = Path(path).expanduser()
    if not p.parent.is_dir():
        raise ConfigError(flag, f"cannot write {path}: the folder {p.parent} does not exist")
    probe = temp_path(str(p))
    try:
        with open(probe, "x"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(flag, f"cannot write {path}: {e.strerror or e}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """`dotted.key=value` with a YAML value (`--set engine.max_num_seqs=64`)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}", "expected dotted.key=value")
    key, value = text.split("=", 1)
    key = key.strip()
    if not DOTTED_KEY.fullmatch(key):
        raise ConfigError(f"--set {text!r}", f"{key!r} is not a dotted key (list items by index: "
                                              "cluster.instances[0].count)")
    from servetwin.core.safe_yaml import load_yaml_text  # noqa: PLC0415

    return key, load_yaml_text(value, "the value", f"--set {key}")


def apply_requests_override(raw: dict[str, Any], n: int) -> Optional[str]:
    """`--requests N`: the workload's request count; returns a note when it had to be interpreted."""
    if not isinstance(n, int) or n < 1:
        raise ConfigError("--requests", f"must be an integer >= 1, got {n!r}")
    w = raw.setdefault("workload", {})
    if not isinstance(w, dict):
        return None
    sp = w.get("shared_prefix")
    if isinstance(sp, dict) and isinstance(sp.get("per_group"), int) and sp["per_group"] >= 1:
        groups = max(1, n // sp["per_group"])
        sp["groups"] = groups
        w.pop("requests", None)
        return (f"--requests {n}: shared_prefix workload, using {groups} groups x {sp['per_group']} = "
                f"{groups * sp['per_group']} requests")
    conv = w.get("conversations")
    if isinstance(conv, dict):  # the turns are drawn per conversation: N conversations
        conv["count"] = n
        return f"--requests {n}: conversations workload, using {n} conversations (each of several turns)"
    w["requests"] = n
    return None


def extend_requests(raw: dict[str, Any], n: int) -> Optional[str]:
    """`servetwin capacity`'s longer probe of `n` requests: the same traffic, longer. A shared-prefix workload
    whose `n` is a whole number of its patterns repeats the pattern (`shared_prefix.repeat`: its groups'
    density in time kept; `--requests`' rule would draw more groups, spread over the longer run, further apart);
    any other workload as `--requests N`."""
    w = raw.get("workload")
    sp = w.get("shared_prefix") if isinstance(w, dict) else None
    if isinstance(sp, dict) and sp.get("order", "grouped") != "inference_perf":
        try:
            pattern = int(sp["groups"]) * int(sp["per_group"])
            repeat = int(sp.get("repeat", 1))
        except (KeyError, TypeError, ValueError):
            pattern = repeat = 0
        if pattern > 0 and n % pattern == 0 and n // pattern >= repeat:
            sp["repeat"] = n // pattern
            w.pop("requests", None)
            return None
    return apply_requests_override(raw, n)


def load_yaml(path: str | Path) -> Any:
    """An experiment YAML with the bounds of `servetwin.core.safe_yaml` (aliases, nesting, size, duplicate
    keys, encoding): a `ConfigError` naming `config` and the file for anything else."""
    from servetwin.core.safe_yaml import load_yaml_file  # noqa: PLC0415

    p = Path(path)
    if not p.exists():
        raise ConfigError("config", f"file not found: {p}")
    return load_yaml_file(p, "config")


def load_raw_config(path: str | Path, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """An experiment YAML file as its mapping, with the `--set` texts applied; not yet validated."""
    raw = load_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("config", f"{path} must hold a mapping at the top level, got {type(raw).__name__}")
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(raw, key, value)
    return raw


def load_config(path: str | Path, overrides: Optional[list[str]] = None, requests: Optional[int] = None,
                notes: Optional[list[str]] = None, values: Optional[Mapping[str, Any]] = None) -> ExperimentConfig:
    """Read, override (`--set` texts, `--requests`, `values`: dotted key -> value) and parse an experiment
    YAML file. The result is parsed once: change a run by overriding here, not by editing the result."""
    p = Path(path)
    raw = load_raw_config(p, overrides)
    for key, value in (values or {}).items():
        set_dotted(raw, key, copy.deepcopy(value))
    if requests is not None:
        note = apply_requests_override(raw, requests)
        if note and notes is not None:
            notes.append(note)
    return validate_config(raw, p.parent, default_name=re.sub(r"[^A-Za-z0-9._+=-]", "-", p.stem))
