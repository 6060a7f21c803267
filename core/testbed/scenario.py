"""Scenario files (`docs/` scenario contract): settings + step-indexed requests + client events.

Parsed once into typed objects; every bad field raises `ScenarioError` whose message starts with the
field's path (`settings.async_scheduling`, `requests[3].priority`, `aborts[0].id`). Nothing is coerced:
`"false"` is not a bool, `1.7` is not an int, `5` is not a request id.

Events (the oracle's events contract, recorded with vLLM 0.33.0): `settings.eos_token_id`, per request
`ignore_eos`, `stop_token_ids`, `min_tokens`, `stop_at`, and a top-level `aborts` list.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_cache.kv_cache_interface import parse_kv_cache_groups
from servetwin.core.limits import MAX_TOKENS_PER_REQUEST, load_json_file
from servetwin.core.sched.config import CacheConfig, SchedulerConfig
from servetwin.core.testbed.spec_scenario import (REQUEST_SPEC_KEYS, SpecScenario, parse_request_spec_fields,
                                                  parse_speculative)
from servetwin.core.testbed.connector_scenario import (
    REQUEST_CONNECTOR_KEYS, ConnectorSettings, RequestConnectorFields, parse_connector_settings,
    parse_request_connector_fields)

MAX_N = 16384  # SamplingParams' limit on n
# The fake sampler's base tokens are (step*7 + row) % 1000 + 10: EOS and stop ids there would fire at
# random, so the contract keeps them out of that range (only `stop_at` emits them).
BASE_TOKEN_RANGE = range(10, 1010)
ABORT_PHASES = ("between_steps", "during_step")
TOP_KEYS = ("settings", "requests", "aborts")
REQUEST_KEYS = ("id", "arrival_step", "prompt_token_ids", "prompt_len", "prompt_seed", "prefix_token_ids",
                "max_tokens", "priority", "arrival_time", "n", "cache_salt", "ignore_eos", "stop_token_ids",
                "min_tokens", "stop_at") + REQUEST_SPEC_KEYS + REQUEST_CONNECTOR_KEYS
ABORT_KEYS = ("step", "id", "phase")


class ScenarioError(ConfigError):
    """A bad scenario file; `path` is the field (`requests[2].priority`), the message starts with it.

    A `ConfigError`, so drivers that embed a scenario (`workload.scenario`) nest it with `within`."""


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
    ignore_eos: bool = True  # the base contract: every request runs to its length cap
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    # child index -> {output position: token the fake sampler emits there}
    stop_at: dict[int, dict[int, int]] = field(default_factory=dict)
    # speculative decoding (spec_scenario.py): drafts proposed / accepted per step, cycled
    draft_lengths: Optional[list[int]] = None
    accept_pattern: Optional[list[int]] = None
    connector: Optional[RequestConnectorFields] = None  # kv_transfer_params, kv_recv, kv_send

    @property
    def child_ids(self) -> list[str]:
        """Engine request ids: the id itself, or `{i}_{id}` per child when n > 1 (vLLM's fan-out)."""
        return [self.id] if self.n == 1 else [f"{i}_{self.id}" for i in range(self.n)]


@dataclass(slots=True)
class ScenarioAbort:
    """One client ABORT message: `finish_requests([child], FINISHED_ABORTED)` per target, in order."""
    step: int
    id: str
    phase: str  # "between_steps" | "during_step"
    targets: list[str]


@dataclass(slots=True)
class Scenario:
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    requests: list[ScenarioRequest]
    max_steps: int = 10000
    eos_token_id: int = 2  # the tiny model's EOS
    aborts: list[ScenarioAbort] = field(default_factory=list)
    uses_events: bool = False  # the file uses the events keys: the summary reports finish/stop reasons
    speculative: Optional[SpecScenario] = None  # settings.speculative (spec_scenario.py)
    kv_connector: Optional[ConnectorSettings] = None  # settings.kv_connector


# -- typed field readers ------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (bool, type(None), list, dict, str)) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(v: Any, path: str, minimum: int = 0, maximum: Optional[int] = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum or (maximum is not None and v > maximum):
        rule = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ScenarioError(path, f"must be an integer {rule}, got {_fmt(v)}")
    return v


def _opt_int(v: Any, path: str, minimum: int = 0) -> Optional[int]:
    return None if v is None else _int(v, path, minimum)


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ScenarioError(path, f"must be true or false, got {_fmt(v)}")
    return v


def _opt_bool(v: Any, path: str) -> Optional[bool]:
    return None if v is None else _bool(v, path)


def _number(v: Any, path: str, minimum: float = 0.0) -> float:
    if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < minimum):
        raise ScenarioError(path, f"must be a finite number >= {minimum:g}, got {_fmt(v)}")
    return float(v)


