"""`KVTransferConfig`: vLLM 0.33's `--kv-transfer-config` keys that the scheduler side reads."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from servetwin.core.config_error import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


@dataclass(slots=True)
class KVTransferConfig:
    """vLLM's spelling: `kv_connector` (a registered name, or any class named by
    `kv_connector_module_path`), `kv_role`, `kv_load_failure_policy` ("fail" is vLLM's default) and
    the connector's own `kv_connector_extra_config`."""
    kv_connector: str
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "fail"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ConfigError("kv_connector", f"must be a connector name, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ConfigError("kv_role", f"must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ConfigError("kv_load_failure_policy",
                              f'must be "fail" or "recompute", got {self.kv_load_failure_policy!r}')
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config", "must be an object")

    @classmethod
    def from_dict(cls, raw: Any) -> "KVTransferConfig":
        """Parse vLLM's `kv_transfer_config` (LLM(...), --kv-transfer-config JSON, experiment YAML); an
        unknown key or a bad value is a `ConfigError` naming `kv_transfer_config.<key>`."""
        if isinstance(raw, cls):
            return raw
        if isinstance(raw, str):  # `--kv-transfer-config '{"kv_connector": "NixlConnector", ...}'`, as vLLM's CLI
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError("kv_transfer_config", f"not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError("kv_transfer_config", f"must be a mapping, got {type(raw).__name__}")
        allowed = [f.name for f in fields(cls)]
        for key in raw:
            if key not in allowed:
                raise ConfigError(f"kv_transfer_config.{key}", f"unknown key; allowed: {', '.join(allowed)}")
        if "kv_connector" not in raw:
            raise ConfigError("kv_transfer_config.kv_connector", "required (NixlConnector, OffloadingConnector, "
                                                                 "or a class named with kv_connector_module_path)")
        module_path = raw.get("kv_connector_module_path")
        if module_path is not None and (not isinstance(module_path, str) or not module_path):
            raise ConfigError("kv_transfer_config.kv_connector_module_path",
                              f"must be a module name, got {module_path!r}")
        raw = dict(raw)
        if isinstance(raw.get("kv_connector_extra_config"), dict):  # ours: a backend may add its defaults
            raw["kv_connector_extra_config"] = dict(raw["kv_connector_extra_config"])
        try:
            return cls(**raw)
        except ConfigError as e:
            raise e.within("kv_transfer_config") from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
