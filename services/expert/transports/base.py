"""The expert transport: how a remote ExpertExecutor reaches expert workers (the data plane).
gRPC unary calls stay the control plane (GetStatus, health); placement and membership come from
Redis through `attach.RemoteExperts`.

Callers of `ExpertTransport`:
- `submit`: RemoteExpertExecutor.forward (on whichever thread runs the model), once per expert
  worker per MoE layer per step; all of a layer's calls are submitted before any is awaited, so
  they run concurrently; `PendingCall.result()` is then called once per call, on that thread;
- `set_endpoints`: the worker's placement watcher (through the engine thread, between steps)
  when the registry shows a worker joining, at a new address, or leaving;
- `close`: the worker at shutdown (RemoteExpertExecutor.close);
- `set_rehearsal`: RemoteExpertExecutor after each layer's submit: a transport that busy-polls
  for replies may run it while it waits, to keep the dispatch path's caches warm (socket).

Implementations (`make_transport`, selected by `--expert-transport`):
- `grpc`: `grpc_unary.GrpcExpertTransport`, one unary RunExperts call per request (sync
  channels, calls as futures: no event loop on the model's thread);
- `grpc-stream` (default): `grpc_stream.GrpcStreamExpertTransport`, one long-lived
  bidirectional RunExpertsStream call per expert worker, requests matched to replies by sequence id;
- `torch-dist`: `torch_dist.DistExpertTransport`, a two-rank torch.distributed group per expert
  worker (gloo on CPU, nccl on GPU), formed through the OpenDataPlane RPC;
- `socket`: `tcp_socket.SocketExpertTransport`, one TCP connection per expert worker carrying
  raw frames (protocol/frames.py: a fixed header, then the arrays' bytes; no protobuf), its port from the
  OpenDataPlane RPC.
Requests and replies are `call.ExpertRequest` / `call.ExpertReply` (tensors and index arrays);
each transport encodes them its own way.
Every implementation fails fast on a dead peer (no wait-for-ready) and after `timeout_s` on a
hung one, raising `ExpertCallError` from `result()`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Protocol

import grpc

from moemesh.expert.protocol.call import ExpertReply, ExpertRequest
from moemesh.runtime.grpc_util import CHANNEL_OPTIONS

TRANSPORTS = ("grpc", "grpc-stream", "torch-dist", "socket")


class ExpertCallError(Exception):
    """One RunExperts call failed; `code` is the gRPC status name."""

    def __init__(self, worker_id: str, endpoint: str, code: str, details: str):
        super().__init__(f"expert worker {worker_id} ({endpoint or 'no known endpoint'}): {code}: {details}")
        self.worker_id, self.endpoint, self.code, self.details = worker_id, endpoint, code, details


class PendingCall(Protocol):
    def result(self) -> ExpertReply:  # raises ExpertCallError (a failed call), WireError (a malformed reply)
        ...


class ExpertTransport(ABC):
    @abstractmethod
    def submit(self, worker_id: str, request: ExpertRequest, timeout_s: float) -> PendingCall:
        """Start one call; never blocks on the peer and never raises (errors come from result())."""

    @abstractmethod
    def set_endpoints(self, endpoints: Mapping[str, str]) -> None:
        """worker id -> 'host:port' of the workers the registry lists now (a missing one keeps its
        last address: it may come back)."""

    def set_rehearsal(self, rehearsal: Callable[[], None] | None) -> None:
        """A call without effects that repeats the caller's work around the next request (planning
        and building it). A transport that polls while it waits may run it (the socket transport,
        frame_socket.py's keep_warm); the others ignore it."""
        return None

    def close(self) -> None:
        return None


class FailedCall:
    def __init__(self, error: ExpertCallError):
        self._error = error

    def result(self) -> ExpertReply:
        raise self._error


class Connection(Protocol):
    """One open data-plane connection to one expert worker (a gRPC stream, a torch.distributed group)."""

    worker_id: str
    endpoint: str

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


class PerWorkerTransport(ExpertTransport):
    """The transports that keep one connection per expert worker: the registry's endpoints, one
    gRPC channel per endpoint, and per worker its open connection, reopened on the next call once
    it closed (peer died, timed out) or when the registry shows the worker at a new endpoint."""

    def __init__(self, endpoints: Mapping[str, str] | None = None):
        self._endpoints: dict[str, str] = dict(endpoints or {})  # worker id -> 'host:port'
        self._channels: dict[str, grpc.Channel] = {}  # endpoint -> channel
        self._connections: dict[str, Connection] = {}  # worker id -> its open connection
        self._lock = threading.Lock()

    @abstractmethod
    def _open(self, channel: grpc.Channel, worker_id: str, endpoint: str) -> Connection:
        """A new connection to `worker_id` (called under the lock); raises ExpertCallError."""

    def set_endpoints(self, endpoints: Mapping[str, str]) -> None:
        with self._lock:
            self._endpoints = {**self._endpoints, **endpoints}
            moved = [c for w, c in self._connections.items() if self._endpoints.get(w) != c.endpoint]
        for connection in moved:
            self.drop(connection)

    def _connection(self, worker_id: str) -> Connection:
        """The worker's open connection, opened if needed; raises ExpertCallError."""
        with self._lock:
            connection = self._connections.get(worker_id)
            if connection is not None and not connection.closed:
                return connection
            endpoint = self._endpoints.get(worker_id, "")
            if not endpoint:
                raise ExpertCallError(worker_id, "", "UNAVAILABLE", "not in the registry")
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._channels[endpoint] = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
            connection = self._connections[worker_id] = self._open(channel, worker_id, endpoint)
            return connection

    def drop(self, connection: Connection) -> None:
        with self._lock:
            if self._connections.get(connection.worker_id) is connection:
                del self._connections[connection.worker_id]
        connection.close()

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
            channels, self._channels = list(self._channels.values()), {}
        for connection in connections:
            connection.close()
        for channel in channels:
            channel.close()