def _token_ids(v: Any, path: str, allow_empty: bool) -> list[int]:
    if not isinstance(v, list) or (not v and not allow_empty):
        raise ScenarioError(path, f"must be a {'' if allow_empty else 'non-empty '}list of token ids, got {_fmt(v)}")
    for j, t in enumerate(v):
        _int(t, f"{path}[{j}]", 0)
    return list(v)


def _policy(v: Any, path: str) -> Optional[str]:
    if v is not None and v not in ("fcfs", "priority"):
        raise ScenarioError(path, f'must be "fcfs" or "priority", got {_fmt(v)}')
    return v


def _object(v: Any, path: str) -> dict:
    if not isinstance(v, dict):
        raise ScenarioError(path, f"must be an object, got {_fmt(v)}")
    return v


def _check_keys(obj: dict, allowed: tuple, path: str) -> None:
    for k in obj:
        if k not in allowed:
            where = f"{path}.{k}" if path else str(k)
            raise ScenarioError(where, f"unknown key (allowed: {', '.join(allowed)})")


# -- settings -----------------------------------------------------------------------------------
_Reader = Callable[[Any, str], Any]
# name -> (reader, required); readers return the typed value or None (= the vLLM default)
SETTINGS: dict[str, tuple[_Reader, bool]] = {
    "max_num_seqs": (lambda v, p: _int(v, p, 1), True),
    "max_num_batched_tokens": (lambda v, p: _int(v, p, 1), True),
    "num_gpu_blocks": (lambda v, p: _int(v, p, 2), True),
    "enable_chunked_prefill": (_opt_bool, False),
    "long_prefill_token_threshold": (lambda v, p: _opt_int(v, p, 0), False),
    "block_size": (lambda v, p: _opt_int(v, p, 1), False),
    "enable_prefix_caching": (_opt_bool, False),
    "policy": (lambda v, p: _policy(v, p), False),
    "max_model_len": (lambda v, p: _opt_int(v, p, 2), False),
    "scheduler_reserve_full_isl": (_opt_bool, False),
    "watermark": (lambda v, p: None if v is None else _number(v, p), False),
    "async_scheduling": (_opt_bool, False),
    "max_steps": (lambda v, p: _opt_int(v, p, 1), False),
    # accepted for the recorded files; vLLM v1's scheduler does not read it
    "max_num_partial_prefills": (lambda v, p: _opt_int(v, p, 1), False),
    "long_prefill_token_threshold_adaptive": (_opt_bool, False),
    "max_num_active_seqs": (lambda v, p: _opt_int(v, p, 1), False),
    "eos_token_id": (lambda v, p: _opt_int(v, p, 0), False),
}
# KV cache groups (the oracle's HYBRID contract), read apart: `null` retention means dense, not default
HYBRID_SETTINGS = ("kv_cache_groups", "prefix_cache_retention_interval")
SPEC_SETTINGS = ("speculative",)  # read apart too (spec_scenario.py)
CONNECTOR_SETTINGS = ("kv_connector",)  # read apart (core/testbed/connector_scenario.py)
_SCHED_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                 "long_prefill_token_threshold", "policy", "max_model_len", "scheduler_reserve_full_isl",
                 "watermark", "async_scheduling", "long_prefill_token_threshold_adaptive", "max_num_active_seqs")


