"""`MessageQueue`: one writer, N readers, over a shared-memory ring buffer (vLLM 0.33's
`vllm/distributed/device_communicators/shm_broadcast.py`, `ShmRingBuffer` + `MessageQueue`).

The executor broadcasts each `SchedulerOutput` to its workers through one queue: the object is pickled
once, written once into shared memory, and every reader copies it out, instead of one pickle and one
pipe write per rank. Rank 0 answers through a second queue with one reader (the executor).

Layout (as vLLM's): `max_chunks` data chunks of `max_chunk_bytes`, then per chunk `1 + n_reader` flag
bytes: the written flag, then one read flag per reader. A chunk can be written when it is not written
or every reader has read it; the writer clears the written flag, writes the data, clears the read
flags and only then sets the written flag (in that order, so a reader never sees a half-reset chunk).
A reader waits for the written flag with its own read flag clear, copies the data out and sets its
read flag. Where vLLM sends a message larger than one chunk over a ZMQ socket, here it continues in
the next chunks: each chunk starts with the message's total length (4 bytes), so a reader knows how
many chunks to take (the writer fills them in ring order and readers free them as they go).

Waiting (vLLM's `SpinCondition`: busy readers spin, idle ones block until the writer pings them over
a ZMQ socket): while steps flow a reader polls the flags with `sched_yield` spins, then sleeps that grow
to `MAX_SLEEP_S`; once it has waited `IDLE_AFTER_S` it blocks in `select` on its own named pipe (a FIFO
in a temporary directory the handle names), into which the writer writes one byte after every chunk.
So an idle worker or engine wakes at once when work comes (it slept 10 ms between polls before) and
costs no CPU. Blocking from the start of every wait was measured slower on the 2-core machine (tiny-llama
TP=2 runs ~20% longer, under load; likely as a woken reader preempts the writer before it has
notified the next rank: docs/parallelism.md), as was vLLM's 1 s of `sched_yield` spinning (the engine's spin took CPU from the
ranks). A notification is never lost: the reader drains its pipe before it checks the flags, so a
byte written after the check is still there when it blocks. `should_stop()`, called while waiting
(while blocked, every `STOP_POLL_S`), lets a caller end a wait whose peer died (`QueueClosed`);
`wake_reader()` makes this process's blocked reader check it at once.
"""
from __future__ import annotations

import os
import pickle
import select
import shutil
import tempfile
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Callable, Optional

_LEN = 4  # bytes of the total-length prefix of every chunk
STOP_POLL_S = 0.05  # a blocked wait checks `should_stop()` (and its timeout) at least this often
SPIN_ITERATIONS = 200  # the back-off: sched_yield this often, then growing sleeps
MAX_SLEEP_S = 0.001
IDLE_SLEEP_S = 0.01
IDLE_AFTER_S = 1.0  # a reader waiting this long blocks on its pipe; the writer sleeps IDLE_SLEEP_S


_CREATED_HERE: set[str] = set()  # segments this process created (and its resource tracker owns)


class QueueClosed(RuntimeError):
    """A wait on the queue ended because `should_stop()` said so (the peer is gone)."""


@dataclass(frozen=True, slots=True)
class QueueHandle:
    """What another process needs to attach to a queue (picklable)."""
    name: str
    n_reader: int
    max_chunk_bytes: int
    max_chunks: int
    notify_dir: str  # reader r's pipe is `<notify_dir>/r<r>`


def _open_pipe(handle: QueueHandle, reader_rank: int) -> int:
    """Reader `reader_rank`'s named pipe, opened read-write and non-blocking: the open never waits for
    the other end, and neither side sees EOF while the other is gone (Linux and macOS allow O_RDWR on a
    FIFO)."""
    return os.open(os.path.join(handle.notify_dir, f"r{reader_rank}"), os.O_RDWR | os.O_NONBLOCK)


class _Backoff:
    """sched_yield for the first `SPIN_ITERATIONS` polls, then sleeps that grow to `MAX_SLEEP_S`
    (`IDLE_SLEEP_S` after `IDLE_AFTER_S` of waiting)."""

    def __init__(self) -> None:
        self.n = 0
        self.t0 = time.monotonic()
        self.sleep = 1e-5

    def wait(self) -> None:
        self.n += 1
        if self.n <= SPIN_ITERATIONS:
            os.sched_yield()
            return
        idle = time.monotonic() - self.t0 > IDLE_AFTER_S
        time.sleep(IDLE_SLEEP_S if idle else self.sleep)
        self.sleep = min(self.sleep * 2, MAX_SLEEP_S)


