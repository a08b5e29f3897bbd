"""The expert worker's side of the socket transport: one TCP listener, one serving thread per
attention worker's connection, raw frames (frames.py) both ways.

Callers: `ExpertServicer.OpenDataPlane` (backend "socket") calls `open(session)` on a worker
thread; it starts the listener on first use (`--data-port`, 0 = ephemeral) and returns its port.
The attention worker then connects and sends HELLO with that session: a connection naming no
session opened through the RPC is closed, so every connection is tied to a gRPC handshake (which
fails fast on a stopping worker). The serving thread loops: read a request frame, `answer` it
(the servicer's `answer_blocking(request, deliver)`: check and compute on this thread, write the
reply through `deliver` (draining, frame_socket.py), then count its tokens while it travels;
CallError for a refused request, answered with its status). While it polls for the next request
it keeps that path warm by rehearsing the last one (`rehearse`: the servicer's checks, nothing
computed or counted; frame_socket.py's keep_warm). A frame
that does not parse closes the connection (the stream cannot be resynchronised); the peer's next
call opens a new one. `close()` (worker shutdown) closes the listener and stops reading on every
connection: a request being computed is still answered, then the connection closes, so attention
workers fail over at once instead of at their timeout.
"""

from __future__ import annotations

import functools
import logging
import socket
import struct
import threading
from collections.abc import Callable

import grpc

from moemesh.expert.protocol.call import CallError, ExpertReply, ExpertRequest
from moemesh.expert.protocol.frame_socket import FrameSocket
from moemesh.expert.protocol.frames import (
    HELLO,
    HELLO_MAGIC,
    MAX_SESSION_BYTES,
    REQUEST,
    FrameError,
    decode_request,
    encode_error,
    encode_reply,
    parse_request_header,
)

logger = logging.getLogger(__name__)

MAX_UNCLAIMED_SESSIONS = 1024  # sessions opened by RPC whose connection never came


class SocketDataPlane:
    def __init__(
        self,
        host: str,
        port: int,
        worker_id: str,
        answer: Callable[..., ExpertReply],
        busy_poll_s: float = 0.0,
        rehearse: Callable[[ExpertRequest], object] | None = None,
    ):
        """`host`/`port`: where the listener binds (port 0: an ephemeral one); `busy_poll_s`: how
        long a serving thread's wait for the next request polls before it blocks; `rehearse`: a
        request's checks without effects (CallError when it would be refused), run on the last
        request while polling."""
        self.host, self.port, self.worker_id, self._answer = host, port, worker_id, answer
        self._rehearse = rehearse
        self.busy_poll_s = busy_poll_s
        self._listener: socket.socket | None = None
        self._unclaimed: dict[str, None] = {}  # sessions opened, not yet connected (oldest first)
        self._connections: set[FrameSocket] = set()
        self._lock = threading.Lock()
        self._closed = False

    def open(self, session: str, backend: str = "socket") -> int:
        """Expect a connection for `session`; returns the listener's port. ValueError for a bad request."""
        if backend != "socket":
            raise ValueError(f"the socket data plane serves backend 'socket', not {backend!r}")
        if not session or len(session.encode()) > MAX_SESSION_BYTES:
            raise ValueError(f"OpenDataPlane needs a session name of 1 to {MAX_SESSION_BYTES} bytes")
        with self._lock:
            if self._closed:
                raise ValueError(f"expert worker {self.worker_id} is stopping")
            if session in self._unclaimed:
                raise ValueError(f"session {session!r} is already open")
            if self._listener is None:
                self._listener = socket.create_server((self.host, self.port), backlog=64)
                threading.Thread(
                    target=self._accept, args=(self._listener,), name="moemesh-socket-accept", daemon=True
                ).start()
            self._unclaimed[session] = None
            while len(self._unclaimed) > MAX_UNCLAIMED_SESSIONS:
                del self._unclaimed[next(iter(self._unclaimed))]
            return self._listener.getsockname()[1]

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, peer = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(
                target=self._serve,
                args=(FrameSocket(sock, self.busy_poll_s), peer),
                name="moemesh-socket-serve",
                daemon=True,
            ).start()

    def _claim(self, connection: FrameSocket) -> str | None:
        magic, size = HELLO.unpack(connection.read_exact(HELLO.size))
        if magic != HELLO_MAGIC or not 0 < size <= MAX_SESSION_BYTES:
            return None
        session = connection.read_exact(size).decode(errors="replace")
        with self._lock:
            if self._closed or session not in self._unclaimed:
                return None
            del self._unclaimed[session]
            self._connections.add(connection)
        return session

    def _serve(self, connection: FrameSocket, peer) -> None:
        session = None
        try:
            connection.sock.settimeout(30.0)  # the hello comes right after connecting
            session = self._claim(connection)
            if session is None:
                logger.warning("socket data plane: a connection from %s named no open session; closed", peer)
                return
            connection.sock.settimeout(None)  # then requests come as long as the peer lives
            logger.info("socket data plane session %s open (%s)", session[:8], peer[0])
            while True:
                head = connection.read_exact(REQUEST.size)
                header = parse_request_header(head)
                payload = connection.read_exact(header.payload_bytes)
                self._respond(connection, header.sequence_id, decode_request(header, payload))
                if self._rehearse is not None and connection.busy_poll_s > 0:
                    connection.keep_warm = functools.partial(self._rehearse_frame, head, payload)
        except FrameError as e:
            logger.warning("socket data plane session %s: %s; closed", (session or "?")[:8], e)
        except (ConnectionError, OSError, struct.error) as e:  # the peer went away (or we closed)
            logger.info("socket data plane session %s closed: %s", (session or "?")[:8], e)
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def _rehearse_frame(self, head: bytearray, payload: bytearray) -> None:
        """The path from a request frame's bytes to its checked call, on an answered frame."""
        try:
            self._rehearse(decode_request(parse_request_header(head), payload))
        except CallError:  # refused now (its placement went): its checks ran all the same
            pass

    def _respond(self, connection: FrameSocket, sequence_id: int, request: ExpertRequest) -> None:
        """Sends the reply (from inside `answer`, before the worker counts the call's tokens) or
        the error it is refused with; an OSError of the connection propagates (it is closed)."""
        sent = False

        def deliver(reply: ExpertReply) -> None:
            nonlocal sent
            frames = encode_reply(sequence_id, reply)
            sent = True
            connection.send(frames, drain=True)

        try:
            self._answer(request, deliver)
            return
        except CallError as e:
            frames = encode_error(sequence_id, e.code, str(e))
        except Exception as e:  # a bug: answer it as gRPC would (INTERNAL) and keep the connection
            if sent and isinstance(e, OSError):
                raise  # writing the reply failed: the connection is gone
            logger.exception("socket data plane request %d failed", sequence_id)
            if sent:  # the reply went out; what failed is the worker's bookkeeping after it
                return
            frames = encode_error(sequence_id, grpc.StatusCode.INTERNAL, str(e))
        connection.send(frames, drain=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            connections, self._connections = list(self._connections), set()
        if listener is not None:
            listener.close()
        for connection in connections:
            connection.stop_reading()
