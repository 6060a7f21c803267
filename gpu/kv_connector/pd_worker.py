"""The P/D (NixlConnector) worker side in the torch backend: the decode engine pulls a prompt's KV
from the prefill engine's pool over a ZeroMQ side channel (on CPU; NIXL / NCCL would move the same
blocks on a GPU), like vLLM 0.33's NIXL worker in pull mode (`kv_connector/v1/nixl/worker.py`).

- Producer (`kv_producer`): a server thread answers `read` (the KV of `num_tokens` tokens held in
  `block_ids`, every layer's K and V) and `done` (the reader has it: the blocks may be freed). A
  request in the step's `reqs_to_send` is reported in `finished_sending` once its reader said `done`,
  or once its lease (`kv_lease_duration` s) expired - a dead reader never pins blocks forever; a
  read after the expiry is refused (the blocks may hold another request's KV by then).
- Consumer (`kv_consumer`): each read of `reqs_to_recv` runs before the forward pass and lands in the
  request's new local blocks (the remote blocks' tail when the local prefix cache supplied the
  head); it is reported in `finished_recving`. A read that times out (`kv_transfer_timeout_s`) or
  fails is reported in `failed_recving` with its blocks invalid: the scheduler then applies
  `kv_load_failure_policy` (vLLM's default "fail" finishes the request with an error).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import zmq

from servetwin.core.kv_connector.base import KVConnectorOutput
from servetwin.core.kv_connector.config import KVTransferConfig
from servetwin.gpu.kv_connector.offloading_worker import unique_layer_caches

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PDTransferStats:
    num_reads: int = 0
    num_failed_reads: int = 0
    transferred_tokens: int = 0
    transferred_bytes: int = 0


def gather_tokens(layers: list[torch.Tensor], block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """`[num_layer_tensors, num_tokens, heads, head_dim]`: the first `num_tokens` slots of the blocks."""
    idx = torch.tensor(block_ids, device=layers[0].device)
    return torch.stack([t.index_select(0, idx).flatten(0, 1)[:num_tokens] for t in layers]).cpu()


def scatter_tokens(layers: list[torch.Tensor], block_ids: list[int], kv: torch.Tensor) -> None:
    """Write `gather_tokens`' result into the first slots of `block_ids`."""
    bs = layers[0].shape[1]
    n = kv.shape[1]
    for t, src in zip(layers, kv):
        for i, b in enumerate(block_ids):
            chunk = src[i * bs:min(n, (i + 1) * bs)]
            t[b, :len(chunk)].copy_(chunk.to(t.device))