class MessageQueue:
    """One writer (`enqueue`) and `n_reader` readers (`dequeue`, each with its `reader_rank`)."""

    def __init__(self, handle: QueueHandle, shm: shared_memory.SharedMemory, reader_rank: Optional[int],
                 creator: bool) -> None:
        self.handle = handle
        self.shm = shm
        self.reader_rank = reader_rank  # None: the writer
        self.creator = creator
        self.meta_size = 1 + handle.n_reader
        self.meta_offset = handle.max_chunk_bytes * handle.max_chunks
        self.payload_bytes = handle.max_chunk_bytes - _LEN
        self.current = 0
        # the writer holds every reader's pipe (it notifies them), a reader its own (it waits on it)
        ranks = range(handle.n_reader) if reader_rank is None else [reader_rank]
        self.pipes = [_open_pipe(handle, r) for r in ranks]

    @classmethod
    def create(cls, n_reader: int, max_chunk_bytes: int = 1 << 20, max_chunks: int = 8,
               reader_rank: Optional[int] = None) -> "MessageQueue":
        """A new queue; this process is its writer (or, with `reader_rank`, that reader)."""
        if n_reader < 1 or max_chunk_bytes <= _LEN or max_chunks < 1:
            raise ValueError(f"MessageQueue: n_reader {n_reader}, max_chunk_bytes {max_chunk_bytes}, "
                             f"max_chunks {max_chunks}")
        size = (max_chunk_bytes + 1 + n_reader) * max_chunks
        notify_dir = tempfile.mkdtemp(prefix="servetwin-mq-")
        try:
            for r in range(n_reader):
                os.mkfifo(os.path.join(notify_dir, f"r{r}"), 0o600)
            shm = shared_memory.SharedMemory(create=True, size=size)
        except BaseException:
            shutil.rmtree(notify_dir, ignore_errors=True)
            raise
        _CREATED_HERE.add(shm.name)
        shm.buf[max_chunk_bytes * max_chunks:size] = bytes((1 + n_reader) * max_chunks)  # every flag 0
        handle = QueueHandle(shm.name, n_reader, max_chunk_bytes, max_chunks, notify_dir)
        return cls(handle, shm, reader_rank, True)

    @classmethod
    def attach(cls, handle: QueueHandle, reader_rank: Optional[int]) -> "MessageQueue":
        """Open a queue made by another process, as reader `reader_rank` (None: as its writer)."""
        if reader_rank is not None and not 0 <= reader_rank < handle.n_reader:
            raise ValueError(f"MessageQueue: reader rank {reader_rank} of {handle.n_reader}")
        shm = shared_memory.SharedMemory(name=handle.name)
        if os.name == "posix" and handle.name not in _CREATED_HERE:
            # attaching registers the segment with this process's resource tracker, which would unlink
            # it when this process exits (bpo-38119; Python 3.13's `track=False`): only the creator owns it
            resource_tracker.unregister("/" + shm.name, "shared_memory")
        return cls(handle, shm, reader_rank, False)

    def close(self) -> None:
        """Detach; the creator also removes the shared memory and the pipes."""
        for fd in self.pipes:
            os.close(fd)
        self.pipes = []
        try:
            self.shm.close()
        except BufferError:  # a view still alive somewhere; the mapping goes with the process
            pass
        if self.creator:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
            shutil.rmtree(self.handle.notify_dir, ignore_errors=True)

    # -- notification -----------------------------------------------------------------------------
    def _notify_readers(self) -> None:
        """One byte into every reader's pipe (a full pipe already holds a wake-up: nothing to add)."""
        for fd in self.pipes:
            try:
                os.write(fd, b"\0")
            except BlockingIOError:
                pass

    def wake_reader(self) -> None:
        """Wake this process's reader blocked in `dequeue`, so it checks `should_stop()` now (vLLM's
        `SpinCondition.cancel`; the executor calls it from its worker monitor)."""
        assert self.reader_rank is not None, "only a reader is woken"
        self._notify_readers()

    def _drain(self) -> None:
        try:
            while len(os.read(self.pipes[0], 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def _block(self, seconds: Optional[float]) -> None:
        """Wait for a notification on this reader's pipe, at most `seconds` (None: until one comes)."""
        try:
            select.select(self.pipes, [], [], seconds)
        except InterruptedError:  # a signal: the caller checks the flags again
            pass

    # -- flags ------------------------------------------------------------------------------------
    def _meta(self, idx: int) -> int:
        return self.meta_offset + idx * self.meta_size

    def _data(self, idx: int) -> int:
        return idx * self.handle.max_chunk_bytes

    def _writable(self, idx: int) -> bool:
        m, buf = self._meta(idx), self.shm.buf
        return not buf[m] or all(buf[m + 1:m + self.meta_size])

    def _readable(self, idx: int) -> bool:
        m, buf = self._meta(idx), self.shm.buf
        return bool(buf[m]) and not buf[m + 1 + self.reader_rank]

    def _wait(self, ready: Callable[[], bool], should_stop: Optional[Callable[[], bool]],
              timeout: Optional[float]) -> None:
        """The writer's wait for a chunk the readers have freed: spin, then sleep (`_Backoff`)."""
        backoff = _Backoff()
        while not ready():
            if should_stop is not None and backoff.n % 16 == 0 and should_stop():
                raise QueueClosed("message queue: the other side stopped")
            if timeout is not None and time.monotonic() - backoff.t0 > timeout:
                raise TimeoutError(f"message queue: nothing after {timeout} s")
            backoff.wait()

    def _wait_readable(self, idx: int, should_stop: Optional[Callable[[], bool]],
                       timeout: Optional[float]) -> None:
        """A reader's wait for chunk `idx`: the writer's back-off while steps flow (sched_yield spins, then
        sleeps growing to `MAX_SLEEP_S`), and once idle for `IDLE_AFTER_S` it blocks on its pipe until the
        writer notifies it (vLLM's `SpinCondition.wait`: busy readers spin, idle ones wait for a ping)."""
        backoff = _Backoff()
        while True:
            if self._readable(idx):
                return
            if should_stop is not None and backoff.n % 16 == 0 and should_stop():
                raise QueueClosed("message queue: the other side stopped")
            waited = time.monotonic() - backoff.t0
            if timeout is not None and waited >= timeout:
                raise TimeoutError(f"message queue: nothing after {timeout} s")
            if waited < IDLE_AFTER_S:
                backoff.wait()
                continue
            self._drain()  # before the check: a notification after it stays in the pipe
            if self._readable(idx):
                return
            if should_stop is not None and should_stop():
                raise QueueClosed("message queue: the other side stopped")
            left = STOP_POLL_S if should_stop is not None else None
            if timeout is not None:
                left = min(left if left is not None else timeout, max(0.0, timeout - waited))
            self._block(left)

    # -- messages ---------------------------------------------------------------------------------
    def enqueue(self, obj: Any, should_stop: Optional[Callable[[], bool]] = None,
                timeout: Optional[float] = None) -> None:
        """Pickle `obj` once and write it into as many chunks as it needs."""
        assert self.reader_rank is None, "only the writer enqueues"
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        total, sent, buf = len(data), 0, self.shm.buf
        header = total.to_bytes(_LEN, "little")
        while True:
            idx = self.current
            self._wait(lambda: self._writable(idx), should_stop, timeout)
            m, d = self._meta(idx), self._data(idx)
            buf[m] = 0  # not written: no reader takes it while it changes
            part = data[sent:sent + self.payload_bytes]
            buf[d:d + _LEN] = header
            buf[d + _LEN:d + _LEN + len(part)] = part
            buf[m + 1:m + self.meta_size] = bytes(self.handle.n_reader)  # read flags first ...
            buf[m] = 1  # ... then written
            self._notify_readers()
            self.current = (idx + 1) % self.handle.max_chunks
            sent += len(part)
            if sent >= total:
                return

    def dequeue(self, should_stop: Optional[Callable[[], bool]] = None, timeout: Optional[float] = None) -> Any:
        """The next message (blocks; `should_stop()` true while waiting raises `QueueClosed`)."""
        assert self.reader_rank is not None, "only a reader dequeues"
        parts: list[bytes] = []
        got, total, buf = 0, None, self.shm.buf
        while total is None or got < total:
            idx = self.current
            self._wait_readable(idx, should_stop, timeout)
            d = self._data(idx)
            if total is None:
                total = int.from_bytes(buf[d:d + _LEN], "little")
            n = min(self.payload_bytes, total - got)
            parts.append(bytes(buf[d + _LEN:d + _LEN + n]))
            got += n
            buf[self._meta(idx) + 1 + self.reader_rank] = 1
            self.current = (idx + 1) % self.handle.max_chunks
        return pickle.loads(b"".join(parts))
