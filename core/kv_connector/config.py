"""`KVTransferConfig`: vLLM 0.33's `--kv-transfer-config` keys that the scheduler side reads."""
from __future__ import annotations

from dataclasses import dataclass, field
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

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
