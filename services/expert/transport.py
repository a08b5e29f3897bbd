"""The expert transport: how a remote ExpertExecutor reaches expert workers.

Callers:
- `submit`: RemoteExpertExecutor.forward (on whichever thread runs the model), once per expert
  worker per MoE layer per step; all of a layer's calls are submitted before any is awaited, so
  they run concurrently;
- `set_endpoints`: the worker's placement watcher (through the engine thread) when the registry
  shows a worker at a new address;
- `close`: the worker at shutdown.

`GrpcExpertTransport` is the gRPC implementation (sync channels, one per endpoint, calls as
futures: no event loop needed on the model's thread). Calls fail fast on a dead peer (no
wait-for-ready) and after `timeout_s` on a hung one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Protocol

import grpc

from moemesh.common.grpc_util import CHANNEL_OPTIONS
from moemesh.proto.v1 import expert_pb2, expert_pb2_grpc


class ExpertCallError(Exception):
    """One RunExperts call failed; `code` is the gRPC status name."""

    def __init__(self, worker_id: str, endpoint: str, code: str, details: str):
        super().__init__(f"expert worker {worker_id} ({endpoint or 'no known endpoint'}): {code}: {details}")
        self.worker_id, self.endpoint, self.code, self.details = worker_id, endpoint, code, details


class PendingCall(Protocol):
    def result(self) -> expert_pb2.RunExpertsResponse:  # raises ExpertCallError
        ...


class ExpertTransport(ABC):
    @abstractmethod
    def submit(self, worker_id: str, request: expert_pb2.RunExpertsRequest, timeout_s: float) -> PendingCall: ...

    @abstractmethod
    def set_endpoints(self, endpoints: Mapping[str, str]) -> None: ...

    def close(self) -> None:
        return None


class _FailedCall:
    def __init__(self, error: ExpertCallError):
        self._error = error

    def result(self) -> expert_pb2.RunExpertsResponse:
        raise self._error


class _GrpcCall:
    def __init__(self, future: grpc.Future, worker_id: str, endpoint: str):
        self._future, self._worker_id, self._endpoint = future, worker_id, endpoint

    def result(self) -> expert_pb2.RunExpertsResponse:
        try:
            return self._future.result()
        except grpc.RpcError as e:
            raise ExpertCallError(self._worker_id, self._endpoint, e.code().name, e.details() or "") from None


class GrpcExpertTransport(ExpertTransport):
    def __init__(self, endpoints: Mapping[str, str] | None = None):
        self._endpoints: dict[str, str] = dict(endpoints or {})  # worker id -> 'host:port'
        self._stubs: dict[str, expert_pb2_grpc.ExpertWorkerStub] = {}  # endpoint -> stub
        self._channels: list[grpc.Channel] = []

    def set_endpoints(self, endpoints: Mapping[str, str]) -> None:
        self._endpoints = {**self._endpoints, **endpoints}  # a vanished worker keeps its last address

    def submit(self, worker_id: str, request: expert_pb2.RunExpertsRequest, timeout_s: float) -> PendingCall:
        endpoint = self._endpoints.get(worker_id, "")
        if not endpoint:
            return _FailedCall(ExpertCallError(worker_id, "", "UNAVAILABLE", "not in the registry"))
        stub = self._stubs.get(endpoint)
        if stub is None:
            channel = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[endpoint] = expert_pb2_grpc.ExpertWorkerStub(channel)
        return _GrpcCall(stub.RunExperts.future(request, timeout=timeout_s), worker_id, endpoint)

    def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], {}
        for channel in channels:
            channel.close()
