"""One tensor-parallel worker process of `servetwin.gpu.multiproc_executor.MultiprocExecutor` (vLLM 0.33's
`WorkerProc.worker_main` / `worker_busy_loop` in `vllm/v1/executor/multiproc_executor.py`).

Started as a fresh interpreter, `python -m servetwin.gpu.tp_worker`, with its `WorkerArgs` pickled on
standard input (not multiprocessing's spawn, which re-imports the caller's `__main__`: scripts without
a main guard, notebooks and `python -c` start it the same way). It joins the TP group, builds its
`TorchExecutor` shard, writes `WorkerReady` (or the start-up error) on its ready pipe and closes it, then
runs every call broadcast on the shared-memory queue; the output rank (rank 0, or the last pipeline stage)
writes each result to the response queue.
EOF of the death pipe (the executor's process is gone) ends it at once.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
from typing import Any

from servetwin.gpu.multiproc_executor import SHUTDOWN, WorkerArgs, WorkerReady, exception_to_send
from servetwin.gpu.shm_broadcast import MessageQueue

logger = logging.getLogger(__name__)


def _watch_death_pipe(fd: int) -> None:
    """Exit at once when the executor's process is gone (the death pipe's write end closed)."""
    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="servetwin-death-pipe", daemon=True).start()


def _send(fd: int, msg: Any) -> None:
    """One pickle on the ready pipe, then EOF."""
    with os.fdopen(fd, "wb") as f:
        f.write(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def run_worker(args: WorkerArgs) -> None:
    _watch_death_pipe(args.death_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor decides; it shuts us down
    import torch  # noqa: PLC0415

    from servetwin.gpu.executor import TorchExecutor, resolve_device  # noqa: PLC0415
    from servetwin.gpu.parallel_state import PPGroup, TPGroup, destroy_tp_group, init_tp_group  # noqa: PLC0415

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.executor_kwargs.get("device", "auto"))
        world = init_tp_group(args.rank, args.world_size, args.init_method, device)
        if args.pipeline_parallel_size > 1:  # the world is the pipeline (TP 1)
            ex = TorchExecutor(**args.executor_kwargs, tp=TPGroup(), pp=PPGroup(args.rank, args.world_size))
        else:
            ex = TorchExecutor(**args.executor_kwargs, tp=world)
        broadcast = MessageQueue.attach(args.broadcast, reader_rank=args.rank)
        output_rank = args.world_size - 1 if args.pipeline_parallel_size > 1 else 0
        response = MessageQueue.attach(args.response, reader_rank=None) if args.rank == output_rank else None
        path = ex.model_info.path
        ready = WorkerReady(args.rank, os.getpid(), ex.num_gpu_blocks, ex.max_model_len, ex.vocab_size,
                            list(ex.eos_token_ids), ex.kv_cache_groups, str(path) if path else None,
                            ex.weight_bytes, ex.kv_cache_bytes, ex.kv_spec.num_kv_heads, ex.attention_backend_name,
                            ex.is_moe)
    except BaseException as e:  # noqa: BLE001 - the executor re-raises it
        _send(args.ready_fd, exception_to_send(e))
        os._exit(1)
    _send(args.ready_fd, ready)
    while True:
        method, call_args = broadcast.dequeue()
        if method == SHUTDOWN:
            break
        try:
            reply = ("ok", getattr(ex, method)(*call_args))
        except Exception as e:  # noqa: BLE001
            if response is None:
                logger.error("tensor-parallel worker rank %d: %s failed: %s", args.rank, method, e)
            else:
                response.enqueue(("error", exception_to_send(e)))
            os._exit(1)  # a peer waiting in a collective fails at once instead of at its timeout
        if response is not None:
            response.enqueue(reply)
    ex.close()
    destroy_tp_group()
    broadcast.close()
    if response is not None:
        response.close()


def main() -> None:
    """`python -m servetwin.gpu.tp_worker`: its `WorkerArgs`, pickled on standard input."""
    payload = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    run_worker(payload["args"])


if __name__ == "__main__":
    main()
