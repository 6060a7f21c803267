"""Build a connector from a `KVTransferConfig` (vLLM 0.33 `kv_connector/factory.py`).

Built-in names: `NixlConnector`, `OffloadingConnector`. Users register their own either with
`register_connector(name, cls)` or, as vLLM's `kv_connector_module_path`, by naming the module that
defines the class (`kv_connector` is then the class name), or by one "module:Class" path."""
from __future__ import annotations

import importlib
from typing import Callable, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_connector.base import KVConnectorBase
from servetwin.core.kv_connector.config import KVTransferConfig

_REGISTRY: dict[str, Callable[[], type]] = {}


def register_connector(name: str, loader: Callable[[], type] | type) -> None:
    """Register a connector class (or a zero-argument function returning it, for lazy imports)."""
    if name in _REGISTRY:
        raise ValueError(f"kv_connector: {name!r} is already registered")
    _REGISTRY[name] = loader if not isinstance(loader, type) else (lambda: loader)


def _builtin_nixl() -> type:
    from servetwin.core.kv_connector.nixl import NixlConnector
    return NixlConnector


def _builtin_offloading() -> type:
    from servetwin.core.kv_connector.offloading import OffloadingConnector
    return OffloadingConnector


register_connector("NixlConnector", _builtin_nixl)
register_connector("OffloadingConnector", _builtin_offloading)


def _load_from_module(module_path: str, class_name: str, field: str) -> type:
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ConfigError(field, f"cannot import {module_path!r}: {e}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(field, f"module {module_path!r} has no class {class_name!r}")
    return cls


def connector_class(config: KVTransferConfig) -> type:
    name = config.kv_connector
    if config.kv_connector_module_path:
        cls = _load_from_module(config.kv_connector_module_path, name, "kv_connector_module_path")
    elif name in _REGISTRY:
        cls = _REGISTRY[name]()
    elif ":" in name:
        module_path, _, class_name = name.partition(":")
        cls = _load_from_module(module_path, class_name, "kv_connector")
    else:
        raise ConfigError("kv_connector", f"unknown connector {name!r} (registered: "
                          f"{', '.join(sorted(_REGISTRY))}; or give kv_connector_module_path)")
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ConfigError("kv_connector", f"{cls!r} is not a KVConnectorBase subclass")
    return cls


def create_connector(config: KVTransferConfig, block_size: int, kv_cache_groups: Optional[tuple] = None,
                     retention_interval: Optional[int] = 0) -> KVConnectorBase:
    """`kv_cache_groups`: the model's KV cache group specs (None: one full-attention group);
    `retention_interval`: the engine's `prefix_cache_retention_interval`, for a connector class that
    declares `uses_retention_interval` (vLLM hands every connector its whole `KVCacheConfig`)."""
    cls = connector_class(config)
    if getattr(cls, "uses_retention_interval", False):
        return cls(config, block_size, kv_cache_groups, retention_interval=retention_interval)
    return cls(config, block_size, kv_cache_groups)