def _parse_settings(raw: Any) -> dict[str, Any]:
    s = _object(raw, "settings")
    _check_keys(s, tuple(SETTINGS) + HYBRID_SETTINGS + SPEC_SETTINGS + CONNECTOR_SETTINGS, "settings")
    out = {}
    for name, (read, required) in SETTINGS.items():
        if name not in s:
            if required:
                raise ScenarioError(f"settings.{name}", "required")
            continue
        value = read(s[name], f"settings.{name}")
        if value is not None:
            out[name] = value
    for name in HYBRID_SETTINGS + SPEC_SETTINGS + CONNECTOR_SETTINGS:
        if name in s:
            out[name] = s[name]
    eos = out.get("eos_token_id")
    if eos is not None and eos in BASE_TOKEN_RANGE:
        raise ScenarioError("settings.eos_token_id", f"{eos} collides with the fake sampler's base tokens "
                            f"{BASE_TOKEN_RANGE.start}..{BASE_TOKEN_RANGE.stop - 1}")
    return out


def _configs(s: dict[str, Any]) -> tuple[SchedulerConfig, CacheConfig]:
    try:
        sched = SchedulerConfig(**{k: s[k] for k in _SCHED_FIELDS if k in s})
        groups = parse_kv_cache_groups(s["kv_cache_groups"]) if "kv_cache_groups" in s else None
        cache = CacheConfig(block_size=s.get("block_size", 16), num_gpu_blocks=s["num_gpu_blocks"],
                            enable_prefix_caching=s.get("enable_prefix_caching", False),
                            kv_cache_groups=groups,
                            prefix_cache_retention_interval=s.get("prefix_cache_retention_interval", 0))
    except ConfigError as e:  # the configs name their own field ("max_num_seqs")
        raise ScenarioError(e.path, e.message).within("settings") from None
    return sched, cache


# -- requests -----------------------------------------------------------------------------------
def synthetic_prompt(prompt_len: int, prompt_seed: int = 0, prefix: Optional[list[int]] = None) -> list[int]:
    body = [(prompt_seed * 1000003 + i * 7919) % 30000 + 10 for i in range(prompt_len)]
    return list(prefix or []) + body


def _prompt(r: dict, where: str, max_len: int) -> list[int]:
    if "prompt_token_ids" in r:
        for k in ("prompt_len", "prompt_seed", "prefix_token_ids"):
            if k in r:
                raise ScenarioError(f"{where}.{k}", "not allowed together with prompt_token_ids")
        return _token_ids(r["prompt_token_ids"], f"{where}.prompt_token_ids", allow_empty=False)
    if "prompt_len" not in r:
        raise ScenarioError(f"{where}.prompt_token_ids", "required (or prompt_len)")
    n = _int(r["prompt_len"], f"{where}.prompt_len", 1, max_len)  # checked before the prompt is built
    seed = _int(r.get("prompt_seed", 0), f"{where}.prompt_seed", 0)
    prefix = _token_ids(r.get("prefix_token_ids", []), f"{where}.prefix_token_ids", allow_empty=True)
    return synthetic_prompt(n, seed, prefix)


def _stop_entries(v: Any, path: str, eos: int) -> dict[int, int]:
    if not isinstance(v, list):
        raise ScenarioError(path, f"must be a list of positions i or [i, token_id], got {_fmt(v)}")
    plan: dict[int, int] = {}
    for j, e in enumerate(v):
        p = f"{path}[{j}]"
        if isinstance(e, list):
            if len(e) != 2:
                raise ScenarioError(p, f"must be i or [i, token_id], got {_fmt(e)}")
            pos, tok = _int(e[0], f"{p}[0]", 0), _int(e[1], f"{p}[1]", 0)
        else:
            pos, tok = _int(e, p, 0), eos
        if pos in plan:
            raise ScenarioError(p, f"position {pos} given twice")
        plan[pos] = tok
    return plan


