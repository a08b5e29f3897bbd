"""The `socket` expert transport: per expert worker one TCP connection carrying raw frames
(frames.py: a fixed header, then the arrays' bytes), with gRPC only for the handshake.

Per expert worker a `_Peer`, opened on the first `submit` to it: a unary OpenDataPlane call
(backend "socket"; fails fast on a dead or stopping peer) returns the worker's data port; the
peer connects to the gRPC endpoint's host at that port and names its session (HELLO). `submit`
stamps the next sequence id and writes the request frame on the calling thread; `result()` reads
replies in arrival order on the calling thread, stashing those of other calls, until its own is
in: no reader thread and no hop between threads on the dispatch path. A wait first polls the
socket for `busy_poll_s` (non-blocking reads, yielding the CPU between them) and only then
blocks: a core that idles through the expert's compute comes back with cold caches, and the
planning and decoding around the call then run several times slower (benchmarks/expert_dispatch.py
`--busy-poll` gives the figures); while it polls it rehearses the work around the reply (the
last reply's decoding, the caller's planning of its next request: `set_rehearsal`, and its
encoding; FrameSocket.keep_warm). A read or write that fails (peer gone), passes the call's
timeout, or meets a frame that does not parse fails the peer: every pending call on it raises
ExpertCallError and the next `submit` opens a new connection.
"""

from __future__ import annotations

import itertools
import socket
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping

import grpc

from moemesh.expert.protocol.call import ExpertReply, ExpertRequest
from moemesh.expert.protocol.frame_socket import FrameSocket
from moemesh.expert.protocol.frames import (
    REPLY,
    FrameError,
    decode_reply,
    encode_hello,
    encode_request,
    parse_reply_header,
    status_name,
)
from moemesh.expert.transports.base import ExpertCallError, FailedCall, PendingCall, PerWorkerTransport
from moemesh.proto.v1 import expert_pb2, expert_pb2_grpc

OPEN_TIMEOUT_S = 10.0  # OpenDataPlane plus connecting
MAX_STASHED = 256  # replies kept for calls not yet collected (a forward that failed drops its other calls)


