"""`AsyncLLM`: the asyncio front end of the server (vLLM v1's `AsyncLLM`).

    llm = AsyncLLM(EngineArgs(...))                   # blocks until the EngineCore process is ready
    async for out in llm.generate(prompt, params, "req-1"):
        ...                                           # cumulative RequestOutputs, the last one finished

The engine core always runs in its own process (`AsyncMPClient`). One background task, the output
handler, reads the engine's output messages, turns them into `RequestOutput`s (detokenisation, stop
strings, n > 1 aggregation in the shared `OutputProcessor`) and hands each to its request's collector.
A collector keeps only the newest output (DELTA outputs: their merge), so a slow consumer never blocks
the others.
Cancelling a `generate()` (or breaking out of it, or a failing consumer) aborts the request in the
engine. When the engine process dies, every pending and later call raises `EngineDeadError`.

With `backend="sim"` the engine is paced by default: outputs are released when simulated time reaches
each step's end (see `servetwin.core.engine.engine_proc`), scaled by `time_scale`.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, AsyncGenerator, Optional

from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.core_client import make_client
from servetwin.core.engine.engine_client import EngineCoreClient, EngineDeadError
from servetwin.core.engine.input_processor import InputProcessor, PromptType, check_priority
from servetwin.core.engine.metrics import ServingMetrics
from servetwin.core.engine.mp_client import EngineRequestError
from servetwin.core.engine.output_processor import OutputProcessor
from servetwin.core.engine.parallel_sampling import fan_out
from servetwin.core.engine.request_output import RequestOutput
from servetwin.core.sampling_params import RequestOutputKind, SamplingParams

OUTPUT_CHUNK = 256  # outputs processed between two yields to the event loop


class RequestCollector:
    """The output of one request not yet taken by its consumer (or an error): the newest one, or with
    `delta` (DELTA outputs) the merge of every delta since the consumer last took one (vLLM's
    `RequestOutputCollector`): a slow consumer gets fewer, larger chunks and never blocks the others."""

    __slots__ = ("request_id", "output", "error", "event", "num_children", "delta")

    def __init__(self, request_id: str, num_children: int, delta: bool = False) -> None:
        self.request_id = request_id
        self.output: Optional[RequestOutput] = None
        self.error: Optional[BaseException] = None
        self.event = asyncio.Event()
        self.num_children = num_children
        self.delta = delta

    def put(self, output: RequestOutput) -> None:
        if self.delta and self.output is not None:
            self.output.add(output)
        else:
            self.output = output
        self.event.set()

    def put_error(self, exc: BaseException) -> None:
        self.error = exc
        self.event.set()

    async def get(self) -> RequestOutput:
        while self.output is None and self.error is None:
            await self.event.wait()
            self.event.clear()
        if self.output is not None:
            out, self.output = self.output, None
            return out
        raise self.error  # type: ignore[misc]


class AsyncLLM:
    def __init__(self, args: EngineArgs, *, pace: Optional[bool] = None, time_scale: float = 1.0,
                 fake_step_time_s: Optional[float] = None, startup_timeout_s: Optional[float] = None,
                 model_name: Optional[str] = None) -> None:
        from servetwin.core.engine.llm import load_tokenizer, prewarm_tokenizer_import, tokenizer_path  # noqa: PLC0415

        self.args = args
        prewarm_tokenizer_import(args)
        self.pace = (args.backend == "sim") if pace is None else bool(pace)
        kwargs: dict[str, Any] = {"pace": self.pace, "time_scale": time_scale, "fake_step_time_s": fake_step_time_s}
        if startup_timeout_s is not None:
            kwargs["startup_timeout_s"] = startup_timeout_s
        self.client = make_client(True, True, args, **kwargs)
        try:
            info = self.config = self.client.config
            self.tokenizer = load_tokenizer(tokenizer_path(args, info.model_path), info.vocab_size)
        except BaseException:
            self.client.shutdown()
            raise
        self.max_model_len = info.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, info.max_model_len, info.vocab_size,
                                              info.eos_token_ids, args.max_logprobs,
                                              logprobs_backend=args.backend)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = ServingMetrics(model_name or args.model)
        self.collectors: dict[str, RequestCollector] = {}
        self._handler: Optional[asyncio.Task] = None
        self._dead: Optional[BaseException] = None
        self._ids = itertools.count()
        self._closed = False

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> "AsyncLLM":
        return cls(args, **kwargs)

    # -- state ----------------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None or self.client.is_dead

    @property
    def dead_error(self) -> BaseException:
        return self._dead or EngineDeadError(self.client.dead_reason)

    @property
    def is_running(self) -> bool:
        return not self._closed and not self.errored

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- requests -------------------------------------------------------------------------------------
    def _ensure_handler(self) -> None:
        if self._handler is None:
            self._handler = asyncio.get_running_loop().create_task(self._output_handler(),
                                                                    name="AsyncLLM.output_handler")

    def add_request(self, request_id: Optional[str], prompt: PromptType, params: Optional[SamplingParams],
                    arrival_time: Optional[float] = None, priority: int = 0) -> RequestCollector:
        """Validate and submit a request (raises `ValueError` naming the bad field); returns its collector.

        Must be called from the event loop thread. Prefer `generate()`; a caller using this directly
        must iterate `stream(collector)` (which aborts the request when left early).
        """
        if self.errored:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("AsyncLLM was shut down")
        self._ensure_handler()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.collectors:
            raise ValueError(f"request_id: duplicate request id {request_id!r}")
        check_priority(priority, self.args.policy)
        processed = self.input_processor.process(prompt, params)
        self.client.validate_params(processed.params)
        children = fan_out(request_id, processed.params)
        now = time.monotonic()
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, children,
                                          now if arrival_time is None else arrival_time)
        collector = RequestCollector(request_id, len(children),
                                     delta=processed.params.output_kind == RequestOutputKind.DELTA)
        self.collectors[request_id] = collector
        self.metrics.on_arrival(request_id, len(processed.prompt_token_ids), now)
        try:
            with self.client.batched():  # all n children reach the engine together
                for cid, child_params in children:
                    self.client.add_request(cid, processed.prompt_token_ids, child_params, priority=priority,
                                            parent_id=request_id if len(children) > 1 else None)
        except BaseException:
            self.abort(request_id)
            raise
        return collector

    async def stream(self, collector: RequestCollector) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while True:
                out = await collector.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(collector.request_id)

    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, *, priority: int = 0,
                       arrival_time: Optional[float] = None) -> AsyncGenerator[RequestOutput, None]:
        """`RequestOutput`s of one request as its `output_kind` asks (cumulative by default, deltas,
        or only the final one); the last one has `finished=True`."""
        collector = self.add_request(request_id, prompt, sampling_params, arrival_time, priority)
        async for out in self.stream(collector):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op when it already finished)."""
        collector = self.collectors.pop(request_id, None)
        ids = self.output_processor.abort(request_id)
        if collector is not None:
            self.metrics.on_abort(request_id, max(1, len(ids)))
        if ids and not self.errored and not self._closed:
            try:
                self.client.abort_requests(ids)
            except EngineDeadError:
                pass

    def abort_all(self, exc: BaseException) -> int:
        """Abort every request in flight; each consumer gets `exc` (graceful shutdown). Returns how many."""
        ids = list(self.collectors)
        with self.client.batched():  # one abort message for all of them
            for request_id in ids:
                collector = self.collectors.get(request_id)
                self.abort(request_id)
                if collector is not None:
                    collector.put_error(exc)
        return len(ids)

    # -- output handler -------------------------------------------------------------------------------
    async def _output_handler(self) -> None:
        client = self.client
        op = self.output_processor
        metrics = self.metrics
        collectors = self.collectors
        try:
            while True:
                msg = await client.get_output_async()
                if msg.stats is not None:
                    metrics.update_engine(msg.stats, msg.engine_index)
                if msg.sim_time_s:
                    metrics.sim_time_s = msg.sim_time_s
                if msg.sim_arrivals:
                    client.sim_arrivals.update(msg.sim_arrivals)
                sim_t = msg.sim_time_s if client.simulated else None
                outputs = msg.outputs
                for start in range(0, len(outputs), OUTPUT_CHUNK):
                    if start:
                        await asyncio.sleep(0)
                    now = time.monotonic()
                    results, to_abort = op.process_outputs(
                        outputs[start:start + OUTPUT_CHUNK], sim_t, client.sim_arrivals,
                        lambda rid, n, done, reasons, m: metrics.on_progress(rid, n, done, reasons, m, now))
                    for out in results:
                        collector = collectors.get(out.request_id)
                        if collector is not None:
                            collector.put(out)
                            if out.finished:
                                del collectors[out.request_id]
                    if to_abort:
                        client.abort_requests(to_abort)
                for err in msg.errors or ():
                    self._fail_request(err.request_id, EngineRequestError(err.request_id, err.message))
                # Messages queued while this one was processed would otherwise be taken without
                # giving the loop a turn: let streams write and /health answer between batches.
                await asyncio.sleep(0)
        except EngineDeadError as e:
            self._dead = e
        except asyncio.CancelledError:
            if self._dead is None:
                self._dead = EngineDeadError("AsyncLLM output handler stopped")
            raise
        except Exception as e:  # noqa: BLE001 - never leave consumers hanging
            self._dead = EngineDeadError(f"AsyncLLM output handler failed: {type(e).__name__}: {e}")
        finally:
            exc = self._dead or EngineDeadError("AsyncLLM output handler stopped")
            for collector in list(collectors.values()):
                collector.put_error(exc)
            collectors.clear()

    def _fail_request(self, child_id: str, exc: BaseException) -> None:
        child = self.output_processor.children.get(child_id)
        parent_id = child.parent_id if child is not None else child_id
        collector = self.collectors.pop(parent_id, None)
        ids = [i for i in self.output_processor.abort(parent_id) if i != child_id]
        if ids:
            self.client.abort_requests(ids)
        self.metrics.on_abort(parent_id)
        if collector is not None:
            collector.put_error(exc)

    # -- utilities ------------------------------------------------------------------------------------
    async def get_stats(self) -> dict[str, Any]:
        return await self.client.call_utility_async("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async("reset_prefix_cache")

    async def start_profile(self, profile_dir: str) -> None:
        await self.client.call_utility_async("start_profile", profile_dir)

    async def stop_profile(self) -> Optional[str]:
        """The trace file written (None when no profile was running)."""
        return await self.client.call_utility_async("stop_profile")

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    def shutdown(self) -> None:
        """Stop the output handler and the EngineCore process (idempotent)."""
        if self._closed:
            return
        self._closed = True
        handler = self._handler
        if handler is not None and not handler.done():
            handler.cancel()
        self.client.shutdown()
        for collector in list(self.collectors.values()):
            collector.put_error(EngineDeadError("AsyncLLM was shut down"))
        self.collectors.clear()


__all__ = ["AsyncLLM", "RequestCollector", "EngineDeadError", "EngineRequestError"]
