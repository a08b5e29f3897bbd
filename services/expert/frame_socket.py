"""A connected TCP socket carrying frames (frames.py): whole reads, gathered writes, and a write
that keeps reading while the peer's receive window is full.

The socket transport's attention side may send a second request (ping-pong micro-batches) while
the expert side is still writing the first reply. If both sides only wrote, a reply larger than
the kernel's buffers would block each of them on the other; so the expert side writes with
`send(drain=True)`: whenever the socket cannot take more, it reads what the peer sent into a
read-ahead buffer, which the next `read_exact` consumes first.
"""

from __future__ import annotations

import os
import select
import socket
import time


def _bytes_views(buffers) -> list[memoryview]:
    views = [memoryview(b).cast("B") for b in buffers]
    return [v for v in views if v.nbytes]


def _advance(views: list[memoryview], sent: int) -> list[memoryview]:
    while views and sent >= views[0].nbytes:
        sent -= views[0].nbytes
        views = views[1:]
    if views and sent:
        views = [views[0][sent:], *views[1:]]
    return views


class FrameSocket:
    def __init__(self, sock: socket.socket, busy_poll_s: float = 0.0):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.busy_poll_s = busy_poll_s  # a read polls (busy) this long before it blocks
        self._ahead = bytearray()  # bytes read while a drained send waited

    def read_exact(self, size: int) -> bytearray:
        """Exactly `size` bytes; ConnectionError when the peer closed, TimeoutError (socket.timeout)
        after the socket's timeout."""
        out = bytearray(size)
        view = memoryview(out)
        got = min(size, len(self._ahead))
        if got:
            view[:got] = self._ahead[:got]
            del self._ahead[:got]
        if got < size and self.busy_poll_s > 0:
            got = self._poll_into(view, got, size)
        while got < size:
            n = self.sock.recv_into(view[got:], size - got)
            if n == 0:
                raise ConnectionError("the peer closed the connection")
            got += n
        return out

    def _poll_into(self, view: memoryview, got: int, size: int) -> int:
        """Non-blocking reads into `view[got:size]`, yielding the CPU between them, until it is
        full or `busy_poll_s` passed; returns how much is in."""
        timeout = self.sock.gettimeout()
        self.sock.settimeout(0.0)
        deadline = time.perf_counter() + self.busy_poll_s
        try:
            while got < size:
                try:
                    n = self.sock.recv_into(view[got:], size - got)
                except BlockingIOError:
                    if time.perf_counter() > deadline:
                        break
                    os.sched_yield()
                    continue
                if n == 0:
                    raise ConnectionError("the peer closed the connection")
                got += n
        finally:
            self.sock.settimeout(timeout)
        return got

    def send(self, buffers, drain: bool = False) -> None:
        views = _bytes_views(buffers)
        flags = socket.MSG_DONTWAIT if drain else 0
        while views:
            try:
                sent = self.sock.sendmsg(views, [], flags)
            except BlockingIOError:
                sent = 0
            views = _advance(views, sent)
            if views and drain:
                readable, _, _ = select.select([self.sock], [self.sock], [])
                if readable:
                    try:
                        chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        raise ConnectionError("the peer closed the connection")
                    self._ahead += chunk

    def stop_reading(self) -> None:
        """A blocked or later read sees the end of the stream; writes still go out."""
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
