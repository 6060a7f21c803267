"""Length-prefixed messages over an OS pipe between forked processes (a reader never waits for EOF: other
forked children may hold the pipe's ends too)."""
from __future__ import annotations

import os
from typing import Optional

ONE_WRITE = 32 << 10  # a message this small goes in one write (the pipe holds it whole: 64 KiB)


def send_message(fd: int, data: bytes) -> None:
    """`data` with its 8-byte length first; a large one written from a view of it (no copy)."""
    head = len(data).to_bytes(8, "little")
    if len(data) <= ONE_WRITE:
        view = memoryview(head + data)
    else:
        os.write(fd, head)
        view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def recv_message(fd: int) -> Optional[bytearray]:
    """One message, or None when the other end closed first (read into one buffer: no second copy)."""
    def exactly(n: int) -> Optional[bytearray]:
        buf = bytearray(n)
        view = memoryview(buf)
        while view:
            got = os.readv(fd, [view[:1 << 20]])
            if not got:
                return None
            view = view[got:]
        return buf

    head = exactly(8)
    if head is None:
        return None
    return exactly(int.from_bytes(head, "little"))


__all__ = ["send_message", "recv_message", "ONE_WRITE"]
