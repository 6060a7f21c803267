"""`MultiprocExecutor`: one worker process per tensor-parallel rank (vLLM 0.33's
`vllm/v1/executor/multiproc_executor.py`, `MultiprocExecutor` + `WorkerProc`).

Process layout (docs/parallelism.md draws it):

- the executor's process (the engine core) starts `tensor_parallel_size` workers, each a fresh
  interpreter (`python -m servetwin.gpu.tp_worker`, started like the engine-core process, so a script
  without a main guard works); each joins one `torch.distributed` group (gloo on the CPU, NCCL on CUDA,
  rendezvous through a file in a temporary directory) and builds a `TorchExecutor` over its shard of
  the model (`TPGroup(rank, size)`);
- each `execute_model(scheduler_output)` is pickled once and written once into a shared-memory ring
  buffer that every worker reads (`servetwin.gpu.shm_broadcast.MessageQueue`, vLLM's
  `shm_broadcast.py`), never pickled per rank over pipes; every rank runs the same step (the model's
  all-reduces keep them in lockstep) and only rank 0 writes its `ModelRunnerOutput` back, into a second
  queue with one reader;
- the arguments go on the worker's standard input; ready (or the start-up error) comes back over one
  pipe per worker; a death pipe, whose write end only the executor holds, ends every worker when the
  executor's process goes (its EOF), as vLLM's does.

Faults: a monitor thread waits on the workers' pidfds (vLLM's `start_worker_monitor` waits on process
sentinels); the first worker that exits kills the others and marks the executor dead, and a call
waiting on a queue (or any later call) raises `EngineDeadError`: the monitor wakes the executor's blocked
wait on the response queue (`MessageQueue.wake_reader`, vLLM's `SpinCondition.cancel`). A worker whose
step raises exits (rank 0 first returns the exception, which the executor re-raises), so no rank is
left waiting in a collective for a peer that will not come.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

from servetwin.core.config_error import ConfigError
from servetwin.core.engine.engine_client import EngineDeadError
from servetwin.core.engine.mp_client import EngineProcess
from servetwin.core.outputs import ModelRunnerOutput
from servetwin.core.sched.output import SchedulerOutput
from servetwin.gpu.shm_broadcast import MessageQueue, QueueClosed, QueueHandle

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # a worker that neither reports ready nor dies within this is a start-up failure
TERMINATE_GRACE_S = 2.0  # SIGTERM, then SIGKILL after this
SHUTDOWN = "shutdown"
WORKER_MODULE = "servetwin.gpu.tp_worker"
POLL_S = 0.05  # exit polling where pidfds are missing


@dataclass(slots=True)
class WorkerArgs:
    rank: int
    world_size: int
    pipeline_parallel_size: int  # 1: the world is the TP group; else it is the PP group (TP 1)
    init_method: str
    broadcast: QueueHandle
    response: QueueHandle
    executor_kwargs: dict[str, Any]
    threads: Optional[int]
    ready_fd: int  # write end of the ready pipe (the worker's own copy)
    death_fd: int  # read end of the death pipe


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
    is_moe: bool = False


@dataclass(slots=True)
class WorkerFailure:
    """A start-up or step exception of a worker, carried back as the exception itself where it pickles."""
    error: BaseException
    remote_traceback: str

    def reraise(self, prefix: str) -> None:
        self.error.add_note(f"{prefix}; worker traceback:\n{self.remote_traceback}")
        raise self.error


def exception_to_send(e: BaseException) -> WorkerFailure:
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
                 threads: Optional[int] = None, pipeline_parallel_size: int = 1) -> None:
        if tensor_parallel_size > 1 and pipeline_parallel_size > 1:
            raise ConfigError("pipeline_parallel_size", f"tensor parallelism ({tensor_parallel_size}) and pipeline "
                                                        "parallelism together are not supported yet")
        world_size = tensor_parallel_size * pipeline_parallel_size
        if world_size < 2:
            raise ConfigError("tensor_parallel_size", f"MultiprocExecutor is for 2 or more ranks, got "
                                                      f"{world_size} (one rank: TorchExecutor)")
        self.world_size = world_size
        self.pipeline_parallel_size = pipeline_parallel_size
        # the rank that answers: the last pipeline stage samples (vLLM's output rank), else rank 0
        self.output_rank = world_size - 1 if pipeline_parallel_size > 1 else 0
        # with PP the engine keeps PP batches in flight: `execute_model(so, non_block=True)` returns a future
        self.supports_non_block = pipeline_parallel_size > 1
        self._sent = 0  # calls broadcast so far; the output rank answers each, in order
        self._received: dict[int, tuple[str, Any]] = {}
        self._next_reply = 0
        self.step_observers: list[Callable[[SchedulerOutput, ModelRunnerOutput], None]] = []
        self._dead_reason: Optional[str] = None
        self._dead_rank: Optional[int] = None
        self._dead_seen = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self.broadcast = MessageQueue.create(n_reader=world_size)
        self.response = MessageQueue.create(n_reader=1, reader_rank=0)  # the output rank writes, we read
        self._rendezvous = tempfile.mkdtemp(prefix="servetwin-tp-")
        death_r, self._death_w = os.pipe()
        self.workers: list[EngineProcess] = []
        ready_fds: list[int] = []
        try:
            for rank in range(world_size):
                ready_r, ready_w = os.pipe()
                args = WorkerArgs(rank, world_size, pipeline_parallel_size, f"file://{self._rendezvous}/store",
                                  self.broadcast.handle, self.response.handle,
                                  _rank_kwargs(executor_kwargs, rank), threads, ready_w, death_r)
                ready_fds.append(ready_r)
                try:
                    self.workers.append(EngineProcess.start({"args": args}, module=WORKER_MODULE,
                                                            pass_fds=(ready_w, death_r)))
                finally:
                    os.close(ready_w)
            self.ready = self._wait_all_ready(ready_fds)
        except BaseException:
            self._stop_workers()
            self._release()
            raise
        finally:
            os.close(death_r)
            for fd in ready_fds:
                os.close(fd)
        first = self.ready[0]
        self.num_gpu_blocks, self.max_model_len = first.num_gpu_blocks, first.max_model_len
        self.vocab_size, self.eos_token_ids = first.vocab_size, first.eos_token_ids
        self.kv_cache_groups, self.model_path = first.kv_cache_groups, first.model_path
        self.attention_backend_name = first.attention_backend
        self.is_moe = first.is_moe
        self.block_size = int(executor_kwargs.get("block_size", 16))
        self._monitor = threading.Thread(target=self._monitor_workers, name="servetwin-TPWorkerMonitor",
                                         daemon=True)
        self._monitor.start()

    # -- start-up ---------------------------------------------------------------------------------
    def _wait_all_ready(self, ready_fds: list[int]) -> list[WorkerReady]:
        """Every worker's `WorkerReady` (a pickle on its ready pipe, then EOF); the first start-up error,
        or a worker gone without one, raises without waiting for the others (they may be waiting for
        the failed one in the rendezvous)."""
        received: dict[int, bytearray] = {rank: bytearray() for rank in range(len(ready_fds))}
        ready: dict[int, WorkerReady] = {}
        while len(ready) < len(ready_fds):
            fired = multiprocessing.connection.wait([ready_fds[r] for r in received], timeout=READY_TIMEOUT_S)
            if not fired:
                raise EngineDeadError(f"tensor-parallel workers not ready after {READY_TIMEOUT_S:.0f} s")
            for rank in [r for r in received if ready_fds[r] in fired]:
                chunk = os.read(ready_fds[rank], 1 << 16)
                if chunk:
                    received[rank] += chunk
                    continue
                msg = pickle.loads(received.pop(rank)) if received[rank] else None  # EOF: the whole message
                if isinstance(msg, WorkerFailure):
                    msg.reraise(f"tensor-parallel worker rank {rank} failed to start")
                if not isinstance(msg, WorkerReady):
                    self.workers[rank].join(1.0)
                    raise EngineDeadError(f"tensor-parallel worker rank {rank} exited during start-up "
                                          f"(exit code {self.workers[rank].exitcode})")
                ready[rank] = msg
        return [ready[r] for r in range(len(ready_fds))]

    # -- faults -----------------------------------------------------------------------------------
    def _monitor_workers(self) -> None:
        """The first worker to exit (unless we are closing) kills the others and marks us dead."""
        died = _wait_any_exit(self.workers)
        if self._closing:
            return
        # rank 0 exits on its own after reporting an error: when another rank died too, that one is the cause
        rank = max(died)
        proc = self.workers[rank]
        proc.join(0.5)
        self._dead_rank = rank
        self._dead_reason = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) died with exit code "
                             f"{proc.exitcode}")
        self._dead_seen.set()
        self.response.wake_reader()  # a step waiting for rank 0's answer sees it now, not at its next poll
        logger.error("%s; stopping the other workers", self._dead_reason)
        self._stop_workers()

    def _is_dead(self) -> bool:
        return self._dead_reason is not None

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(self._dead_reason or "the tensor-parallel workers were shut down")

    # -- calls ------------------------------------------------------------------------------------
    def _send(self, method: str, *args: Any) -> int:
        """Broadcast `method(*args)` to every rank's `TorchExecutor`; the call's sequence number."""
        with self._lock:
            if self._closing or self._is_dead():
                raise self._dead_error()
            try:
                self.broadcast.enqueue((method, args), should_stop=self._is_dead)
            except QueueClosed:
                raise self._dead_error() from None
            self._sent += 1
            return self._sent - 1

    def _reply(self, seq: int, method: str) -> Any:
        """The output rank's answer to call `seq` (answers come in call order; earlier ones are kept
        for their own waiters)."""
        with self._lock:
            while seq not in self._received:
                if self._is_dead():
                    raise self._dead_error()
                try:
                    self._received[self._next_reply] = self.response.dequeue(should_stop=self._is_dead)
                except QueueClosed:
                    raise self._dead_error() from None
                self._next_reply += 1
            status, result = self._received.pop(seq)
        if status == "error":
            if self._peer_died():  # the output rank's collective failed because another rank is gone
                raise self._dead_error() from result.error
            result.reraise(f"tensor-parallel worker rank {self.output_rank}: {method} failed")
        return result

    def _call(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` on every rank's `TorchExecutor`; the output rank's result."""
        return self._reply(self._send(method, *args), method)

    def _peer_died(self, wait_s: float = 1.0) -> bool:
        """Whether the first rank to exit was not the output rank (which exits after reporting its own
        error); waits up to `wait_s` for the monitor to see an exit."""
        self._dead_seen.wait(wait_s)
        return self._dead_rank not in (None, self.output_rank)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        """One step on every rank. `non_block`: broadcast it and return a future of the output rank's
        `ModelRunnerOutput` (vLLM's `execute_model(..., non_block=True)`), resolved when waited for."""
        seq = self._send("execute_model", scheduler_output)
        if not non_block:
            return self._observed(scheduler_output, self._reply(seq, "execute_model"))
        return _PendingOutput(lambda: self._observed(scheduler_output, self._reply(seq, "execute_model")))

    def _observed(self, scheduler_output: SchedulerOutput, out: ModelRunnerOutput) -> ModelRunnerOutput:
        for observe in self.step_observers:
            observe(scheduler_output, out)
        return out

    def execute_dummy_batch(self) -> None:
        """A dummy forward on every rank (an idle MoE data-parallel rank's step)."""
        self._call("execute_dummy_batch")

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
        if self._death_w is not None:
            os.close(self._death_w)  # any worker still alive exits on the EOF
            self._death_w = None
        for p in self.workers:
            p.close()
        self.broadcast.close()
        self.response.close()
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def __del__(self) -> None:
        if getattr(self, "_death_w", None) is not None and not getattr(self, "_closing", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class _PendingOutput(Future):
    """A step in flight: `result()` waits for the output rank's answer (in the caller's thread; the
    engine waits for its batches oldest first)."""

    def __init__(self, wait: Callable[[], ModelRunnerOutput]) -> None:
        super().__init__()
        self._wait = wait

    def result(self, timeout: Optional[float] = None) -> ModelRunnerOutput:
        if not self.done():
            try:
                self.set_result(self._wait())
            except BaseException as e:  # noqa: BLE001 - kept, then raised to every waiter
                self.set_exception(e)
        return super().result(timeout)


def _wait_any_exit(workers: list[EngineProcess]) -> list[int]:
    """Block until a worker exits; the ranks that have."""
    sentinels = [p.sentinel for p in workers]
    while True:
        if all(fd is not None for fd in sentinels):
            multiprocessing.connection.wait(sentinels)
        else:
            time.sleep(POLL_S)
        died = [rank for rank, p in enumerate(workers) if not p.is_alive()]
        if died:
            return died


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
