"""The asyncio data-parallel client (`AsyncLLM` with `data_parallel_size=N`, i.e. `servetwin serve
--data-parallel-size N`): N `AsyncMPClient`s behind the same `DPFrontEndCoordinator` as the offline
`DPSyncMPClient` (vLLM's internal load balancer and the coordinator's publish rule, run in the front
end's event loop; see `servetwin.core.engine.dp_client`).

One reader task per engine takes that engine's output messages, feeds their stats to the coordinator,
frees the balancer's in-flight slot of each finished request, stamps the message with its rank
(`OutputsMsg.engine_index`, for the per-engine /metrics labels) and puts it on one merged queue, which
`get_output_async` serves. When an engine dies, its reader puts the `EngineDeadError` on the merged
queue, so `AsyncLLM` fails every request and the server exits; shutdown stops every engine.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from servetwin.core.engine import messages as m
from servetwin.core.engine.dp_client import DPClientBase, combine_utility_results
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.mp_client import AsyncMPClient


class DPAsyncMPClient(DPClientBase):
    """`data_parallel_size` engine processes behind vLLM's internal load balancer (asyncio I/O)."""

    def __init__(self, args: EngineArgs, **kwargs: Any) -> None:
        super().__init__(args, AsyncMPClient, kwargs)
        self._queue: Optional[asyncio.Queue] = None
        self._readers: list[asyncio.Task] = []

    def _attach(self) -> None:
        if self._queue is not None:
            return
        self._queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._readers = [loop.create_task(self._read_engine(rank), name=f"DPEngineOutputReader-{rank}")
                         for rank in range(len(self.clients))]

    async def _read_engine(self, rank: int) -> None:
        client = self.clients[rank]
        try:
            while True:
                msg = await client.get_output_async()
                self.on_engine_message(rank, msg)
                msg.engine_index = rank
                self._queue.put_nowait(msg)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._queue.put_nowait(EngineDeadError(f"data-parallel engine {rank}: {e}"))
        except Exception as e:  # noqa: BLE001 - never leave the front end waiting
            self._queue.put_nowait(EngineDeadError(f"data-parallel engine {rank} reader failed: "
                                                   f"{type(e).__name__}: {e}"))

    async def get_output_async(self) -> m.OutputsMsg:
        """The next outputs message from any engine (stamped with its `engine_index`)."""
        self._attach()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # every later call fails the same way
            raise item
        return item

    async def call_utility_async(self, name: str, *args: Any) -> Any:
        self._attach()
        results = await asyncio.gather(*(c.call_utility_async(name, *args) for c in self.clients))
        return combine_utility_results(name, list(results))

    def shutdown(self) -> None:
        for task in self._readers:
            if not task.done():
                task.cancel()
        super().shutdown()


__all__ = ["DPAsyncMPClient"]
