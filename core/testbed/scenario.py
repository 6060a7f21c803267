"""Scenario files (`docs/architecture.md`): settings + step-indexed requests, validated with clear errors."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.sched.config import CacheConfig, SchedulerConfig

SETTINGS_KEYS = {
    "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold",
    "block_size", "num_gpu_blocks", "enable_prefix_caching", "policy", "max_model_len",
    "scheduler_reserve_full_isl", "watermark", "async_scheduling", "max_steps", "max_num_partial_prefills",
    "long_prefill_token_threshold_adaptive", "max_num_active_seqs",
}
REQUIRED_SETTINGS = {"max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks"}
REQUEST_KEYS = {"id", "arrival_step", "prompt_token_ids", "prompt_len", "prompt_seed", "prefix_token_ids",
                "max_tokens", "priority", "arrival_time", "n", "cache_salt"}


@dataclass(slots=True)
class ScenarioRequest:
    id: str
    arrival_step: int
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    arrival_time: Optional[float] = None
    n: int = 1
    cache_salt: Optional[str] = None


@dataclass(slots=True)
class Scenario:
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    requests: list[ScenarioRequest]
    max_steps: int = 10000


def synthetic_prompt(prompt_len: int, prompt_seed: int = 0, prefix: Optional[list[int]] = None) -> list[int]:
    body = [(prompt_seed * 1000003 + i * 7919) % 30000 + 10 for i in range(prompt_len)]
    return list(prefix or []) + body


def _req_int(r: dict, key: str, where: str, default: Any = None, minimum: int = 0) -> Any:
    v = r.get(key, default)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConfigError(f"{where}.{key}", f"must be an integer >= {minimum}, got {v!r}")
    return v


def parse_scenario(data: Any) -> Scenario:
    if not isinstance(data, dict) or "settings" not in data or "requests" not in data:
        raise ConfigError("scenario", "expected a JSON object with 'settings' and 'requests'")
    s = data["settings"]
    if not isinstance(s, dict):
        raise ConfigError("settings", "must be an object")
    unknown = set(s) - SETTINGS_KEYS
    if unknown:
        raise ConfigError(f"settings.{sorted(unknown)[0]}", f"unknown setting (allowed: {sorted(SETTINGS_KEYS)})")
    missing = REQUIRED_SETTINGS - set(s)
    if missing:
        raise ConfigError(f"settings.{sorted(missing)[0]}", "required")
    chunked = bool(s.get("enable_chunked_prefill", True))
    sched_kwargs = dict(
        max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=s.get("long_prefill_token_threshold", 0),
        policy=s.get("policy", "fcfs"), max_model_len=s.get("max_model_len"),
        async_scheduling=bool(s.get("async_scheduling", False)),
    )
    for opt in ("scheduler_reserve_full_isl", "watermark", "long_prefill_token_threshold_adaptive",
                "max_num_active_seqs"):
        if s.get(opt) is not None:
            sched_kwargs[opt] = s[opt]
    try:
        sched = SchedulerConfig(**sched_kwargs)
        cache = CacheConfig(block_size=s.get("block_size", 16), num_gpu_blocks=s["num_gpu_blocks"],
                            enable_prefix_caching=bool(s.get("enable_prefix_caching", False)))
    except ConfigError as e:
        raise e.within("settings") from None
    reqs = data["requests"]
    if not isinstance(reqs, list):
        raise ConfigError("requests", "must be a list")
    out, seen = [], set()
    for i, r in enumerate(reqs):
        where = f"requests[{i}]"
        if not isinstance(r, dict):
            raise ConfigError(f"{where}", "must be an object")
        unknown = set(r) - REQUEST_KEYS
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}", f"unknown key (allowed: {sorted(REQUEST_KEYS)})")
        if "id" not in r:
            raise ConfigError(f"{where}.id", "required")
        rid = str(r["id"])
        if rid in seen:
            raise ConfigError(f"{where}.id", f"duplicate id {rid!r}")
        seen.add(rid)
        if "prompt_token_ids" in r:
            ids = r["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ConfigError(f"{where}.prompt_token_ids", "must be a non-empty list of token ids >= 0")
            prompt = list(ids)
        elif "prompt_len" in r:
            prompt = synthetic_prompt(_req_int(r, "prompt_len", where, minimum=1),
                                      _req_int(r, "prompt_seed", where, 0), r.get("prefix_token_ids"))
        else:
            raise ConfigError(f"{where}.prompt_token_ids", "required (or prompt_len)")
        arrival_time = r.get("arrival_time")
        if arrival_time is not None and not isinstance(arrival_time, (int, float)):
            raise ConfigError(f"{where}.arrival_time", f"must be a number, got {arrival_time!r}")
        out.append(ScenarioRequest(
            id=rid, arrival_step=_req_int(r, "arrival_step", where, 0), prompt_token_ids=prompt,
            max_tokens=_req_int(r, "max_tokens", where, 16, minimum=1),
            priority=int(r.get("priority", 0)), arrival_time=arrival_time,
            n=_req_int(r, "n", where, 1, minimum=1), cache_salt=r.get("cache_salt")))
    return Scenario(sched, cache, out, max_steps=_req_int(s, "max_steps", "settings", 10000, minimum=1))


def load_scenario(path: str) -> Scenario:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError("scenario", f"file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError("scenario", f"{path} is not valid JSON ({e})") from None
    return parse_scenario(data)
