"""The worker side for a `KVTransferConfig` in the torch backend."""
from __future__ import annotations

from typing import Any, Optional

import torch

from servetwin.core.config_error import ConfigError
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.gpu.kv_connector.offloading_worker import OffloadingWorker, with_kv_bytes_per_block


def create_connector_worker(config: Optional[KVTransferConfig], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                            kv_bytes_per_block: int) -> tuple[Optional[KVTransferConfig], Optional[Any]]:
    """(the config the scheduler side is built from, the worker side); (None, None) without a config."""
    if config is None:
        return None, None
    if config.kv_connector == "OffloadingConnector":
        config = with_kv_bytes_per_block(config, kv_bytes_per_block)
        return config, OffloadingWorker(config, kv_caches, kv_bytes_per_block)
    if config.kv_connector == "NixlConnector" and config.kv_role in ("kv_producer", "kv_consumer"):
        from servetwin.gpu.kv_connector.pd_worker import PDConsumerWorker, PDProducerWorker
        worker_cls = PDProducerWorker if config.kv_role == "kv_producer" else PDConsumerWorker
        return config, worker_cls(config, kv_caches)
    if config.kv_connector == "NixlConnector":
        raise ConfigError("kv_role", "the torch backend's NixlConnector worker is kv_producer or kv_consumer")
    raise ConfigError("kv_connector", f"the torch backend has no worker side for {config.kv_connector!r} "
                      "(OffloadingConnector, NixlConnector)")
