"""The shared-memory broadcast queue (`servetwin.gpu.shm_broadcast.MessageQueue`, after vLLM's
shm_broadcast.py): every reader gets every message, in order, including messages that span several
chunks and more messages than the ring holds; a wait whose peer is gone ends with `QueueClosed`."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from servetwin.gpu import shm_broadcast
from servetwin.gpu.shm_broadcast import MessageQueue, QueueClosed


def _read_all(handle, rank: int, n: int, out: dict) -> None:
    q = MessageQueue.attach(handle, reader_rank=rank)
    out[rank] = [q.dequeue(timeout=30) for _ in range(n)]
    q.close()


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=30), n_reader=st.integers(1, 3))
def test_every_reader_gets_every_message_in_order(sizes, n_reader):
    # 4 chunks of 256 bytes: most messages span several chunks and the ring wraps many times
    q = MessageQueue.create(n_reader=n_reader, max_chunk_bytes=256, max_chunks=4)
    msgs = [(i, bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    got: dict[int, list] = {}
    readers = [threading.Thread(target=_read_all, args=(q.handle, r, len(msgs), got)) for r in range(n_reader)]
    try:
        for t in readers:
            t.start()
        for m in msgs:
            q.enqueue(m, timeout=30)
        for t in readers:
            t.join(60)
        assert got == {r: msgs for r in range(n_reader)}
    finally:
        q.close()


def test_a_wait_ends_when_the_peer_is_gone():
    q = MessageQueue.create(n_reader=1, max_chunk_bytes=64, max_chunks=2, reader_rank=0)
    try:
        with pytest.raises(QueueClosed):
            q.dequeue(should_stop=lambda: True)
        with pytest.raises(TimeoutError):
            q.dequeue(timeout=0.05)
    finally:
        q.close()


def test_a_full_ring_blocks_the_writer_until_readers_free_it():
    q = MessageQueue.create(n_reader=2, max_chunk_bytes=64, max_chunks=2)
    r0 = MessageQueue.attach(q.handle, reader_rank=0)
    try:
        q.enqueue("a")
        q.enqueue("b")
        with pytest.raises(TimeoutError):  # both chunks wait for reader 1
            q.enqueue("c", timeout=0.05)
        assert r0.dequeue() == "a"
        with pytest.raises(TimeoutError):  # reader 0 alone does not free a chunk
            q.enqueue("c", timeout=0.05)
    finally:
        r0.close()
        q.close()


def _blocked_reader(q: MessageQueue, out: dict, **kw) -> threading.Thread:
    def read() -> None:
        try:
            out["msg"] = q.dequeue(**kw)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
    t = threading.Thread(target=read)
    t.start()
    return t


def test_a_blocked_reader_wakes_on_the_writers_notification(monkeypatch):
    # idle at once, no should_stop and no timeout: the reader blocks on its pipe with no poll at all, so
    # only the writer's notification can wake it (a lost one would hang the join below)
    monkeypatch.setattr(shm_broadcast, "IDLE_AFTER_S", 0.0)
    q = MessageQueue.create(n_reader=2, max_chunk_bytes=64, max_chunks=2)
    readers = [MessageQueue.attach(q.handle, reader_rank=r) for r in range(2)]
    out: list[dict] = [{}, {}]
    try:
        for i in range(20):  # the ring wraps; each message finds the readers blocked or about to block
            threads = [_blocked_reader(r, o) for r, o in zip(readers, out)]
            q.enqueue(("step", i))
            for t in threads:
                t.join(10)
                assert not t.is_alive()
            assert [o["msg"] for o in out] == [("step", i)] * 2
    finally:
        for r in readers:
            r.close()
        q.close()


def test_wake_reader_ends_a_blocked_wait_at_once(monkeypatch):
    # idle at once, should_stop polled every STOP_POLL_S: made an hour, only the wake ends the wait in time
    monkeypatch.setattr(shm_broadcast, "IDLE_AFTER_S", 0.0)
    monkeypatch.setattr(shm_broadcast, "STOP_POLL_S", 3600.0)
    q = MessageQueue.create(n_reader=1, max_chunk_bytes=64, max_chunks=2, reader_rank=0)
    stop = threading.Event()
    out: dict = {}
    try:
        t = _blocked_reader(q, out, should_stop=stop.is_set)
        time.sleep(0.05)  # let it block (if it has not yet, it sees the stop at its first check)
        stop.set()
        q.wake_reader()
        t.join(10)
        assert isinstance(out.get("error"), QueueClosed)
    finally:
        q.close()


def test_the_creator_removes_the_notification_pipes():
    q = MessageQueue.create(n_reader=2, max_chunk_bytes=64, max_chunks=2)
    r = MessageQueue.attach(q.handle, reader_rank=1)
    notify_dir = Path(q.handle.notify_dir)
    assert sorted(p.name for p in notify_dir.iterdir()) == ["r0", "r1"]
    r.close()
    assert notify_dir.exists()  # a reader's close leaves them to the creator
    q.close()
    assert not notify_dir.exists()
