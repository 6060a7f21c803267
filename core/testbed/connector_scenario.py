"""The scenario contract's KV connector keys (recorded with vLLM 0.33.0; docs/kv_connectors.md):
`settings.kv_connector`, per request `kv_transfer_params`, `kv_recv`, `kv_send`.

Parsed once into typed objects; bad input raises `ScenarioError` naming the field, for every input
the recording driver rejects (an unknown key stays an error)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_connector.config import KV_LOAD_FAILURE_POLICIES, KV_ROLES, KVTransferConfig

CONNECTOR_NAMES = ("NixlConnector", "OffloadingConnector")
NIXL_KEYS = ("name", "role", "kv_load_failure_policy", "recv_delay_steps", "send_delay_steps",
             "lease_steps", "kv_lease_duration")
OFFLOAD_KEYS = ("name", "cpu_bytes_to_use", "eviction_policy", "store_threshold", "load_delay_steps",
                "store_delay_steps", "kv_load_failure_policy")
REQUEST_CONNECTOR_KEYS = ("kv_transfer_params", "kv_recv", "kv_send")
EVICTION_POLICIES = ("lru", "arc")


class _Error(ConfigError):
    """Raised here; the scenario reader re-raises it as its ScenarioError."""


def _is_int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _int(c: dict, key: str, default: Optional[int], minimum: int, path: str, nullable: bool = False) -> Optional[int]:
    v = c.get(key, default)
    if v is None and nullable:
        return None
    if not _is_int(v, minimum):
        rule = f"null or an integer >= {minimum}" if nullable else f"an integer >= {minimum}"
        raise _Error(f"{path}.{key}", f"must be {rule}, got {v!r}")
    return v


@dataclass(slots=True)
class ConnectorSettings:
    """`settings.kv_connector`, with the driver's defaults; the fake worker's delays ride along."""
    name: str
    role: str
    kv_load_failure_policy: str = "fail"
    # NixlConnector
    recv_delay_steps: int = 1
    send_delay_steps: Optional[int] = None
    lease_steps: Optional[int] = None
    kv_lease_duration: int = 30
    # OffloadingConnector
    cpu_bytes_to_use: int = 0
    eviction_policy: str = "lru"
    store_threshold: int = 0
    load_delay_steps: int = 1
    store_delay_steps: int = 1

    @property
    def is_nixl(self) -> bool:
        return self.name == "NixlConnector"

    def kv_transfer_config(self) -> KVTransferConfig:
        if self.is_nixl:
            extra = {"kv_lease_duration": self.kv_lease_duration, "engine_id": "engine-local"}
        else:
            extra = {"cpu_bytes_to_use": self.cpu_bytes_to_use, "eviction_policy": self.eviction_policy,
                     "store_threshold": self.store_threshold}
        return KVTransferConfig(self.name, self.role, self.kv_load_failure_policy, extra)


def parse_connector_settings(raw: Any, kv_cache_groups: Optional[list]) -> ConnectorSettings:
    w = "settings.kv_connector"
    if not isinstance(raw, dict) or raw.get("name") not in CONNECTOR_NAMES:
        raise _Error(w, f'must be an object with "name" one of {", ".join(CONNECTOR_NAMES)}')
    name = raw["name"]
    allowed = NIXL_KEYS if name == "NixlConnector" else OFFLOAD_KEYS
    for k in raw:
        if k not in allowed:
            raise _Error(f"{w}.{k}", f"unknown key for {name} (allowed: {', '.join(allowed)})")
    policy = raw.get("kv_load_failure_policy", "fail")
    if policy not in KV_LOAD_FAILURE_POLICIES:
        raise _Error(f"{w}.kv_load_failure_policy", f'must be "fail" or "recompute", got {policy!r}')
    if name == "NixlConnector":
        if raw.get("role") not in KV_ROLES:
            raise _Error(f"{w}.role", f"required, one of {', '.join(KV_ROLES)}")
        return ConnectorSettings(
            name, raw["role"], policy, recv_delay_steps=_int(raw, "recv_delay_steps", 1, 0, w),
            send_delay_steps=_int(raw, "send_delay_steps", None, 0, w, nullable=True),
            lease_steps=_int(raw, "lease_steps", None, 1, w, nullable=True),
            kv_lease_duration=_int(raw, "kv_lease_duration", 30, 1, w))
    if raw.get("eviction_policy", "lru") not in EVICTION_POLICIES:
        raise _Error(f"{w}.eviction_policy", f'must be "lru" or "arc", got {raw.get("eviction_policy")!r}')
    # vLLM 0.33's connector offloads sliding-window groups too (SupportsHMA); servetwin's does not
    # model chunked local attention (the oracle's driver rejects any non-full group)
    if kv_cache_groups and any(g.get("type") not in ("full_attention", "sliding_window")
                               for g in kv_cache_groups if isinstance(g, dict)):
        raise _Error(w, "OffloadingConnector scenarios must use full-attention and sliding-window groups only")
    return ConnectorSettings(
        name, "kv_both", policy, cpu_bytes_to_use=_int(raw, "cpu_bytes_to_use", None, 1, w),
        eviction_policy=raw.get("eviction_policy", "lru"), store_threshold=_int(raw, "store_threshold", 0, 0, w),
        load_delay_steps=_int(raw, "load_delay_steps", 1, 0, w),
        store_delay_steps=_int(raw, "store_delay_steps", 1, 1, w))


@dataclass(slots=True)
class RequestConnectorFields:
    """A request's connector keys: the P/D flag and the fake worker's per-request overrides."""
    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    recv_delay_steps: Optional[int] = None  # None: the connector's default
    recv_fail: Union[None, str, list[int]] = None  # "all" or block indexes of the load
    send_delay_given: bool = False
    send_delay_steps: Optional[int] = None  # with send_delay_given: null = never read


def parse_request_connector_fields(r: dict, where: str, conn: Optional[ConnectorSettings], n: int,
                                   num_kv_cache_groups: int) -> Optional[RequestConnectorFields]:
    if not any(k in r for k in REQUEST_CONNECTOR_KEYS):
        return None
    for k in REQUEST_CONNECTOR_KEYS:
        if k in r and conn is None:
            raise _Error(f"{where}.{k}", "needs settings.kv_connector")
    out = RequestConnectorFields()
    ktp = r.get("kv_transfer_params")
    if ktp is not None:
        if not conn.is_nixl:
            raise _Error(f"{where}.kv_transfer_params", "only with NixlConnector")
        flags = ("do_remote_prefill", "do_remote_decode")
        if (not isinstance(ktp, dict) or any(k not in flags for k in ktp)
                or sum(ktp.get(k) is True for k in flags) != 1 or any(ktp.get(k) not in (True, False, None) for k in flags)):
            raise _Error(f"{where}.kv_transfer_params",
                         'exactly one of {"do_remote_prefill": true} / {"do_remote_decode": true}')
        out.do_remote_prefill = ktp.get("do_remote_prefill") is True
        out.do_remote_decode = ktp.get("do_remote_decode") is True
        if out.do_remote_prefill and conn.role == "kv_producer":
            raise _Error(f"{where}.kv_transfer_params", "do_remote_prefill needs role kv_consumer or kv_both")
        if out.do_remote_decode and conn.role == "kv_consumer":
            raise _Error(f"{where}.kv_transfer_params", "do_remote_decode needs role kv_producer or kv_both")
        if n != 1:
            raise _Error(f"{where}.kv_transfer_params", "not with n > 1")
    kr = r.get("kv_recv")
    if kr is not None:
        path = f"{where}.kv_recv"
        if not out.do_remote_prefill:
            raise _Error(path, "needs kv_transfer_params.do_remote_prefill")
        if not isinstance(kr, dict) or any(k not in ("delay_steps", "fail") for k in kr):
            raise _Error(path, "an object with keys delay_steps, fail")
        if "delay_steps" in kr:
            out.recv_delay_steps = _int(kr, "delay_steps", None, 0, path)
        fail = kr.get("fail")
        if fail is not None and fail != "all" and not (isinstance(fail, list) and fail
                                                     and all(_is_int(x, 0) for x in fail)):
            raise _Error(f"{path}.fail", '"all" or a non-empty list of block indexes')
        if isinstance(fail, list) and num_kv_cache_groups > 1:
            raise _Error(f"{path}.fail", "a block list needs one KV cache group (vLLM rejects "
                         "invalid_block_ids with several groups)")
        out.recv_fail = fail
    ks = r.get("kv_send")
    if ks is not None:
        path = f"{where}.kv_send"
        if not out.do_remote_decode:
            raise _Error(path, "needs kv_transfer_params.do_remote_decode")
        if not isinstance(ks, dict) or any(k != "delay_steps" for k in ks):
            raise _Error(path, '{"delay_steps": null | int >= 0}')
        if "delay_steps" in ks:
            out.send_delay_given = True
            out.send_delay_steps = _int(ks, "delay_steps", None, 0, path, nullable=True)
    return out


def full_kv_transfer_params(fields: RequestConnectorFields, request_id: str, num_prompt_tokens: int,
                            block_size: int) -> dict[str, Any]:
    """What a proxy hands the engine (the driver's `full_kv_transfer_params`): for a decode-side
    request the remote engine's ids and one remote block id per prompt block."""
    if fields.do_remote_prefill:
        num_blocks = -(-num_prompt_tokens // block_size)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(range(1, num_blocks + 1))],
                "remote_engine_id": "engine-remote", "remote_request_id": f"p-{request_id}",
                "remote_host": "localhost", "remote_port": 5600, "tp_size": 1}
    return {"do_remote_decode": True, "do_remote_prefill": False}


def kv_transfer_params_summary(params: Optional[dict]) -> Optional[dict]:
    """kv_transfer_params on an output as the recording writes them: keys, flags, block counts."""
    if params is None:
        return None
    out: dict[str, Any] = {"keys": sorted(params)}
    for k in ("do_remote_prefill", "do_remote_decode", "remote_num_tokens"):
        if k in params:
            out[k] = params[k]
    if params.get("remote_block_ids") is not None:
        out["remote_block_ids_counts"] = [len(g) for g in params["remote_block_ids"]]
    return out
