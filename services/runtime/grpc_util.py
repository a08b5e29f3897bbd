"""gRPC plumbing shared by the services: channel options, a channel per endpoint, and an asyncio
server with the standard health service (NOT_SERVING until the owner marks it SERVING).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

MAX_MESSAGE_BYTES = 8 << 20  # KV chunks are <= 3 MiB; leave headroom

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # fail fast instead of waiting minutes for a dead peer to come back
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)

SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
)


class ChannelPool:
    """One asyncio channel per 'host:port', created on first use; `close()` closes them all."""

    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
            self._channels[endpoint] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close(grace=None)


LIVENESS_SERVICE = "liveness"  # the pods' liveness probe: SERVING while the process runs


class HealthReporter:
    """The server's grpc.health.v1 status: readiness for the overall server ('') and each named
    service, which `set_serving` turns on and off; liveness (`LIVENESS_SERVICE`), SERVING from the
    first report until shutdown, so a worker that loads or waits for a placement is alive, not ready."""

    def __init__(self, service_names: list[str]):
        self.servicer = health_aio.HealthServicer()
        self.service_names = ["", *service_names]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        for name in self.service_names:
            await self.servicer.set(name, status)

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()


class AdmissionGate(grpc.aio.ServerInterceptor):
    """Which calls a worker's server lets through as it starts, serves and drains.

    Starting (until `open()`): every call but the health service's is refused with UNAVAILABLE. A
    worker's server listens while its engine loads and, with remote experts, while it waits for a
    placement and installs the executor; a caller that tries it then (a decode worker reaching a
    restarted prefill worker at its old address) is told to go elsewhere instead of running a
    request the worker cannot run yet.
    Draining (after `drain()`): the calls that start new work (`new_work_methods`, full method
    names) are refused with UNAVAILABLE, so a router whose view still lists the worker retries
    elsewhere; the rest (Abort, GetLoad, health) still pass, and calls in flight go on."""

    def __init__(self, owner: str, new_work_methods: tuple[str, ...] = ()):
        self._owner = owner
        self._new_work_methods = frozenset(new_work_methods)
        self.is_open = False
        self.is_draining = False

    def open(self) -> None:
        self.is_open = True

    def drain(self) -> None:
        self.is_draining = True

    def _refusal(self, method: str) -> str | None:
        if method.startswith("/grpc.health.v1.Health/"):
            return None
        if not self.is_open:
            return f"{self._owner} is starting (not serving yet)"
        if self.is_draining and method in self._new_work_methods:
            return f"{self._owner} is draining (shutting down; send new requests elsewhere)"
        return None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        message = self._refusal(handler_call_details.method)
        if handler is None or message is None:
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        kind = (
            "unary_unary"
            if handler.unary_unary
            else "unary_stream"
            if handler.unary_stream
            else "stream_unary"
            if handler.stream_unary
            else "stream_stream"
        )
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(
            refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def create_server(
    host: str, port: int, health: HealthReporter, interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
) -> tuple[grpc.aio.Server, int]:
    """An asyncio server bound to host:port (0 = any free port) with the health service added;
    returns it (not started) and the bound port."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {host}:{port}")
    return server, bound


async def check_health(endpoint: str, timeout_s: float = 1.0) -> bool:
    """True if the server at endpoint answers SERVING (used by the launcher and tests)."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING
