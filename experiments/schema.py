"""The experiment YAML schema: validated up front, every error names the YAML path of the bad field.

    name: my-run                      # default: the config file's stem
    description: free text            # optional
    seed: 0                           # engine seed and default workload seed
    model: tiny-llama                 # required. sim: a model preset / HF config dir; torch: a model the loader knows
    hardware: cpu                     # sim: a hardware preset, a hardware YAML path, or an inline mapping
    backends: [sim, torch]            # any non-empty subset of sim, torch
    engine:                           # vLLM engine-argument names (servetwin.core.engine.engine_args.EngineArgs)
      max_num_seqs: 128
      max_num_batched_tokens: 8192
      enable_chunked_prefill: true
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
    output: {step_requests: true, plots: true}
    sweep:                            # a grid: every combination of the lists is one run
      engine.enable_prefix_caching: [true, false]

Workload fields are `servetwin.sim.workload`'s (parsed by `servetwin.sim.workload` / `servetwin.sim.arrivals` / `servetwin.sim.lengths`, whose
errors name the field path), plus `scenario`, which this layer builds from a replay scenario file.
"""
from __future__ import annotations

import copy
import difflib
import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml


class ConfigError(ValueError):
    """A bad experiment config; the message starts with the YAML path of the bad field."""


# -- small validators ---------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


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
            raise ConfigError(f"{path}: must be {what}, got {_fmt(v)}")
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
            raise ConfigError(f"{path}: must be {what}, got {_fmt(v)}")
        if x < low or x > high or (low_open and x == low) or (high_open and x == high):
            raise ConfigError(f"{path}: must be {what}, got {_fmt(v)}")
        return float(x)
    return check


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{path}: must be true or false, got {_fmt(v)}")
    return v


def _choice(*allowed: str) -> Callable[[Any, str], str]:
    def check(v: Any, path: str) -> str:
        if v not in allowed:
            raise ConfigError(f"{path}: must be one of {', '.join(map(repr, allowed))}, got {_fmt(v)}")
        return v
    return check


def _optional_choice(*allowed: str) -> Callable[[Any, str], Optional[str]]:
    def check(v: Any, path: str) -> Optional[str]:
        if v is not None and v not in allowed:
            raise ConfigError(f"{path}: must be null or one of {', '.join(map(repr, allowed))}, got {_fmt(v)}")
        return v
    return check


def _device(v: Any, path: str) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
        raise ConfigError(f"{path}: must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {_fmt(v)}")
    return v


def _nonempty_str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"{path}: must be a non-empty string, got {_fmt(v)}")
    return v


def _mapping(v: Any, path: str) -> Mapping:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{path}: must be a mapping, got {type(v).__name__} {_fmt(v)}")
    return v


def _check_keys(cfg: Mapping, allowed: Mapping | set | tuple, path: str,
                hints: Optional[dict[str, str]] = None) -> None:
    names = sorted(allowed)
    for key in cfg:
        if key in allowed:
            continue
        hint = (hints or {}).get(key) if isinstance(key, str) else None
        if hint is None and isinstance(key, str):
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = close[0] if close else None
        where = f"{path}.{key}" if path else str(key)
        dym = f" (did you mean {hint}?)" if hint else ""
        raise ConfigError(f"{where}: unknown key{dym}; allowed: {', '.join(names)}")


# -- the schema ---------------------------------------------------------------------------------
BACKENDS = ("sim", "torch")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float")
ATTENTION_BACKENDS = ("auto", "torch-paged", "flash-attn")  # servetwin.gpu.attention.selector

ENGINE_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "max_num_seqs": _int(1),
    "max_num_batched_tokens": _int(1, nullable=True),
    "enable_chunked_prefill": _bool,
    "long_prefill_token_threshold": _int(0),
    "enable_prefix_caching": _bool,
    "block_size": _int(1),
    "gpu_memory_utilization": _float(0.0, 1.0, low_open=True),
    "num_gpu_blocks": _int(2, nullable=True),
    "max_model_len": _int(2, nullable=True, also=(-1,)),
    "policy": _choice("fcfs", "priority"),
    "async_scheduling": _bool,
    "tensor_parallel_size": _int(1),
    "dtype": _choice(*DTYPES),
    "enforce_eager": _bool,
    "scheduler_reserve_full_isl": _bool,
    "watermark": _float(0.0, 1.0, high_open=True),
    "kv_cache_memory_bytes": _int(1, nullable=True),
    "quantization": _optional_choice("fp8"),
    "kv_cache_dtype": _choice("auto", "fp8"),
    "attention_backend": _choice(*ATTENTION_BACKENDS),
    "device": _device,
}

TOP_KEYS = ("name", "description", "seed", "seeds", "model", "hardware", "backends", "frontend", "engine",
            "workload", "output", "slo", "sweep")
OUTPUT_FIELDS: dict[str, Callable[[Any, str], Any]] = {"step_requests": _bool, "plots": _bool}

# servetwin.sim.workload's fields (same names), plus `scenario` (a replay scenario's requests, built here)
WORKLOAD_KEYS = ("requests", "arrival", "prompt_tokens", "output_tokens", "shared_prefix", "n", "file", "seed",
                 "vocab_size", "max_prompt_tokens", "max_output_tokens", "priority", "finish", "timeout_s",
                 "scenario")
WORKLOAD_HINTS = {"num_requests": "requests", "prompt_len": "prompt_tokens", "output_len": "output_tokens",
                  "prefix": "shared_prefix", "trace": "file", "prefix_len": "shared_prefix"}
SHARED_PREFIX_KEYS = ("groups", "per_group", "prefix_tokens", "suffix_tokens", "order")

# servetwin.sim.workload's wording -> this schema's (order matters)
_MESSAGE_RENAMES = [
    ("with prefix groups", "with workload.shared_prefix"),
]


def _rename_message(msg: str) -> str:
    for old, new in _MESSAGE_RENAMES:
        msg = msg.replace(old, new)
    return msg


@dataclass(slots=True)
class ExperimentConfig:
    name: str
    seed: int
    model: str
    hardware: Any  # preset name, YAML path, or an inline mapping
    backends: list[str]
    engine: dict[str, Any]
    workload: dict[str, Any]  # as written (experiment names), paths resolved
    output: dict[str, Any]
    sweep: dict[str, list[Any]]
    description: str = ""
    slo: Any = None  # servetwin.experiments.slo.SloSpec (empty: no SLO)
    seeds: list[int] = field(default_factory=list)  # repeat the run per seed (empty: once, with `seed`)
    raw: dict[str, Any] = field(default_factory=dict)  # the validated input (paths resolved)
    base_dir: str = "."
    frontend: Any = None  # servetwin.sim.frontend.FrontendConfig (the default is set by validate_config)

    # -- derived ------------------------------------------------------------------------------
    def engine_args(self, backend: str):
        """`servetwin.core.engine.engine_args.EngineArgs` for one backend (the sim's carry the hardware)."""
        from servetwin.core.engine.engine_args import EngineArgs  # noqa: PLC0415

        hw = self.hardware
        if isinstance(hw, Mapping):
            from servetwin.sim.hardware import hardware_from_dict  # noqa: PLC0415
            hw = hardware_from_dict(hw, "hardware")
        kwargs = dict(self.engine)
        kwargs.update(model=self.model, backend=backend, seed=self.seed)
        if backend == "sim":
            kwargs["hardware"] = hw
        else:
            for key, plain in (("quantization", None), ("kv_cache_dtype", "auto")):
                if kwargs.get(key, plain) != plain:
                    raise ConfigError(f"engine.{key}: {kwargs[key]!r} is simulated only (the {backend} backend runs "
                                      "the model's own dtype); use backends: [sim]")
        try:
            return EngineArgs.from_kwargs(**kwargs)
        except ValueError as e:
            raise ConfigError(f"engine.{e}") from None

    def sim_workload(self) -> dict[str, Any]:
        """The workload in `servetwin.sim.workload`'s names (without `scenario`); seed defaults to the top-level one."""
        return to_sim_workload(self.workload, self.seed)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)


def to_sim_workload(w: Mapping[str, Any], default_seed: Optional[int]) -> dict[str, Any]:
    """The workload for `servetwin.sim.workload` (same field names), without `scenario` (built here) and without
    an `arrival` given next to `file` (the file gives lengths, the arrival process replaces the times
    when the requests are built); the seed defaults to the experiment's."""
    out: dict[str, Any] = {} if default_seed is None else {"seed": default_seed}
    out.update({k: v for k, v in w.items() if k != "scenario"})
    if "file" in out:
        out.pop("arrival", None)
    return out


def _resolve_path(value: Any, path: str, base_dir: Path) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: must be a file path, got {_fmt(value)}")
    p = Path(value).expanduser()
    if not p.is_absolute():
        if (base_dir / p).exists():
            p = base_dir / p
    if not p.is_file():
        raise ConfigError(f"{path}: file not found: {value}")
    return str(p.resolve())


def _validate_workload(w: Any, base_dir: Path, backends: list[str]) -> dict[str, Any]:
    w = dict(_mapping(w, "workload"))
    _check_keys(w, WORKLOAD_KEYS, "workload", WORKLOAD_HINTS)
    if "file" in w and "scenario" in w:
        raise ConfigError("workload.scenario: not allowed together with workload.file (give one source)")
    for src in ("file", "scenario"):
        if src in w:
            w[src] = _resolve_path(w[src], f"workload.{src}", base_dir)
            for key in ("prompt_tokens", "output_tokens", "shared_prefix"):
                if key in w:
                    raise ConfigError(f"workload.{key}: not allowed with workload.{src} "
                                      "(the file gives the lengths)")
    if "shared_prefix" in w:
        sp = dict(_mapping(w["shared_prefix"], "workload.shared_prefix"))
        _check_keys(sp, SHARED_PREFIX_KEYS, "workload.shared_prefix",
                    {"suffix_len": "suffix_tokens", "prefix_len": "prefix_tokens"})
        w["shared_prefix"] = sp
    if isinstance(w.get("arrival"), Mapping) and w["arrival"].get("type") == "trace" and "path" in w["arrival"]:
        w["arrival"] = dict(w["arrival"])
        w["arrival"]["path"] = _resolve_path(w["arrival"]["path"], "workload.arrival.path", base_dir)
    from servetwin.sim.arrivals import ClosedLoop, parse_arrival  # noqa: PLC0415  (no torch: cheap)

    arrival = None
    if w.get("arrival") is not None:
        try:
            arrival = parse_arrival(w["arrival"], "workload.arrival")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if w.get("timeout_s") is not None and "torch" in backends:
        raise ConfigError("workload.timeout_s: client timeouts are only modelled by the sim backend")
    if isinstance(arrival, ClosedLoop) and "torch" in backends:
        raise ConfigError("workload.arrival.type: 'closed_loop' is only supported by the sim backend "
                          "(the torch backend replays open-loop arrival times)")
    if "scenario" in w:
        from servetwin.core.testbed.scenario import load_scenario  # noqa: PLC0415

        for key in ("n", "priority", "finish", "max_prompt_tokens", "max_output_tokens", "vocab_size", "timeout_s"):
            if key in w:
                raise ConfigError(f"workload.{key}: not allowed with workload.scenario "
                                  "(the scenario gives every request's fields)")
        if "requests" in w:
            _int(1)(w["requests"], "workload.requests")
        if "seed" in w:
            _int(0)(w["seed"], "workload.seed")
        try:
            sc = load_scenario(w["scenario"])
        except ValueError as e:
            raise ConfigError(f"workload.scenario: {w['scenario']}: {e}") from None
        if sc.uses_events:  # scripted tokens and step-indexed aborts have no meaning on a real model
            raise ConfigError(f"workload.scenario: {w['scenario']} uses scenario events (aborts, stop_at, "
                              "stop_token_ids, min_tokens, ignore_eos), which only `servetwin replay` plays")
        if arrival is None:
            late = [r.id for r in sc.requests if r.arrival_step > 0 and r.arrival_time is None]
            if late:
                raise ConfigError(
                    f"workload.scenario: request {late[0]!r} arrives at a later step; step-indexed arrivals "
                    "have no time here: set workload.arrival (e.g. {type: offline}) or use `servetwin replay`")
        return w
    from servetwin.sim.workload import WorkloadSpec  # noqa: PLC0415

    sim_dict = to_sim_workload(w, None)
    try:
        WorkloadSpec.from_dict(sim_dict, "workload")
    except ValueError as e:
        msg = _rename_message(str(e))
        if "file" in w:
            msg = msg.replace("workload.arrival.path", "workload.file").replace("with a trace arrival",
                                                                                "with workload.file")
        raise ConfigError(msg) from None
    return w


def validate_config(raw: Any, base_dir: str | Path = ".", default_name: str = "experiment") -> ExperimentConfig:
    """Validate a parsed YAML document; raises `ConfigError` naming the YAML path of the first bad field."""
    base = Path(base_dir)
    cfg = dict(_mapping(raw, "config")) if raw is not None else {}
    _check_keys(cfg, TOP_KEYS, "", {"backend": "backends", "engine_args": "engine"})
    name = _nonempty_str(cfg.get("name", default_name), "name")
    if not re.fullmatch(r"[A-Za-z0-9._+=-]+", name):
        raise ConfigError(f"name: must use only letters, digits and . _ + = -, got {name!r}")
    description = cfg.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"description: must be a string, got {_fmt(description)}")
    seed = _int(0)(cfg.get("seed", 0), "seed")
    if "model" not in cfg:  # no silent default: the model decides sizes, KV pool and step costs
        raise ConfigError("model: required field is missing (a built-in name such as tiny-llama, "
                          "smollm2-135m or llama-3.1-8b, or a model folder)")
    model = _nonempty_str(cfg["model"], "model")
    cand = Path(model).expanduser()
    if not cand.is_absolute() and (model.startswith(".") or "/" in model) and (base / cand).exists():
        model = str((base / cand).resolve())  # a model directory / config.json relative to the config file
    backends = cfg.get("backends", ["sim"])
    if isinstance(backends, str):
        backends = [backends]
    if not isinstance(backends, list) or not backends:
        raise ConfigError(f"backends: must be a non-empty list of {', '.join(BACKENDS)}, got {_fmt(backends)}")
    for i, b in enumerate(backends):
        if b not in BACKENDS:
            raise ConfigError(f"backends[{i}]: must be one of {', '.join(map(repr, BACKENDS))}, got {_fmt(b)}")
    if len(set(backends)) != len(backends):
        raise ConfigError(f"backends: duplicate entries in {backends}")
    hardware = cfg.get("hardware", "h100-sxm")
    if isinstance(hardware, Mapping):
        hardware = dict(hardware)
    elif isinstance(hardware, str) and hardware:
        cand = Path(hardware).expanduser()
        if not cand.is_absolute() and (base / cand).is_file():
            hardware = str((base / cand).resolve())
    else:
        raise ConfigError(f"hardware: must be a preset name, a YAML path or a mapping, got {_fmt(hardware)}")
    if "sim" in backends:
        from servetwin.sim.hardware import hardware_from_dict, load_hardware  # noqa: PLC0415
        from servetwin.sim.model_spec import load_model_spec  # noqa: PLC0415

        try:
            hardware_from_dict(hardware, "hardware") if isinstance(hardware, dict) else load_hardware(hardware)
        except ValueError as e:
            raise ConfigError(str(e) if str(e).startswith("hardware") else f"hardware: {e}") from None
        try:
            load_model_spec(model)
        except ValueError as e:
            raise ConfigError(str(e) if str(e).startswith("model") else f"model: {e}") from None
    engine = dict(_mapping(cfg.get("engine", {}) or {}, "engine"))
    _check_keys(engine, ENGINE_FIELDS, "engine", {"num_gpu_blocks_override": "num_gpu_blocks"})
    for key, check in ENGINE_FIELDS.items():
        if key in engine:
            engine[key] = check(engine[key], f"engine.{key}")
    output = dict(_mapping(cfg.get("output", {}) or {}, "output"))
    _check_keys(output, OUTPUT_FIELDS, "output")
    for key, check in OUTPUT_FIELDS.items():
        if key in output:
            output[key] = check(output[key], f"output.{key}")
    output = {"step_requests": True, "plots": True} | output
    if "workload" not in cfg:
        raise ConfigError("workload: required field is missing")
    workload = _validate_workload(cfg["workload"], base, backends)
    sweep = _validate_sweep_shape(cfg.get("sweep", {}) or {})
    frontend = _validate_frontend(cfg.get("frontend"), workload, base)
    from servetwin.experiments.slo import SloError, parse_slo  # noqa: PLC0415

    try:
        slo = parse_slo(cfg.get("slo"), "slo")
    except SloError as e:
        raise ConfigError(str(e)) from None
    seeds = _validate_seeds(cfg.get("seeds"), seed)
    resolved = dict(cfg)
    resolved.update(name=name, seed=seed, model=model, backends=list(backends), hardware=hardware,
                    engine=engine, workload=workload)
    exp = ExperimentConfig(name=name, seed=seed, model=model, hardware=hardware, backends=list(backends),
                           engine=engine, workload=workload, output=output, sweep=sweep,
                           description=description, slo=slo, seeds=seeds, raw=copy.deepcopy(resolved),
                           base_dir=str(base), frontend=frontend)
    _check_engine_semantics(exp)
    return exp


def _validate_frontend(cfg: Any, workload: Mapping[str, Any], base_dir: Path) -> Any:
    """`frontend: {type: api_server, endpoint: chat|completions, coefficients: ...}` or
    `{type: offline}`; absent: an API server for online arrivals, the offline LLM for an offline batch
    (servetwin.sim.frontend.default_frontend)."""
    from servetwin.sim.frontend import default_frontend, parse_frontend  # noqa: PLC0415  (no torch)

    if cfg is None:
        arrival = workload.get("arrival")
        offline = (arrival is None and "file" not in workload) or (
            isinstance(arrival, Mapping) and arrival.get("type") == "offline")
        return default_frontend(online=not offline)
    if isinstance(cfg, Mapping) and isinstance(cfg.get("coefficients"), str):
        cand = Path(cfg["coefficients"]).expanduser()
        if not cand.is_absolute() and (base_dir / cand).is_file():
            cfg = dict(cfg, coefficients=str((base_dir / cand).resolve()))
    try:
        return parse_frontend(cfg, "frontend")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_seeds(seeds: Any, seed: int) -> list[int]:
    """`seeds: [0, 1, 2]` (distinct integers >= 0), or `seeds: N` for N seeds from `seed` on; null or
    absent: one run with `seed`."""
    if seeds is None:
        return []
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ConfigError(f"seeds: a count must be >= 1, got {seeds}")
        return list(range(seed, seed + seeds))
    if not isinstance(seeds, list) or not seeds:
        raise ConfigError(f"seeds: must be a non-empty list of integers (or a count), got {_fmt(seeds)}")
    out = [_int(0)(s, f"seeds[{i}]") for i, s in enumerate(seeds)]
    if len(set(out)) != len(out):
        raise ConfigError(f"seeds: duplicate seeds in {out}")
    return out


def seeds_for(exp: ExperimentConfig, count: Optional[int] = None) -> list[int]:
    """The seeds to run: `--seeds N` (N seeds from the config's `seed` on), else the config's `seeds`;
    [] for a single run with the config's own seed."""
    if count is not None:
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"--seeds: must be an integer >= 1, got {count!r}")
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


def _check_engine_semantics(exp: ExperimentConfig) -> None:
    """Cross-field checks that need the model (cheap for the sim: sizes its KV pool, no torch)."""
    for backend in exp.backends:
        args = exp.engine_args(backend)
        if backend != "sim":
            continue
        from servetwin.sim.kv_pool import build_sim_executor  # noqa: PLC0415

        try:
            info = build_sim_executor(args)
        except ValueError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(("model", "hardware")) else f"engine.{msg}") from None
        try:
            args.scheduler_config(info.max_model_len)
            args.cache_config(info.num_gpu_blocks)
        except ValueError as e:
            raise ConfigError(f"engine.{e}") from None


# -- sweeps -------------------------------------------------------------------------------------
def _validate_sweep_shape(sweep: Any) -> dict[str, list[Any]]:
    sweep = _mapping(sweep, "sweep")
    out: dict[str, list[Any]] = {}
    for key, values in sweep.items():
        path = f"sweep.{key}"
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
            raise ConfigError(f"{path}: must be a dotted key like engine.max_num_seqs")
        head = key.split(".")[0]
        if head not in TOP_KEYS or head in ("sweep", "name", "description", "seeds"):
            allowed = [k for k in TOP_KEYS if k not in ("sweep", "name", "description", "seeds")]
            close = difflib.get_close_matches(head, allowed, n=1)
            dym = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{path}: unknown top-level key {head!r}{dym}; sweepable: {', '.join(allowed)}")
        parts = key.split(".")
        if head == "engine":
            if len(parts) != 2:
                raise ConfigError(f"{path}: engine keys have one level (engine.<arg>)")
            _check_keys({parts[1]: None}, ENGINE_FIELDS, "sweep.engine")
        if head == "output":
            if len(parts) != 2:
                raise ConfigError(f"{path}: output keys have one level (output.<field>)")
            _check_keys({parts[1]: None}, OUTPUT_FIELDS, "sweep.output")
        if head == "workload" and len(parts) >= 2:
            _check_keys({parts[1]: None}, WORKLOAD_KEYS, "sweep.workload", WORKLOAD_HINTS)
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: must be a non-empty list of values, got {_fmt(values)}")
        out[key] = list(values)
    return out


