"""Engine-core clients that run the `EngineCore` in its own process (vLLM's `SyncMPClient` /
`AsyncMPClient`).

Start-up: the client binds two ZMQ sockets on ipc:// paths in a private temp dir (input: client ->
engine, PUSH/PULL; output: engine -> client, PUSH/PULL), starts the engine as a fresh interpreter,
`python -m servetwin.core.engine.engine_proc` (`EngineProcess`; arguments: the picklable `EngineArgs`
and the addresses, pickled on its standard input; it never imports the caller's `__main__`), and waits - with a timeout - for the ready message (`EngineConfig`: final `num_gpu_blocks`,
`max_model_len`, vocab size, EOS ids, model path), exposed as `client.config`. When the child fails
to start, its exception text is raised in the parent (a `ValueError` in the child is re-raised as a
`ValueError` with the same message).

Liveness: a monitor thread waits on the process (a pidfd). When the process dies without being asked
to, the monitor marks the client dead and pushes an `EngineDeadMsg` into the client's own output
socket, which wakes any caller blocked on it; every pending and later call raises `EngineDeadError`.

Shutdown (`shutdown()`, also run by `weakref.finalize` on garbage collection and at interpreter exit):
ask the engine to stop, wait, then terminate / kill it, close the sockets and remove the temp dir.
The child also exits by itself when its parent process disappears.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from typing import Any, Iterator, Optional

import zmq
import zmq.asyncio

from servetwin.core.engine import messages as m
from servetwin.core.engine.engine_args import EngineArgs
from servetwin.core.engine.engine_client import EngineCoreClient, EngineDeadError
from servetwin.core.outputs import EngineCoreOutput
from servetwin.core.sampling_params import SamplingParams

DEFAULT_STARTUP_TIMEOUT_S = float(os.environ.get("SERVETWIN_ENGINE_STARTUP_TIMEOUT", "600"))
POLL_SLICE_MS = 1000  # safety net only: the monitor wakes blocked callers at once


class EngineStartupError(RuntimeError):
    """The EngineCore process failed to start (its error text is in the message)."""


class EngineRequestError(ValueError):
    """The engine refused a request (e.g. it can never fit the KV pool); names the field."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class _Resources:
    """Everything shutdown needs, held apart from the client so finalizers don't keep it alive."""

    def __init__(self) -> None:
        self.ctx: Optional[zmq.Context] = None
        self.input_socket: Any = None
        self.output_socket: Any = None
        self.proc: Any = None
        self.tmpdir: Optional[str] = None
        self.output_addr: Optional[str] = None
        self.shutting_down = False
        self.closed = False
        self.dead = False
        self.dead_reason: Optional[str] = None
        self.stop_r: Optional[int] = None
        self.stop_w: Optional[int] = None
        self.monitor: Optional[threading.Thread] = None
        self.lock = threading.Lock()
        self.owner_pid = os.getpid()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if os.getpid() != self.owner_pid:
            return  # a forked copy of the front end: the engine and the sockets belong to the parent
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.shutting_down = True
        proc = self.proc
        if self.stop_w is not None:
            try:
                os.write(self.stop_w, b"x")
            except OSError:
                pass
        if proc is not None and proc.is_alive():
            if self.input_socket is not None and not self.dead:
                try:
                    self.input_socket.send(m.encoder().encode(m.ShutdownMsg()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        elif proc is not None:
            proc.join(0.1)
        if self.monitor is not None and self.monitor is not threading.current_thread():
            self.monitor.join(1.0)
        if proc is not None:
            proc.close()
        for sock in (self.input_socket, self.output_socket):
            if sock is not None:
                try:
                    sock.close(linger=0)
                except Exception:  # noqa: BLE001
                    pass
        if self.ctx is not None:
            try:
                self.ctx.term()
            except Exception:  # noqa: BLE001
                pass
        for fd in (self.stop_r, self.stop_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stop_r = self.stop_w = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


class EngineProcess:
    """The EngineCore as a fresh interpreter: `python -m servetwin.core.engine.engine_proc`.

    Not multiprocessing's spawn, which re-imports the caller's `__main__` in the child: scripts without a
    main guard, `python -c`, scripts on standard input and notebooks all start it the same way. The child
    gets the parent's environment (`sitecustomize`, `PYTHON*` variables apply as in any fresh
    interpreter) and reads its arguments - the picklable `EngineArgs`, the
    socket addresses, the loop options - from its standard input; the ready message (or the start-up
    error) comes back over the output socket as before.
    """

    def __init__(self, popen: subprocess.Popen, cmd: list[str]) -> None:
        self.popen = popen
        self.cmd = cmd
        self.pid = popen.pid
        # readable once the process has exited (Linux >= 5.3); else the monitor polls
        self.sentinel: Optional[int] = None
        if hasattr(os, "pidfd_open"):
            try:
                self.sentinel = os.pidfd_open(popen.pid)
            except OSError:
                self.sentinel = None

    @classmethod
    def start(cls, payload: dict[str, Any], module: str = "servetwin.core.engine.engine_proc",
              pass_fds: tuple[int, ...] = (), extra_env: Optional[dict[str, str]] = None) -> "EngineProcess":
        """`python -m module` with `payload` pickled on its standard input and `pass_fds` kept open in it
        (the torch backend starts its tensor-parallel workers the same way: `servetwin.gpu.tp_worker`);
        `extra_env` is added to the child's environment."""
        cmd = [sys.executable, "-m", module]
        env = dict(os.environ, **(extra_env or {}))
        root = _import_root()
        if root is not None:  # servetwin found through sys.path rather than installed: the child finds it too
            env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, close_fds=True, pass_fds=pass_fds)
        try:
            pickle.dump(payload, popen.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            popen.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the child died at once: _wait_ready reports its exit code
        return cls(popen, cmd)

    @property
    def exitcode(self) -> Optional[int]:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def wait_exit(self, stop_r: int) -> bool:
        """Block until the process exits (True) or `stop_r` becomes readable (False)."""
        if self.sentinel is not None:
            ready = multiprocessing.connection.wait([self.sentinel, stop_r])
            return self.sentinel in ready
        while not multiprocessing.connection.wait([stop_r], timeout=0.02):
            if not self.is_alive():
                return True
        return False

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def close(self) -> None:
        if self.sentinel is not None:
            try:
                os.close(self.sentinel)
            except OSError:
                pass
            self.sentinel = None


def _import_root() -> Optional[str]:
    """The sys.path entry servetwin was imported from, when it is a plain `servetwin/` directory there."""
    import servetwin  # noqa: PLC0415

    pkg_dir = os.path.dirname(os.path.abspath(servetwin.__file__))
    return os.path.dirname(pkg_dir) if os.path.basename(pkg_dir) == "servetwin" else None


def _monitor(res: _Resources) -> None:
    """Wait for the engine process to exit; when nobody asked it to, declare the engine dead."""
    proc = res.proc
    if not proc.wait_exit(res.stop_r) or res.shutting_down:
        return
    proc.join(0.5)
    res.dead = True
    if res.dead_reason is None:
        res.dead_reason = f"EngineCore process {proc.pid} died unexpectedly (exit code {proc.exitcode})"
    # Wake whoever waits on the output socket: a message through the client's own socket.
    try:
        sock = res.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(res.output_addr)
        sock.send(m.encoder().encode(m.EngineDeadMsg(proc.exitcode)), zmq.NOBLOCK)
        sock.close()
    except Exception:  # noqa: BLE001 - the client may be closing concurrently
        pass


class MPClientBase(EngineCoreClient):
    """Starts the EngineCore process and owns the sockets; subclasses add sync / asyncio I/O."""

    def __init__(self, args: EngineArgs, *, pace: bool = False, time_scale: float = 1.0,
                 fake_step_time_s: Optional[float] = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 extra_env: Optional[dict[str, str]] = None) -> None:
        if time_scale is None or not time_scale > 0:
            raise ValueError(f"time_scale: must be > 0, got {time_scale!r}")
        self.args = args
        self.encoder = m.encoder()
        self.decoder = m.output_decoder()
        self._call_ids = itertools.count()
        self._sent_seq = -1  # number of the last input message sent
        self._batch: Optional[list[Any]] = None
        res = self._res = _Resources()
        self._finalizer = weakref.finalize(self, res.shutdown)
        try:
            self._start(args, pace, time_scale, fake_step_time_s, startup_timeout_s, extra_env)
        except BaseException:
            res.shutdown(timeout_s=1.0)
            raise

    # -- start-up -----------------------------------------------------------------------------------
    def _start(self, args: EngineArgs, pace: bool, time_scale: float, fake_step_time_s: Optional[float],
               startup_timeout_s: float, extra_env: Optional[dict[str, str]]) -> None:
        res = self._res
        res.tmpdir = tempfile.mkdtemp(prefix="servetwin-engine-")
        input_addr = f"ipc://{res.tmpdir}/input.sock"
        res.output_addr = f"ipc://{res.tmpdir}/output.sock"
        res.ctx = zmq.Context(io_threads=1)
        res.input_socket = res.ctx.socket(zmq.PUSH)
        res.input_socket.setsockopt(zmq.LINGER, 0)
        res.input_socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a burst of adds
        res.input_socket.bind(input_addr)
        res.output_socket = res.ctx.socket(zmq.PULL)
        res.output_socket.setsockopt(zmq.LINGER, 0)
        res.output_socket.setsockopt(zmq.RCVHWM, 0)
        res.output_socket.bind(res.output_addr)

        res.proc = EngineProcess.start(dict(args=args, input_addr=input_addr, output_addr=res.output_addr,
                                            parent_pid=os.getpid(), pace=pace, time_scale=time_scale,
                                            fake_step_time_s=fake_step_time_s), extra_env=extra_env)
        self.config = self._wait_ready(startup_timeout_s)
        # the engine keeps simulated time (sim backend, or paced): outputs carry it
        self.simulated = self.config.backend == "sim" or self.config.paced
        res.stop_r, res.stop_w = os.pipe()
        res.monitor = threading.Thread(target=_monitor, args=(res,), name="EngineCoreMonitor", daemon=True)
        res.monitor.start()

    def _wait_ready(self, timeout_s: float) -> m.EngineConfig:
        res = self._res
        deadline = time.monotonic() + timeout_s
        sock = res.output_socket
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartupError(f"EngineCore process did not become ready within {timeout_s:.0f} s "
                                         f"(backend={self.args.backend!r}, model={self.args.model!r}); "
                                         "raise SERVETWIN_ENGINE_STARTUP_TIMEOUT if loading is slow")
            if sock.poll(int(min(left, 0.2) * 1000)):
                msg = self.decoder.decode(sock.recv())
                if isinstance(msg, m.EngineConfig):
                    return msg
                if isinstance(msg, m.StartupErrorMsg):
                    res.proc.join(5.0)
                    detail = EngineStartupError(f"EngineCore process failed to start:\n{msg.traceback}")
                    if msg.exc_type == "ValueError":
                        raise ValueError(msg.message) from detail
                    if msg.exc_type == "FileNotFoundError":  # e.g. an unknown model name or path
                        raise FileNotFoundError(msg.message) from detail
                    raise EngineStartupError(f"EngineCore process failed to start: {msg.exc_type}: "
                                             f"{msg.message}\n{msg.traceback}")
                continue
            if not res.proc.is_alive():
                raise EngineStartupError(
                    f"EngineCore process exited with code {res.proc.exitcode} before it was ready (see its "
                    f"output above; command: {' '.join(res.proc.cmd)})")

    # -- common ---------------------------------------------------------------------------------------
    @property
    def engine_pid(self) -> Optional[int]:
        proc = self._res.proc
        return None if proc is None else proc.pid

    @property
    def is_dead(self) -> bool:
        return self._res.dead

    @property
    def dead_reason(self) -> str:
        return self._res.dead_reason or "EngineCore process is dead"

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(self._res.dead_reason or "EngineCore process is dead")

    def _check_alive(self) -> None:
        if self._res.dead:
            raise self._dead_error()
        if self._res.closed:
            raise EngineDeadError("the engine-core client was shut down")

    def _send(self, msg: Any) -> None:
        self._check_alive()
        if self._batch is not None and isinstance(msg, (m.AddRequestMsg, m.AbortMsg)):
            self._batch.append(msg)
            return
        self._res.input_socket.send(self.encoder.encode(msg), copy=False)
        self._sent_seq += 1

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Send the adds / aborts made inside the block as one message (nesting joins the outer batch)."""
        if self._batch is not None:
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            msgs, self._batch = self._batch, None
            if msgs and not self._res.dead and not self._res.closed:
                self._send(msgs[0] if len(msgs) == 1 else m.BatchMsg(msgs))

    def _on_engine_error(self, msg: Any) -> None:
        res = self._res
        res.dead = True
        res.dead_reason = f"EngineCore process failed: {msg.exc_type}: {msg.message}\n{msg.traceback}"

    def validate_params(self, params: SamplingParams) -> None:
        m.check_transferable(params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, parent_id: Optional[str] = None) -> None:
        self._send(m.AddRequestMsg(request_id, list(prompt_token_ids), m.encode_params(params), arrival_time,
                                   priority, cache_salt, parent_id))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self._res.dead and not self._res.closed:
            self._send(m.AbortMsg(list(request_ids)))

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClientBase):
    """Blocking client for the offline `LLM`: outputs are read in the caller's thread."""

    def __init__(self, args: EngineArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        self._pending: deque[tuple[list[EngineCoreOutput], float]] = deque()  # (outputs, sim_time_s)
        self.sim_arrivals: dict[str, float] = {}
        self._utility_results: dict[int, Any] = {}
        self._errors: list[m.RequestErrorMsg] = []  # requests the engine refused, raised by get_output
        self._idle_seq = -1
        self.last_stats: Optional[m.EngineStats] = None

    def _recv_one(self) -> Any:
        """Block until one message arrives (or the engine is dead)."""
        sock = self._res.output_socket
        while True:
            self._check_alive()
            if sock.poll(POLL_SLICE_MS):
                msg = self.decoder.decode(sock.recv())
                if isinstance(msg, m.EngineDeadMsg):
                    raise self._dead_error()
                if isinstance(msg, m.EngineErrorMsg):
                    self._on_engine_error(msg)
                    raise self._dead_error()
                return msg

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, m.OutputsMsg):
            if msg.stats is not None:
                self.last_stats = msg.stats
            if msg.idle_seq >= 0:
                self._idle_seq = msg.idle_seq
            if msg.sim_arrivals:
                self.sim_arrivals.update(msg.sim_arrivals)
            if msg.outputs:
                self._pending.append((msg.outputs, msg.sim_time_s))
            if msg.errors:
                self._errors.extend(msg.errors)
        elif isinstance(msg, m.UtilityResultMsg):
            self._utility_results[msg.call_id] = msg

    @property
    def output_socket(self) -> Any:
        """The socket the engine's messages arrive on (a data-parallel front end polls several)."""
        return self._res.output_socket

    def receive(self) -> Any:
        """Block until one message arrives, take it in (outputs, stats, results) and return it."""
        msg = self._recv_one()
        self._dispatch(msg)
        return msg

    def take_output(self) -> Optional[tuple[list[EngineCoreOutput], float]]:
        """The oldest received outputs not yet taken, with their simulated time, or None."""
        return self._pending.popleft() if self._pending else None

    def get_output(self) -> list[EngineCoreOutput]:
        """The next batch of outputs; [] once the engine has no work for anything sent so far."""
        while not self._pending:
            self.raise_request_error()
            if self._idle_seq >= self._sent_seq:
                return []
            self._dispatch(self._recv_one())
        outputs, sim_time_s = self._pending.popleft()
        if self.simulated:
            self.last_sim_time_s = sim_time_s
        return outputs

    def raise_request_error(self) -> None:
        """Raise the oldest request refusal the engine sent (an `EngineRequestError`), if any."""
        if self._errors:
            err = self._errors.pop(0)
            raise EngineRequestError(err.request_id, err.message)

    def has_work(self) -> bool:
        return bool(self._pending) or self._idle_seq < self._sent_seq

    def utility(self, name: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._send(m.UtilityMsg(call_id, name, list(args)))
        while call_id not in self._utility_results:
            self._dispatch(self._recv_one())
        res = self._utility_results.pop(call_id)
        if res.error is not None:
            raise (ValueError if res.exc_type == "ValueError" else RuntimeError)(res.error)
        return res.result


class AsyncMPClient(MPClientBase):
    """asyncio client for `AsyncLLM`: a reader task feeds an asyncio queue and utility futures.

    The constructor blocks until the engine is ready (run it in a thread from a running loop);
    the asyncio side is attached lazily on the loop that first uses it.
    """

    def __init__(self, args: EngineArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._queue: Optional[asyncio.Queue] = None
        self._reader: Optional[asyncio.Task] = None
        self._futures: dict[int, asyncio.Future] = {}
        self.sim_arrivals: dict[str, float] = {}
        self.last_stats: Optional[m.EngineStats] = None

    def _attach(self) -> None:
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._asock = zmq.asyncio.Socket.from_socket(self._res.output_socket)
        self._reader = self._loop.create_task(self._read_loop(), name="EngineCoreOutputReader")

    async def _read_loop(self) -> None:
        sock = self._asock
        decoder = self.decoder
        try:
            while True:
                msg = decoder.decode(await sock.recv())
                if isinstance(msg, m.OutputsMsg):
                    if msg.stats is not None:
                        self.last_stats = msg.stats
                    self._queue.put_nowait(msg)
                elif isinstance(msg, m.UtilityResultMsg):
                    fut = self._futures.pop(msg.call_id, None)
                    if fut is not None and not fut.done():
                        if msg.error is not None:
                            exc = ValueError if msg.exc_type == "ValueError" else RuntimeError
                            fut.set_exception(exc(msg.error))
                        else:
                            fut.set_result(msg.result)
                elif isinstance(msg, (m.EngineDeadMsg, m.EngineErrorMsg)):
                    if isinstance(msg, m.EngineErrorMsg):
                        self._on_engine_error(msg)
                    self._res.dead = True
                    self._fail_all(self._dead_error())
                    return
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:  # socket closed under us (shutdown)
            self._fail_all(EngineDeadError(f"engine-core client closed ({e})"))
        except Exception as e:  # noqa: BLE001
            self._fail_all(EngineDeadError(f"engine-core output reader failed: {type(e).__name__}: {e}"))

    def _fail_all(self, exc: BaseException) -> None:
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(exc)
        self._futures.clear()
        if self._queue is not None:
            self._queue.put_nowait(exc)

    async def get_output_async(self) -> m.OutputsMsg:
        """The next outputs message from the engine (outputs, stats, request errors)."""
        self._attach()
        self._check_alive_async()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # every later call fails the same way
            raise item
        return item

    def _check_alive_async(self) -> None:
        if self._res.dead and (self._queue is None or self._queue.empty()):
            raise self._dead_error()

    async def add_request_async(self, *args: Any, **kwargs: Any) -> None:
        self.add_request(*args, **kwargs)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def call_utility_async(self, name: str, *args: Any) -> Any:
        self._attach()
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._futures[call_id] = fut
        try:
            self._send(m.UtilityMsg(call_id, name, list(args)))
        except BaseException:
            self._futures.pop(call_id, None)
            raise
        return await fut

    def shutdown(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.cancel()
        super().shutdown()


__all__ = ["SyncMPClient", "AsyncMPClient", "MPClientBase", "EngineStartupError", "EngineRequestError",
           "EngineDeadError"]
