"""`grpc`: one unary RunExperts call per request, on sync channels with calls as futures (no event
loop on the model's thread)."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from moemesh.expert.protocol.call import ExpertReply, ExpertRequest, reply_from_proto, request_to_proto
from moemesh.expert.transports.base import ExpertCallError, ExpertTransport, FailedCall, PendingCall
from moemesh.proto.v1 import expert_pb2_grpc
from moemesh.runtime.grpc_util import CHANNEL_OPTIONS


class _GrpcCall:
    def __init__(self, future: grpc.Future, worker_id: str, endpoint: str):
        self._future, self._worker_id, self._endpoint = future, worker_id, endpoint

    def result(self) -> ExpertReply:
        try:
            message = self._future.result()
        except grpc.RpcError as e:
            raise ExpertCallError(self._worker_id, self._endpoint, e.code().name, e.details() or "") from None
        return reply_from_proto(message)


class GrpcExpertTransport(ExpertTransport):
    def __init__(self, endpoints: Mapping[str, str] | None = None):
        self._endpoints: dict[str, str] = dict(endpoints or {})  # worker id -> 'host:port'
        self._stubs: dict[str, expert_pb2_grpc.ExpertWorkerStub] = {}  # endpoint -> stub
        self._channels: list[grpc.Channel] = []

    def set_endpoints(self, endpoints: Mapping[str, str]) -> None:
        self._endpoints = {**self._endpoints, **endpoints}  # a vanished worker keeps its last address

    def submit(self, worker_id: str, request: ExpertRequest, timeout_s: float) -> PendingCall:
        endpoint = self._endpoints.get(worker_id, "")
        if not endpoint:
            return FailedCall(ExpertCallError(worker_id, "", "UNAVAILABLE", "not in the registry"))
        stub = self._stubs.get(endpoint)
        if stub is None:
            channel = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[endpoint] = expert_pb2_grpc.ExpertWorkerStub(channel)
        return _GrpcCall(stub.RunExperts.future(request_to_proto(request), timeout=timeout_s), worker_id, endpoint)

    def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], {}
        for channel in channels:
            channel.close()
