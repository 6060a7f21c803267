"""`make_client`: vLLM's `EngineCoreClient.make_client` choice between the in-process and the
multi-process clients (here a function of its own module, so the client modules import no cycle)."""
from __future__ import annotations

from typing import Any

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineCoreClient, InprocClient
from servetwin.core.engine.mp_client import AsyncMPClient, SyncMPClient


def make_client(multiprocess_mode: bool, asyncio_mode: bool, args: EngineArgs, **kwargs: Any) -> EngineCoreClient:
    """vLLM's choice: asyncio needs the multi-process client; otherwise sync MP or in-process."""
    if asyncio_mode and not multiprocess_mode:
        raise NotImplementedError("Running EngineCore in asyncio without multiprocessing is not "
                                  "supported (use multiprocess_mode=True).")
    if args.data_parallel_size > 1 and not multiprocess_mode:
        raise ConfigError("data_parallel_size", "needs the multi-process engine (one process per rank); "
                                                "multiprocess=False runs one engine in the caller")
    if args.data_parallel_size > 1:
        if asyncio_mode:
            from servetwin.core.engine.dp_async_client import DPAsyncMPClient  # noqa: PLC0415

            return DPAsyncMPClient(args, **kwargs)
        from servetwin.core.engine.dp_client import DPSyncMPClient  # noqa: PLC0415

        return DPSyncMPClient(args, **kwargs)
    if multiprocess_mode:
        cls = AsyncMPClient if asyncio_mode else SyncMPClient
        return cls(args, **kwargs)
    if kwargs:
        raise ValueError(f"{sorted(kwargs)[0]}: only the multi-process clients take this option")
    return InprocClient(args)
