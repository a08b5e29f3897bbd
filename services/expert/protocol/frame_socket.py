"""A connected TCP socket carrying frames (frames.py): whole reads, gathered writes, and a write
that keeps reading while the peer's receive window is full.

The socket transport's attention side may send a second request (ping-pong micro-batches) while
the expert side is still writing the first reply. If both sides only wrote, a reply larger than
the kernel's buffers would block each of them on the other; so the expert side writes with
`send(drain=True)`: whenever the socket cannot take more, it reads what the peer sent into a
read-ahead buffer, which the next `read_exact` consumes first.

While a read busy-polls, `keep_warm` (when set) runs every `WARM_INTERVAL_S`, or less often when it
takes more than a tenth of that (at most ~10% of the polling core): the owner rehearses the work
around the frame it waits for (the last reply's decoding and the planning and encoding of the next
request on the attention side; parsing and checking the last request on the expert side). On a
shared CPU the caches of a waiting core go cold within milliseconds, and that work, done for real
when the frame comes, then runs several times slower (2-vCPU guest, 32 tokens, 2 MoE layers: the
attention side's dispatch CPU ~1.0-1.2 -> ~0.5-0.7 ms a step, the expert side's checks ~100 ->
~40 us a layer). A rehearsal must have no effects; one that raises is logged and not run again on that connection
(a rehearsal never fails a real read).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

WARM_INTERVAL_S = 0.0005  # how often a polling read runs keep_warm (at the most)
WARM_DUTY = 0.1  # the largest share of a polling core keep_warm takes


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
        self.keep_warm: Callable[[], None] | None = None  # rehearsal run while a read polls
        self._warm_failed = False  # a rehearsal raised: no more on this connection
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
        now = time.perf_counter()
        deadline, warm_at = now + self.busy_poll_s, now + WARM_INTERVAL_S
        try:
            while got < size:
                try:
                    n = self.sock.recv_into(view[got:], size - got)
                except BlockingIOError:
                    now = time.perf_counter()
                    if now > deadline:
                        break
                    if self.keep_warm is not None and now > warm_at and not self._warm_failed:
                        try:
                            self.keep_warm()
                        except Exception:
                            log.exception("a rehearsal while polling failed; this connection stops rehearsing")
                            self._warm_failed = True
                        done = time.perf_counter()
                        warm_at = done + max(WARM_INTERVAL_S, (done - now) / WARM_DUTY)
                    else:
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
