"""The `grpc-stream` expert transport: one long-lived bidirectional RunExpertsStream call per
expert worker, carrying raw tensor bytes with no per-call setup.

Per endpoint a `_Stream` owns the call: `submit` puts the request (stamped with the next sequence
id) on a queue that the call's request iterator drains, and registers a future under that id; a
reader thread takes replies off the call and completes the future with the matching id. When the
call ends (peer died, restarted, stopping, or a reply timed out) every pending future fails with
ExpertCallError and the stream is dropped: the next `submit` to that worker opens a new one.
A late reply to a timed-out id is ignored.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from moemesh.expert.protocol.call import ExpertReply, ExpertRequest, reply_from_proto, request_to_proto
from moemesh.expert.transports.base import ExpertCallError, FailedCall, PendingCall, PerWorkerTransport
from moemesh.proto.v1 import expert_pb2_grpc

_END = object()  # queue sentinel: close the request side


class _Stream:
    def __init__(self, channel: grpc.Channel, worker_id: str, endpoint: str):
        self.worker_id, self.endpoint = worker_id, endpoint
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.closed = False
        stub = expert_pb2_grpc.ExpertWorkerStub(channel)
        self._call = stub.RunExpertsStream(iter(self._requests.get, _END))
        self._reader = threading.Thread(target=self._read, name=f"moemesh-expert-stream-{worker_id}", daemon=True)
        self._reader.start()

    def submit(self, request: ExpertRequest) -> Future:
        message = request_to_proto(request)
        future: Future = Future()
        with self._lock:
            if self.closed:
                future.set_exception(ExpertCallError(self.worker_id, self.endpoint, "UNAVAILABLE", "stream closed"))
                return future
            message.sequence_id = next(self._ids)
            self._pending[message.sequence_id] = future
        self._requests.put(message)
        return future

    def _read(self) -> None:
        code, details = "UNAVAILABLE", "the expert worker ended the stream"
        try:
            for reply in self._call:
                with self._lock:
                    future = self._pending.pop(reply.sequence_id, None)
                if future is None:
                    continue  # its caller gave up (timeout)
                if reply.error_code:
                    future.set_exception(ExpertCallError(self.worker_id, self.endpoint, reply.error_code, reply.error))
                else:
                    future.set_result(reply)
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
        self._fail_all(code, details)

    def _fail_all(self, code: str, details: str) -> None:
        with self._lock:
            self.closed = True
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ExpertCallError(self.worker_id, self.endpoint, code, details))

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self._requests.put(_END)
        self._call.cancel()


class _StreamCall:
    def __init__(self, future: Future, stream: _Stream, timeout_s: float, owner: GrpcStreamExpertTransport):
        self._future, self._stream, self._timeout_s, self._owner = future, stream, timeout_s, owner

    def result(self) -> ExpertReply:
        try:
            return reply_from_proto(self._future.result(self._timeout_s))
        except FutureTimeout:
            self._owner.drop(self._stream)  # a hung peer: start over with a fresh stream
            raise ExpertCallError(
                self._stream.worker_id,
                self._stream.endpoint,
                "DEADLINE_EXCEEDED",
                f"no reply within {self._timeout_s} s",
            ) from None


class GrpcStreamExpertTransport(PerWorkerTransport):
    def _open(self, channel: grpc.Channel, worker_id: str, endpoint: str) -> _Stream:
        return _Stream(channel, worker_id, endpoint)

    def submit(self, worker_id: str, request: ExpertRequest, timeout_s: float) -> PendingCall:
        try:
            stream = self._connection(worker_id)
        except ExpertCallError as e:
            return FailedCall(e)
        return _StreamCall(stream.submit(request), stream, timeout_s, self)