class _Peer:
    def __init__(
        self,
        channel: grpc.Channel,
        worker_id: str,
        endpoint: str,
        busy_poll_s: float,
        rehearsal: Callable[[], Callable[[], None] | None] = lambda: None,
    ):
        """`rehearsal`: the transport's current caller rehearsal (set_rehearsal), or None."""
        self.worker_id, self.endpoint = worker_id, endpoint
        self._rehearsal = rehearsal
        self._last_request: ExpertRequest | None = None  # what the wait rehearses (keep_warm)
        self._last_reply: tuple[bytearray, bytearray] | None = None
        self.error: ExpertCallError | None = None  # set once the connection failed
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stash: OrderedDict[int, ExpertReply | ExpertCallError] = OrderedDict()
        session = uuid.uuid4().hex
        opened = expert_pb2_grpc.ExpertWorkerStub(channel).OpenDataPlane(
            expert_pb2.OpenDataPlaneRequest(session=session, backend="socket"), timeout=OPEN_TIMEOUT_S
        )  # raises grpc.RpcError
        host = endpoint.rsplit(":", 1)[0].strip("[]")
        sock = socket.create_connection((host, opened.store_port), timeout=OPEN_TIMEOUT_S)  # raises OSError
        self._connection = FrameSocket(sock, busy_poll_s)
        if busy_poll_s > 0:
            self._connection.keep_warm = self._keep_warm
        try:
            self._connection.send(encode_hello(session))
        except OSError:
            self._connection.close()
            raise

    @property
    def closed(self) -> bool:
        return self.error is not None

    def submit(self, request: ExpertRequest, timeout_s: float) -> int:
        buffers = None
        with self._lock:
            if self.error is not None:
                raise self.error
            sequence_id = next(self._ids)
            buffers = encode_request(sequence_id, request)
            self._last_request = request
            try:
                self._connection.sock.settimeout(timeout_s)
                self._connection.send(buffers)
            except TimeoutError:
                raise self._fail("DEADLINE_EXCEEDED", f"the request was not taken within {timeout_s} s") from None
            except OSError as e:
                raise self._fail("UNAVAILABLE", f"sending the request: {e}") from None
            return sequence_id

    def collect(self, sequence_id: int, timeout_s: float) -> ExpertReply:
        with self._lock:
            while sequence_id not in self._stash:
                if self.error is not None:
                    raise self.error
                self._read_one(timeout_s)
            reply = self._stash.pop(sequence_id)
        if isinstance(reply, ExpertCallError):
            raise reply
        return reply

    def _read_one(self, timeout_s: float) -> None:
        """One reply into the stash (under the lock); fails the peer on any error."""
        try:
            self._connection.sock.settimeout(timeout_s)
            head = self._connection.read_exact(REPLY.size)
            header = parse_reply_header(head)
            payload = self._connection.read_exact(header.payload_bytes)
        except TimeoutError:
            raise self._fail("DEADLINE_EXCEEDED", f"no reply within {timeout_s} s") from None
        except FrameError as e:
            raise self._fail("INTERNAL", f"a malformed reply: {e}") from None
        except OSError as e:  # ConnectionError included
            raise self._fail("UNAVAILABLE", str(e) or type(e).__name__) from None
        if header.status:
            reply = ExpertCallError(
                self.worker_id, self.endpoint, status_name(header), payload.decode(errors="replace")
            )
        else:
            reply = decode_reply(header, payload)
            self._last_reply = (head, payload)
        self._stash[header.sequence_id] = reply
        while len(self._stash) > MAX_STASHED:
            self._stash.popitem(last=False)

    def _keep_warm(self) -> None:
        """While a wait polls (under the lock): the work around the awaited reply, without effects:
        the last reply's decoding, the caller's planning of its next request, this transport's
        encoding of it."""
        if self._last_reply is not None:
            head, payload = self._last_reply
            decode_reply(parse_reply_header(head), payload)
        rehearsal = self._rehearsal()
        if rehearsal is not None:
            rehearsal()
        if self._last_request is not None:
            encode_request(0, self._last_request)

    def _fail(self, code: str, details: str) -> ExpertCallError:
        if self.error is None:
            self.error = ExpertCallError(self.worker_id, self.endpoint, code, details)
            self._connection.close()  # the expert side sees the close and ends its thread
        return self.error

    def close(self) -> None:  # not under the lock: a collect blocked in a read wakes up (closed socket)
        self._fail("UNAVAILABLE", "transport closed")


class _SocketCall:
    def __init__(self, peer: _Peer, sequence_id: int, timeout_s: float):
        self._peer, self._sequence_id, self._timeout_s = peer, sequence_id, timeout_s

    def result(self) -> ExpertReply:
        return self._peer.collect(self._sequence_id, self._timeout_s)


class SocketExpertTransport(PerWorkerTransport):
    def __init__(self, endpoints: Mapping[str, str] | None = None, busy_poll_s: float = 0.0):
        super().__init__(endpoints)
        self.busy_poll_s = busy_poll_s
        self._rehearsal: Callable[[], None] | None = None

    def set_rehearsal(self, rehearsal: Callable[[], None] | None) -> None:
        self._rehearsal = rehearsal

    def _open(self, channel: grpc.Channel, worker_id: str, endpoint: str) -> _Peer:
        try:
            return _Peer(channel, worker_id, endpoint, self.busy_poll_s, lambda: self._rehearsal)
        except grpc.RpcError as e:
            raise ExpertCallError(worker_id, endpoint, e.code().name, e.details() or "") from None
        except OSError as e:  # the data port did not take the connection
            raise ExpertCallError(worker_id, endpoint, "UNAVAILABLE", f"data connection: {e}") from None

    def submit(self, worker_id: str, request: ExpertRequest, timeout_s: float) -> PendingCall:
        try:
            peer = self._connection(worker_id)
            return _SocketCall(peer, peer.submit(request, timeout_s), timeout_s)
        except ExpertCallError as e:
            return FailedCall(e)
