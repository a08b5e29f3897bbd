"""The `torch-dist` expert transport: per expert worker a two-rank torch.distributed group
(gloo on CPU, nccl on GPU) carrying serialized RunExpertsRequests and their replies, with gRPC
only for the rendezvous (`OpenDataPlane`).

Per expert worker a `_Peer`, opened on the first `submit` to it: a unary OpenDataPlane call
(fails fast on a dead peer) returns the worker's TCPStore port; both sides then join the group
named by a fresh session id (dist_group.py). `submit` stamps the next sequence id and starts the
send (the backend writes from its own thread); `result()` receives replies in arrival order on
the calling thread, stashing those of other calls, until its own is in: no reader thread and no
hop between threads on the dispatch path. A receive that fails (peer gone) or passes the call's
timeout (which closes the pair on both sides) fails the peer: every pending call on it raises
ExpertCallError and the next `submit` opens a new group.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping

import grpc
import torch.distributed as dist

from moemesh.expert.protocol.call import ExpertReply, ExpertRequest, reply_from_proto, request_to_proto
from moemesh.expert.protocol.dist_group import (
    ATTENTION_RANK,
    EXPERT_RANK,
    REPLY_TAGS,
    REQUEST_TAGS,
    Framing,
    check_backend,
    device_for,
    first_line,
    pair_group,
)
from moemesh.expert.transports.base import ExpertCallError, FailedCall, PendingCall, PerWorkerTransport
from moemesh.proto.v1 import expert_pb2, expert_pb2_grpc

OPEN_TIMEOUT_S = 10.0  # OpenDataPlane plus joining the group
MAX_STASHED = 256  # replies kept for calls not yet collected (a forward that failed drops its other calls)


class _Peer:
    def __init__(self, channel: grpc.Channel, worker_id: str, endpoint: str, backend: str, host: str):
        self.worker_id, self.endpoint = worker_id, endpoint
        self.error: ExpertCallError | None = None  # set once the group failed
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stash: OrderedDict[int, expert_pb2.RunExpertsResponse] = OrderedDict()
        check_backend(backend)  # raises ValueError before the peer is asked
        session = uuid.uuid4().hex
        opened = expert_pb2_grpc.ExpertWorkerStub(channel).OpenDataPlane(
            expert_pb2.OpenDataPlaneRequest(session=session, backend=backend), timeout=OPEN_TIMEOUT_S
        )  # raises grpc.RpcError
        store = dist.TCPStore(
            endpoint.rsplit(":", 1)[0], opened.store_port, None, False, datetime.timedelta(seconds=OPEN_TIMEOUT_S)
        )
        timeout = datetime.timedelta(seconds=OPEN_TIMEOUT_S)
        self._group = pair_group(dist.PrefixStore(session, store), ATTENTION_RANK, backend, host, timeout)
        self._framing = Framing(self._group, EXPERT_RANK, device_for(backend))

    @property
    def closed(self) -> bool:
        return self.error is not None

    def submit(self, request: ExpertRequest) -> int:
        message = request_to_proto(request)
        with self._lock:
            if self.error is not None:
                raise self.error
            message.sequence_id = sequence_id = next(self._ids)
            try:
                self._framing.send(message.SerializeToString(), REQUEST_TAGS)
            except RuntimeError as e:
                raise self._fail("UNAVAILABLE", first_line(e)) from None
            return sequence_id

    def collect(self, sequence_id: int, timeout_s: float) -> ExpertReply:
        timeout = datetime.timedelta(seconds=timeout_s)
        with self._lock:
            while sequence_id not in self._stash:
                if self.error is not None:
                    raise self.error
                try:
                    data = self._framing.recv(REPLY_TAGS, timeout)
                except RuntimeError as e:
                    timed_out = "Timed out" in str(e)
                    raise self._fail(
                        "DEADLINE_EXCEEDED" if timed_out else "UNAVAILABLE",
                        f"no reply within {timeout_s} s" if timed_out else first_line(e),
                    ) from None
                reply = expert_pb2.RunExpertsResponse()
                reply.ParseFromString(data)
                self._stash[reply.sequence_id] = reply
                while len(self._stash) > MAX_STASHED:
                    self._stash.popitem(last=False)
            self._framing.reap()  # the peer answered: every send before this reply has arrived
            reply = self._stash.pop(sequence_id)
        if reply.error_code:
            raise ExpertCallError(self.worker_id, self.endpoint, reply.error_code, reply.error)
        return reply_from_proto(reply)

    def _fail(self, code: str, details: str) -> ExpertCallError:
        if self.error is None:
            self.error = ExpertCallError(self.worker_id, self.endpoint, code, details)
        return self.error

    def close(self) -> None:
        self._fail("UNAVAILABLE", "transport closed")
        self._group = self._framing = None  # the backend closes its connections; the peer's thread ends


class _DistCall:
    def __init__(self, peer: _Peer, sequence_id: int, timeout_s: float):
        self._peer, self._sequence_id, self._timeout_s = peer, sequence_id, timeout_s

    def result(self) -> ExpertReply:
        return self._peer.collect(self._sequence_id, self._timeout_s)


class DistExpertTransport(PerWorkerTransport):
    def __init__(self, endpoints: Mapping[str, str] | None = None, backend: str = "gloo", host: str = "127.0.0.1"):
        """`host`: the address expert workers reach this process at (its advertised host)."""
        super().__init__(endpoints)
        self.backend, self.host = backend, host

    def _open(self, channel: grpc.Channel, worker_id: str, endpoint: str) -> _Peer:
        try:
            return _Peer(channel, worker_id, endpoint, self.backend, self.host)
        except grpc.RpcError as e:
            raise ExpertCallError(worker_id, endpoint, e.code().name, e.details() or "") from None
        except RuntimeError as e:  # the store or the group did not come up
            raise ExpertCallError(worker_id, endpoint, "UNAVAILABLE", first_line(e)) from None
        except ValueError as e:  # this process cannot form the backend's groups
            raise ExpertCallError(worker_id, endpoint, "FAILED_PRECONDITION", str(e)) from None

    def submit(self, worker_id: str, request: ExpertRequest, timeout_s: float) -> PendingCall:
        try:
            peer = self._connection(worker_id)
            return _DistCall(peer, peer.submit(request), timeout_s)
        except ExpertCallError as e:
            return FailedCall(e)