def _stop_at(v: Any, where: str, n: int, eos: int) -> dict[int, dict[int, int]]:
    path = f"{where}.stop_at"
    if isinstance(v, dict):
        if n == 1:
            raise ScenarioError(path, "the per-child object form needs n > 1")
        out = {}
        for k, entries in v.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) < n):
                raise ScenarioError(path, f"key {k!r} is not a child index < n ({n})")
            out[int(k)] = _stop_entries(entries, f"{path}.{k}", eos)
        return out
    plan = _stop_entries(v, path, eos)
    return {i: plan for i in range(n)}


def _parse_request(raw: Any, where: str, eos: int, max_prompt_len: int = MAX_TOKENS_PER_REQUEST,
                   spec: Optional[SpecScenario] = None, async_scheduling: bool = False) -> ScenarioRequest:
    r = _object(raw, where)
    _check_keys(r, REQUEST_KEYS, where)
    if "id" not in r:
        raise ScenarioError(f"{where}.id", "required")
    rid = r["id"]
    if not isinstance(rid, str) or not rid:
        raise ScenarioError(f"{where}.id", f"must be a non-empty string, got {_fmt(rid)}")
    max_tokens = _int(r.get("max_tokens", 16), f"{where}.max_tokens", 1)
    n = _int(r.get("n", 1), f"{where}.n", 1, MAX_N)
    salt = r.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ScenarioError(f"{where}.cache_salt", f"must be a non-empty string, got {_fmt(salt)}")
    priority = r.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ScenarioError(f"{where}.priority", f"must be an integer, got {_fmt(priority)}")
    arrival_time = r.get("arrival_time")
    stop_ids = _token_ids(r.get("stop_token_ids", []), f"{where}.stop_token_ids", allow_empty=True)
    for j, t in enumerate(stop_ids):
        if t in BASE_TOKEN_RANGE:
            raise ScenarioError(f"{where}.stop_token_ids[{j}]", f"{t} collides with the fake sampler's base "
                                f"tokens {BASE_TOKEN_RANGE.start}..{BASE_TOKEN_RANGE.stop - 1}")
    try:
        draft_lengths, accept_pattern = parse_request_spec_fields(r, where, spec, async_scheduling)
    except ConfigError as e:
        raise ScenarioError(e.path, e.message) from None
    return ScenarioRequest(
        id=rid, arrival_step=_int(r.get("arrival_step", 0), f"{where}.arrival_step", 0),
        prompt_token_ids=_prompt(r, where, max_prompt_len), max_tokens=max_tokens, priority=priority,
        arrival_time=None if arrival_time is None else _number(arrival_time, f"{where}.arrival_time"),
        n=n, cache_salt=salt,
        ignore_eos=_bool(r.get("ignore_eos", True), f"{where}.ignore_eos"),
        stop_token_ids=stop_ids,
        min_tokens=_int(r.get("min_tokens", 0), f"{where}.min_tokens", 0, max_tokens),
        stop_at=_stop_at(r["stop_at"], where, n, eos) if "stop_at" in r else {},
        draft_lengths=draft_lengths, accept_pattern=accept_pattern)


