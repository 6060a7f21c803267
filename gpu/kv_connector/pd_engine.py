"""Disaggregated prefill for real: a prefill engine (`kv_producer`) and a decode engine
(`kv_consumer`), each a torch engine in its own process with its own KV pool, and the proxy in
front of them (vLLM's `disagg_proxy` examples): each request goes to prefill with `max_tokens=1` and
`do_remote_decode`, then to decode with the `kv_transfer_params` prefill returned; the decode engine
pulls the prompt's KV (gpu/kv_connector/pd_worker.py) and continues from it.

Every wait has a timeout and checks that the engine it waits on is alive: a dead engine is a
`PDEngineError`, never a hang.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from servetwin.core.kv_connector.config import KVTransferConfig


class PDEngineError(RuntimeError):
    """An engine process died, failed, or did not answer in time."""


def engine_main(executor_kwargs: dict, kv_transfer_config: dict, inbox: Any, outbox: Any) -> None:
    """One engine process: requests in (`("add", id, prompt, SamplingParams kwargs)`, `("stats",)`,
    `("stop",)`), finished requests out (`("done", id, tokens, kv_transfer_params, error)`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from servetwin.core.engine.engine_core import EngineCore
    from servetwin.core.request import FinishReason, Request
    from servetwin.core.sampling_params import SamplingParams
    from servetwin.core.sched.config import CacheConfig, SchedulerConfig
    from servetwin.gpu.executor import TorchExecutor
    ex = TorchExecutor(**executor_kwargs, kv_transfer_config=KVTransferConfig(**kv_transfer_config))
    engine = EngineCore(SchedulerConfig(max_num_batched_tokens=ex.max_num_batched_tokens, max_num_seqs=ex.max_num_seqs,
                                        max_model_len=ex.max_model_len),
                        CacheConfig(block_size=ex.block_size, num_gpu_blocks=ex.num_gpu_blocks), ex)
    tokens: dict[str, list[int]] = {}
    busy = False  # the last step computed something (an empty step only waits for the connector)
    try:
        while True:
            try:
                msg = inbox.get(timeout=0 if busy else 0.005 if engine.has_work() else 0.05)
            except queue.Empty:
                msg = None
            if msg is not None and msg[0] == "stop":
                break
            if msg is not None and msg[0] == "stats":
                outbox.put(("stats", ex.kv_connector_worker.stats, engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()))
            elif msg is not None:
                _, rid, prompt, params = msg
                engine.add_request(Request(rid, prompt, SamplingParams(**params)))
                tokens[rid] = []
            result = engine.step() if engine.has_work() else None
            busy = result is not None and result.scheduled is not None and result.scheduled.total_num_scheduled_tokens > 0
            for o in result.outputs if result is not None else ():
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    error = "KV load failed" if o.finish_reason == FinishReason.ERROR else None
                    outbox.put(("done", o.request_id, tokens.pop(o.request_id), o.kv_transfer_params, error))
    finally:
        ex.close()


@dataclass(slots=True)
class EngineProcess:
    """One engine process and its two queues."""
    name: str
    proc: Any
    inbox: Any
    outbox: Any

    def get(self, timeout_s: float) -> tuple:
        """The engine's next message; `PDEngineError` when it died or stayed silent `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self.outbox.get(timeout=0.2)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise PDEngineError(f"{self.name} engine process died (exit code {self.proc.exitcode})") from None
        raise PDEngineError(f"{self.name} engine did not answer within {timeout_s:g} s")


def start_engine(name: str, executor_kwargs: dict, kv_transfer_config: dict) -> EngineProcess:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine_main, args=(executor_kwargs, kv_transfer_config, inbox, outbox),
                       name=f"servetwin-{name}", daemon=True)
    proc.start()
    return EngineProcess(name, proc, inbox, outbox)


@dataclass(slots=True)
class PDProxy:
    """Prefill then decode, as vLLM's P/D proxy. `timeout_s` bounds every wait."""
    prefill: EngineProcess
    decode: EngineProcess
    timeout_s: float = 120.0
    first_tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, executor_kwargs: dict, side_channel_port: int, timeout_s: float = 120.0,
              kv_transfer_timeout_s: float = 10.0, kv_lease_duration: float = 30.0) -> "PDProxy":
        extra = {"side_channel_port": side_channel_port, "kv_lease_duration": kv_lease_duration}
        prefill = start_engine("prefill", executor_kwargs, dict(
            kv_connector="NixlConnector", kv_role="kv_producer", kv_connector_extra_config=extra))
        decode = start_engine("decode", executor_kwargs, dict(
            kv_connector="NixlConnector", kv_role="kv_consumer",
            kv_connector_extra_config={"kv_transfer_timeout_s": kv_transfer_timeout_s}))
        return cls(prefill, decode, timeout_s)

    def generate(self, prompts: dict[str, list[int]], params: dict) -> dict[str, list[int]]:
        """The decode engine's outputs for each request id (`params`: SamplingParams keywords). Each
        prefilled request goes on to decode at once: the prefill engine's pool frees its blocks only
        once the decode engine read them."""
        self.prefill_all(prompts, params, lambda rid, kv: self.send_to_decode(prompts, params, {rid: kv}))
        return self.collect_decoded(prompts)

    def prefill_all(self, prompts: dict[str, list[int]], params: dict,
                    on_prefilled: Optional[Callable[[str, dict], None]] = None) -> dict[str, dict]:
        """Prefill every prompt (`max_tokens=1`, `do_remote_decode`): its kv_transfer_params."""
        for rid, prompt in prompts.items():
            self.prefill.inbox.put(("add", rid, prompt, {**params, "max_tokens": 1, "extra_args": {
                "kv_transfer_params": {"do_remote_decode": True}}}))
        handoff: dict[str, dict] = {}
        for _ in prompts:
            _, rid, toks, kv_params, error = self.prefill.get(self.timeout_s)
            if error or kv_params is None:
                raise PDEngineError(f"prefill of {rid} failed: {error or 'no kv_transfer_params'}")
            self.first_tokens[rid] = toks[0]
            handoff[rid] = kv_params
            if on_prefilled is not None:
                on_prefilled(rid, kv_params)
        return handoff

    def send_to_decode(self, prompts: dict[str, list[int]], params: dict, handoff: dict[str, dict]) -> None:
        for rid, kv_params in handoff.items():
            self.decode.inbox.put(("add", rid, prompts[rid], {**params, "extra_args": {"kv_transfer_params": kv_params}}))

    def collect_decoded(self, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {}
        for _ in prompts:
            _, rid, toks, _, error = self.decode.get(self.timeout_s)
            if error:
                raise PDEngineError(f"decode of {rid} failed: {error}")
            outputs[rid] = toks
        return outputs

    def stats(self, engine: EngineProcess) -> tuple:
        """(the engine's transfer stats, its free KV blocks)."""
        engine.inbox.put(("stats",))
        msg = engine.get(self.timeout_s)
        while msg[0] != "stats":
            msg = engine.get(self.timeout_s)
        return msg[1], msg[2]

    def close(self) -> None:
        for e in (self.prefill, self.decode):
            if e.proc.is_alive():
                e.inbox.put(("stop",))
        for e in (self.prefill, self.decode):
            e.proc.join(timeout=10)
            if e.proc.is_alive():
                e.proc.kill()
                e.proc.join(timeout=5)
