"""`MultiprocExecutor`: one spawned worker process per tensor-parallel rank (vLLM 0.33's
`vllm/v1/executor/multiproc_executor.py`, `MultiprocExecutor` + `WorkerProc`).

Process layout (docs/parallelism.md draws it):

- the executor's process (the engine core) spawns `tensor_parallel_size` workers; each joins one
  `torch.distributed` group (gloo on the CPU, NCCL on CUDA, rendezvous through a file in a temporary
  directory) and builds a `TorchExecutor` over its shard of the model (`TPGroup(rank, size)`);
- each `execute_model(scheduler_output)` is pickled once and written once into a shared-memory ring
  buffer that every worker reads (`servetwin.gpu.shm_broadcast.MessageQueue`, vLLM's
  `shm_broadcast.py`), never pickled per rank over pipes; every rank runs the same step (the model's
  all-reduces keep them in lockstep) and only rank 0 writes its `ModelRunnerOutput` back, into a second
  queue with one reader;
- start-up (ready / the start-up error) goes over one pipe per worker; a death pipe, whose write end
  only the executor holds, ends every worker when the executor's process goes (its EOF), as vLLM's does.

Faults: a monitor thread waits on the workers' process sentinels (vLLM's `start_worker_monitor`); the
first worker that exits kills the others and marks the executor dead, and a call waiting on a queue
(or any later call) raises `EngineDeadError` within a poll interval. A worker whose step raises exits
(rank 0 first returns the exception to the executor, which re-raises it), so no rank is left waiting in
a collective for a peer that will not come.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.sched.output import SchedulerOutput
from servetwin.gpu.shm_broadcast import MessageQueue, QueueClosed, QueueHandle

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # a worker that neither reports ready nor dies within this is a start-up failure
TERMINATE_GRACE_S = 2.0  # SIGTERM, then SIGKILL after this
SHUTDOWN = "shutdown"


@dataclass(slots=True)
class WorkerArgs:
    rank: int
    world_size: int
    init_method: str
    broadcast: QueueHandle
    response: QueueHandle
    executor_kwargs: dict[str, Any]
    threads: Optional[int]


@dataclass(slots=True)
class WorkerReady:
    """What a worker reports once its shard and KV pool are built."""
    rank: int
    pid: int
    num_gpu_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    kv_cache_groups: Optional[tuple]
    model_path: Optional[str]
    weight_bytes: int
    kv_cache_bytes: int
    num_kv_heads: int
    attention_backend: str


@dataclass(slots=True)
class WorkerFailure:
    """A start-up or step exception of a worker, carried back as the exception itself where it pickles."""
    error: BaseException
    remote_traceback: str

    def reraise(self, prefix: str) -> None:
        self.error.add_note(f"{prefix}; worker traceback:\n{self.remote_traceback}")
        raise self.error


def _exception_to_send(e: BaseException) -> WorkerFailure:
    import pickle  # noqa: PLC0415

    tb = traceback.format_exc()
    try:
        pickle.dumps(e)
        return WorkerFailure(e, tb)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        return WorkerFailure(RuntimeError(f"{type(e).__name__}: {e}"), tb)


class MultiprocExecutor:
    """The `Executor` of a tensor-parallel torch model: `execute_model` on every rank, rank 0's output.

    `executor_kwargs` are `TorchExecutor`'s (model, dtype, device, block_size, ...); on CUDA rank r uses
    `cuda:r`. `threads`: torch's intra-op threads per worker (None: torch's default)."""

    def __init__(self, tensor_parallel_size: int, executor_kwargs: dict[str, Any],
                 threads: Optional[int] = None) -> None:
        if tensor_parallel_size < 2:
            raise ConfigError("tensor_parallel_size", f"MultiprocExecutor is for 2 or more ranks, got "
                                                      f"{tensor_parallel_size} (one rank: TorchExecutor)")
        self.world_size = tensor_parallel_size
        self.step_observers: list[Callable[[SchedulerOutput, ModelRunnerOutput], None]] = []
        self._dead_reason: Optional[str] = None
        self._dead_rank: Optional[int] = None
        self._dead_seen = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self.broadcast = MessageQueue.create(n_reader=tensor_parallel_size)
        self.response = MessageQueue.create(n_reader=1, reader_rank=0)  # rank 0 writes, this process reads
        self._rendezvous = tempfile.mkdtemp(prefix="servetwin-tp-")
        ctx = multiprocessing.get_context("spawn")
        death_reader, self._death_writer = ctx.Pipe(duplex=False)
        self.workers: list[multiprocessing.process.BaseProcess] = []
        ready_pipes = []
        try:
            for rank in range(tensor_parallel_size):
                reader, writer = ctx.Pipe(duplex=False)
                args = WorkerArgs(rank, tensor_parallel_size, f"file://{self._rendezvous}/store",
                                  self.broadcast.handle, self.response.handle,
                                  _rank_kwargs(executor_kwargs, rank), threads)
                proc = ctx.Process(target=worker_main, args=(args, writer, death_reader),
                                   name=f"servetwin-TPWorker-{rank}", daemon=True)
                proc.start()
                writer.close()
                self.workers.append(proc)
                ready_pipes.append(reader)
            death_reader.close()
            self.ready = self._wait_all_ready(ready_pipes)
        except BaseException:
            self._stop_workers()
            self._release()
            raise
        first = self.ready[0]
        self.num_gpu_blocks, self.max_model_len = first.num_gpu_blocks, first.max_model_len
        self.vocab_size, self.eos_token_ids = first.vocab_size, first.eos_token_ids
        self.kv_cache_groups, self.model_path = first.kv_cache_groups, first.model_path
        self.attention_backend_name = first.attention_backend
        self._monitor = threading.Thread(target=self._monitor_workers, name="servetwin-TPWorkerMonitor",
                                         daemon=True)
        self._monitor.start()

    # -- start-up ---------------------------------------------------------------------------------
    def _wait_all_ready(self, pipes: list[multiprocessing.connection.Connection]) -> list[WorkerReady]:
        """Every worker's `WorkerReady`; the first start-up error (or a worker gone without one) raises,
        without waiting for the others (they may wait for the failed one in the rendezvous)."""
        ready: dict[int, WorkerReady] = {}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.workers)}
        while len(ready) < len(pipes):
            pending = [pipes[r] for r in range(len(pipes)) if r not in ready]
            fired = multiprocessing.connection.wait([*pending, *sentinels], timeout=READY_TIMEOUT_S)
            if not fired:
                raise EngineDeadError(f"tensor-parallel workers not ready after {READY_TIMEOUT_S:.0f} s")
            # a worker that exits sends its message first: read the pipes before judging the sentinels
            for rank in sorted({pipes.index(o) if o in pipes else sentinels[o] for o in fired}):
                if rank in ready and self.workers[rank].is_alive():
                    continue
                msg = None
                if rank not in ready and pipes[rank].poll():
                    try:
                        msg = pipes[rank].recv()
                    except EOFError:
                        pass
                if isinstance(msg, WorkerFailure):
                    msg.reraise(f"tensor-parallel worker rank {rank} failed to start")
                if not isinstance(msg, WorkerReady):
                    self.workers[rank].join(1.0)
                    raise EngineDeadError(f"tensor-parallel worker rank {rank} exited during start-up "
                                          f"(exit code {self.workers[rank].exitcode})")
                ready[rank] = msg
        return [ready[r] for r in range(len(pipes))]

    # -- faults -----------------------------------------------------------------------------------
    def _monitor_workers(self) -> None:
        """The first worker to exit (unless we are closing) kills the others and marks us dead."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers)}
        died = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        # rank 0 exits on its own after reporting an error: when another rank died too, that one is the cause
        rank, proc = max(sentinels[d] for d in died) if len(died) > 1 else sentinels[died[0]]
        proc.join(0.5)
        self._dead_rank = rank
        self._dead_reason = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) died with exit code "
                             f"{proc.exitcode}")
        self._dead_seen.set()
        logger.error("%s; stopping the other workers", self._dead_reason)
        self._stop_workers()

    def _is_dead(self) -> bool:
        return self._dead_reason is not None

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(self._dead_reason or "the tensor-parallel workers were shut down")

    # -- calls ------------------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` on every rank's `TorchExecutor`; rank 0's result."""
        with self._lock:
            if self._closing or self._is_dead():
                raise self._dead_error()
            try:
                self.broadcast.enqueue((method, args), should_stop=self._is_dead)
                status, result = self.response.dequeue(should_stop=self._is_dead)
            except QueueClosed:
                raise self._dead_error() from None
        if status == "error":
            if self._peer_died():  # rank 0's collective failed because another rank is gone
                raise self._dead_error() from result.error
            result.reraise(f"tensor-parallel worker rank 0: {method} failed")
        return result

    def _peer_died(self, wait_s: float = 1.0) -> bool:
        """Whether the first rank to exit was not rank 0 (which exits after reporting its own error);
        waits up to `wait_s` for the monitor to see an exit."""
        self._dead_seen.wait(wait_s)
        return self._dead_rank not in (None, 0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self._call("execute_model", scheduler_output)
        for observe in self.step_observers:
            observe(scheduler_output, out)
        return out

    def reset(self) -> None:
        """Forget every request on every rank."""
        self._call("reset")

    def start_profile(self, profile_dir: str) -> None:
        self._call("start_profile", profile_dir)

    def stop_profile(self) -> Optional[str]:
        return self._call("stop_profile")

    def collective_rpc(self, method: str, *args: Any) -> Any:
        """Any `TorchExecutor` method on every rank (rank 0's result); vLLM's `collective_rpc`."""
        return self._call(method, *args)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (asked first, then terminated, then killed) and free the shared memory."""
        if self._closing:
            return
        self._closing = True
        if not self._is_dead():
            try:
                self.broadcast.enqueue((SHUTDOWN, ()), should_stop=self._is_dead, timeout=TERMINATE_GRACE_S)
            except (QueueClosed, TimeoutError):
                pass
        self._stop_workers()
        self._release()

    shutdown = close

    def _stop_workers(self) -> None:
        for p in self.workers:
            p.join(TERMINATE_GRACE_S if self._closing and not self._is_dead() else 0.0)
        for p in self.workers:
            if p.is_alive():
                p.terminate()
        for p in self.workers:
            p.join(TERMINATE_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()

    def _release(self) -> None:
        self._death_writer.close()
        self.broadcast.close()
        self.response.close()
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def __del__(self) -> None:
        if getattr(self, "_death_writer", None) is not None and not getattr(self, "_closing", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def default_worker_threads(device: str, world_size: int) -> Optional[int]:
    """On the CPU the ranks share the cores: torch's intra-op threads of this process split over them
    (at least 1); on CUDA torch's default (None)."""
    if device == "cuda" or device.startswith("cuda:") or (device == "auto" and _cuda_available()):
        return None
    import torch  # noqa: PLC0415

    return max(1, torch.get_num_threads() // world_size)


def _rank_kwargs(kwargs: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank r's `TorchExecutor` arguments: on CUDA its own device, `cuda:r`."""
    out = dict(kwargs)
    device = str(out.get("device", "auto"))
    if device == "cuda" or device.startswith("cuda:") or (device == "auto" and _cuda_available()):
        out["device"] = f"cuda:{rank}"
    return out


def _cuda_available() -> bool:
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


# -- the worker process ---------------------------------------------------------------------------
def _watch_death_pipe(death_reader: multiprocessing.connection.Connection) -> None:
    """Exit at once when the executor's process is gone (the pipe's write end closed)."""
    def watch() -> None:
        try:
            death_reader.recv()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="servetwin-death-pipe", daemon=True).start()


def worker_main(args: WorkerArgs, ready_pipe: multiprocessing.connection.Connection,
                death_reader: multiprocessing.connection.Connection) -> None:
    """Body of one tensor-parallel worker: build the shard, report ready, then run every broadcast call."""
    _watch_death_pipe(death_reader)
    import torch  # noqa: PLC0415

    from servetwin.gpu.executor import TorchExecutor, resolve_device  # noqa: PLC0415
    from servetwin.gpu.parallel_state import destroy_tp_group, init_tp_group  # noqa: PLC0415

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.executor_kwargs.get("device", "auto"))
        tp = init_tp_group(args.rank, args.world_size, args.init_method, device)
        ex = TorchExecutor(**args.executor_kwargs, tp=tp)
        broadcast = MessageQueue.attach(args.broadcast, reader_rank=args.rank)
        response = MessageQueue.attach(args.response, reader_rank=None) if args.rank == 0 else None
        path = ex.model_info.path
        ready_pipe.send(WorkerReady(
            args.rank, os.getpid(), ex.num_gpu_blocks, ex.max_model_len, ex.vocab_size, list(ex.eos_token_ids),
            ex.kv_cache_groups, str(path) if path else None, ex.weight_bytes, ex.kv_cache_bytes,
            ex.kv_spec.num_kv_heads, ex.attention_backend_name))
    except BaseException as e:  # noqa: BLE001 - the executor re-raises it
        ready_pipe.send(_exception_to_send(e))
        ready_pipe.close()
        os._exit(1)
    ready_pipe.close()
    while True:
        method, call_args = broadcast.dequeue()
        if method == SHUTDOWN:
            break
        try:
            reply = ("ok", getattr(ex, method)(*call_args))
        except Exception as e:  # noqa: BLE001
            if response is None:
                logger.error("tensor-parallel worker rank %d: %s failed: %s", args.rank, method, e)
                os._exit(1)  # a peer waiting in a collective fails at once instead of at its timeout
            response.enqueue(("error", _exception_to_send(e)))
            os._exit(1)
        if response is not None:
            response.enqueue(reply)
    ex.close()
    destroy_tp_group()
    broadcast.close()
    if response is not None:
        response.close()