def set_dotted(cfg: dict[str, Any], key: str, value: Any) -> None:
    """Set `a.b.c` in nested dicts, creating missing levels."""
    parts = key.split(".")
    node = cfg
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: is not a mapping, cannot set {key}")
        node = child
    node[parts[-1]] = value


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


def expand_sweep(exp: ExperimentConfig) -> list[SweepPoint]:
    """Every combination of the sweep lists; each point's config is validated (errors name the point)."""
    base = exp.to_dict()
    base.pop("sweep", None)
    base_dir = exp.base_dir
    keys = list(exp.sweep)
    # one key at a time first, so an error names the sweep entry that causes it
    for key in keys:
        for i, value in enumerate(exp.sweep[key]):
            trial = copy.deepcopy(base)
            set_dotted(trial, key, value)
            try:
                validate_config(trial, base_dir, exp.name)
            except ConfigError as e:
                raise ConfigError(f"sweep.{key}[{i}]: value {_fmt(value)} gives an invalid config: {e}") from None
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
            validate_config(raw, base_dir, exp.name)
        except ConfigError as e:
            raise ConfigError(f"sweep point {name}: {e}") from None
        points.append(SweepPoint(name, assignments, raw))
    return points


# -- loading ------------------------------------------------------------------------------------
def check_output_file(path: str | Path, flag: str = "-o/--output") -> None:
    """Fail before any work when the output file cannot be written: it is a folder, or a file sits
    where one of its folders should be."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{flag}: {path} is a folder; give the file to write")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{flag}: cannot create {path}: {parent} is a file, not a folder")
    check_output_dir(parent, flag)


def check_output_dir(path: str | Path, flag: str = "-o/--output") -> None:
    """Fail before any work when the output folder cannot be a folder (a file is in the way) or the
    nearest existing folder above it is not writable. An existing folder is fine: files are replaced."""
    import os  # noqa: PLC0415

    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag}: {path} exists and is not a folder")
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{flag}: cannot create {path}: {probe} is a file, not a folder")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}: cannot write to {probe} (permission denied)")


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
        raise ConfigError(f"{flag}: cannot create {path}: {e.strerror or e}") from None
    return not existed


def ensure_output_file(path: str | Path, flag: str = "-o/--output") -> None:
    """`check_output_file`, then prove a file can be created in its (existing) folder with a probe file,
    removed at once, so a refusal is reported naming the flag before any work."""
    import os  # noqa: PLC0415

    from servetwin.core.testbed.atomic import temp_path  # noqa: PLC0415

    check_output_file(path, flag)
    p = Path(path).expanduser()
    if not p.parent.is_dir():
        raise ConfigError(f"{flag}: cannot write {path}: the folder {p.parent} does not exist")
    probe = temp_path(str(p))
    try:
        with open(probe, "x"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write {path}: {e.strerror or e}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """`dotted.key=value` with a YAML value (`--set engine.max_num_seqs=64`)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    key, value = text.split("=", 1)
    key = key.strip()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ConfigError(f"--set {text!r}: {key!r} is not a dotted key")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value is not valid YAML: {e}") from None


def apply_requests_override(raw: dict[str, Any], n: int) -> Optional[str]:
    """`--requests N`: the workload's request count; returns a note when it had to be interpreted."""
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"--requests: must be an integer >= 1, got {n!r}")
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
    w["requests"] = n
    return None


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently, so a second `engine:` block would drop the first without a word)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: keys after it override the merged ones, as YAML intends
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base class reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {seen[key].start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: file not found: {p}")
    with open(p, encoding="utf-8") as f:
        try:
            return yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {p} is not valid YAML: {e}") from None


def load_config(path: str | Path, overrides: Optional[list[str]] = None, requests: Optional[int] = None,
                notes: Optional[list[str]] = None) -> ExperimentConfig:
    """Read, override (`--set`, `--requests`) and validate an experiment YAML file."""
    p = Path(path)
    raw = load_yaml(p)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {p} must hold a mapping at the top level, got {type(raw).__name__}")
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(raw, key, value)
    if requests is not None:
        note = apply_requests_override(raw, requests)
        if note and notes is not None:
            notes.append(note)
    return validate_config(raw, p.parent, default_name=re.sub(r"[^A-Za-z0-9._+=-]", "-", p.stem))