class PDProducerWorker:
    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = unique_layer_caches(kv_caches)
        self.stats = PDTransferStats()
        self._lock = threading.Lock()
        self._read_done: set[str] = set()
        self._leases: dict[str, float] = {}  # request id -> deadline (host clock)
        self._expired: set[str] = set()  # leases that ran out: their blocks may hold other KV now
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        host = config.get_from_extra_config("side_channel_host", "localhost")
        self._sock.bind(f"tcp://{'127.0.0.1' if host == 'localhost' else host}:"
                        f"{int(config.get_from_extra_config('side_channel_port', 5600))}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pd-producer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            msg = self._sock.recv_pyobj()
            try:
                reply = self._answer(msg)
            except Exception as e:  # a bad read must not kill the server: the reader gets the error
                reply = ("error", repr(e))
            self._sock.send_pyobj(reply)

    def _answer(self, msg: tuple) -> tuple:
        kind, req_id = msg[0], msg[1]
        if kind == "read":
            block_ids, num_tokens = msg[2], msg[3]
            with self._lock:  # (an expiry is marked under the lock: a read before it sees held blocks)
                if req_id in self._expired:
                    return ("error", f"the lease of {req_id} expired: its KV blocks were freed")
                with torch.inference_mode():
                    kv = gather_tokens(self.layers, block_ids, num_tokens)
                self.stats.num_reads += 1
                self.stats.transferred_tokens += num_tokens
                self.stats.transferred_bytes += kv.numel() * kv.element_size()
            return ("kv", kv.numpy())
        if kind in ("done", "free"):
            with self._lock:
                self._read_done.add(req_id)
            return ("ok",)
        return ("error", f"unknown message {kind!r}")

    def before_forward(self, meta: Any) -> None:
        now = time.monotonic()
        with self._lock:
            for rid, lease_s in meta.reqs_to_send.items():
                self._leases[rid] = now + float(lease_s)

    def after_forward(self) -> Optional[KVConnectorOutput]:
        now = time.monotonic()
        with self._lock:
            done = {r for r, deadline in self._leases.items() if r in self._read_done or deadline <= now}
            for r in done:
                del self._leases[r]
                if r not in self._read_done:
                    self._expired.add(r)
                    logger.warning("request %s: the lease of its KV expired before a reader took it", r)
                self._read_done.discard(r)
        return KVConnectorOutput(finished_sending=done) if done else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()


class PDConsumerWorker:
    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = unique_layer_caches(kv_caches)
        self.timeout_ms = int(1000 * float(config.get_from_extra_config("kv_transfer_timeout_s", 30)))
        self.stats = PDTransferStats()
        self._ctx = zmq.Context()
        self._out = KVConnectorOutput(finished_recving=set(), failed_recving=set())

    def _call(self, params: dict, msg: tuple) -> tuple:
        """One request/reply with the producer; TimeoutError when it does not answer in time."""
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        host = params["remote_host"]
        try:
            sock.connect(f"tcp://{'127.0.0.1' if host == 'localhost' else host}:{int(params['remote_port'])}")
            sock.send_pyobj(msg)
            return sock.recv_pyobj()
        except zmq.Again:
            raise TimeoutError(f"KV transfer: {params['remote_engine_id']} did not answer {msg[0]!r} "
                               f"for {msg[1]} within {self.timeout_ms / 1000:g} s") from None
        finally:
            sock.close()

    def _read(self, rid: str, recv: Any) -> None:
        params, local = recv.kv_transfer_params, recv.local_block_ids[0]
        remote = params["remote_block_ids"][0]
        bs = self.layers[0].shape[1]
        skip = len(remote) - len(local)  # the local prefix cache supplied the head
        if skip < 0:
            raise RuntimeError(f"KV transfer: {len(local)} local blocks for {len(remote)} remote ones")
        num_tokens = params["remote_num_tokens"] - skip * bs
        reply = self._call(params, ("read", params["remote_request_id"], remote[skip:], num_tokens))
        if reply[0] != "kv":
            raise RuntimeError(f"KV transfer: {params['remote_engine_id']} answered {reply!r}")
        kv = torch.from_numpy(reply[1])
        scatter_tokens(self.layers, local, kv)
        self._call(params, ("done", params["remote_request_id"]))
        self.stats.num_reads += 1
        self.stats.transferred_tokens += num_tokens
        self.stats.transferred_bytes += kv.numel() * kv.element_size()

    def before_forward(self, meta: Any) -> None:
        for rid, recv in meta.reqs_to_recv.items():
            if not recv.awaiting_kvs:  # aborted before its read: tell the producer to free
                try:
                    self._call(recv.kv_transfer_params, ("free", recv.kv_transfer_params["remote_request_id"]))
                except TimeoutError as e:
                    logger.warning("%s", e)  # the producer's lease frees the blocks
                continue
            try:
                with torch.inference_mode():
                    self._read(rid, recv)
            except (TimeoutError, RuntimeError, zmq.ZMQError) as e:
                logger.error("request %s: %s", rid, e)
                self.stats.num_failed_reads += 1
                self._out.failed_recving.add(rid)  # NIXL reports a failed read in both lists
                self._out.invalid_block_ids.update(recv.local_block_ids[0])
            self._out.finished_recving.add(rid)

    def after_forward(self) -> Optional[KVConnectorOutput]:
        out, self._out = self._out, KVConnectorOutput(finished_recving=set(), failed_recving=set())
        if out.is_empty():
            return None
        out.finished_recving = out.finished_recving or None
        return out

    def close(self) -> None:
        self._ctx.term()