def _parse_aborts(raw: Any, requests: list[ScenarioRequest]) -> list[ScenarioAbort]:
    if not isinstance(raw, list):
        raise ScenarioError("aborts", f"must be a list, got {_fmt(raw)}")
    by_id = {r.id: r for r in requests}
    children = {cid for r in requests for cid in r.child_ids}
    out = []
    for j, a in enumerate(raw):
        where = f"aborts[{j}]"
        a = _object(a, where)
        _check_keys(a, ABORT_KEYS, where)
        for k in ("step", "id"):
            if k not in a:
                raise ScenarioError(f"{where}.{k}", "required")
        step = _int(a["step"], f"{where}.step", 0)
        aid = a["id"]
        if not isinstance(aid, str) or (aid not in by_id and aid not in children):
            raise ScenarioError(f"{where}.id", f"not a request id of this scenario, got {_fmt(aid)}")
        phase = a.get("phase", "between_steps")
        if phase not in ABORT_PHASES:
            raise ScenarioError(f"{where}.phase", f"must be one of {', '.join(ABORT_PHASES)}, got {_fmt(phase)}")
        targets = by_id[aid].child_ids if aid in by_id else [aid]
        out.append(ScenarioAbort(step, aid, phase, targets))
    return out


_EVENT_KEYS = ("stop_at", "stop_token_ids", "min_tokens", "ignore_eos")


def parse_scenario(data: Any) -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError("scenario", f"expected a JSON object with 'settings' and 'requests', got {_fmt(data)}")
    _check_keys(data, TOP_KEYS, "")
    for k in ("settings", "requests"):
        if k not in data:
            raise ScenarioError(k, "required")
    s = _parse_settings(data["settings"])
    sched, cache = _configs(s)
    spec = _speculative(s, sched)
    conn = _connector_part(lambda: parse_connector_settings(s["kv_connector"], s.get("kv_cache_groups"))
                           if "kv_connector" in s else None)
    eos = s.get("eos_token_id", 2)
    # a prompt must leave room for one output token within max_model_len (when given)
    max_prompt_len = min(MAX_TOKENS_PER_REQUEST, s.get("max_model_len", MAX_TOKENS_PER_REQUEST + 1) - 1)
    raw_reqs = data["requests"]
    if not isinstance(raw_reqs, list):
        raise ScenarioError("requests", f"must be a list, got {_fmt(raw_reqs)}")
    requests: list[ScenarioRequest] = []
    seen: dict[str, str] = {}  # engine request id -> the field that introduced it
    for i, raw in enumerate(raw_reqs):
        r = _parse_request(raw, f"requests[{i}]", eos, max_prompt_len, spec, sched.async_scheduling)
        r.connector = _connector_part(lambda: parse_request_connector_fields(
            raw, f"requests[{i}]", conn, r.n, len(cache.kv_cache_groups or (1,))))
        for cid in dict.fromkeys([r.id, *r.child_ids]):
            if cid in seen:
                raise ScenarioError(f"requests[{i}].id", f"duplicate id {cid!r} (also {seen[cid]})")
            seen[cid] = f"requests[{i}]"
        requests.append(r)
    aborts = _parse_aborts(data["aborts"], requests) if "aborts" in data else []
    events = "aborts" in data or any(k in raw for raw in raw_reqs for k in _EVENT_KEYS)
    return Scenario(sched, cache, requests, max_steps=s.get("max_steps", 10000), eos_token_id=eos,
                    aborts=aborts, uses_events=events, speculative=spec,
                    kv_connector=conn)


def _speculative(s: dict[str, Any], sched: SchedulerConfig) -> Optional[SpecScenario]:
    if "speculative" not in s:
        return None
    try:
        return parse_speculative(s["speculative"], sched.max_num_batched_tokens, sched.async_scheduling)
    except ConfigError as e:
        raise ScenarioError(e.path, e.message).within("settings") from None


def _connector_part(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except ConfigError as e:
        raise ScenarioError(e.path, e.message) from None


def load_scenario(path: str) -> Scenario:
    """A scenario file, read within `core.limits`' bounds (size, nesting, UTF-8; a key given twice is an
    error, not silently the last value)."""
    try:
        data = load_json_file(path, "scenario", unique_keys=True)
    except ConfigError as e:
        raise ScenarioError(e.path, e.message) from None
    return parse_scenario(data)
