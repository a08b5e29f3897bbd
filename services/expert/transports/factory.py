"""`make_transport`: the expert data plane that `--expert-transport` names (TRANSPORTS)."""

from __future__ import annotations

from collections.abc import Mapping

from moemesh.expert.transports.base import TRANSPORTS, ExpertTransport


def make_transport(
    kind: str,
    endpoints: Mapping[str, str],
    host: str = "127.0.0.1",
    dist_backend: str = "gloo",
    busy_poll_s: float = 0.0,
) -> ExpertTransport:
    """The transport `--expert-transport` names. `host`: this worker's advertised address (the
    torch-dist groups bind there); `dist_backend`: torch-dist's backend; `busy_poll_s`: how long
    the socket transport's wait for a reply polls before it blocks."""
    if kind == "grpc":
        from moemesh.expert.transports.grpc_unary import GrpcExpertTransport

        return GrpcExpertTransport(endpoints)
    if kind == "grpc-stream":
        from moemesh.expert.transports.grpc_stream import GrpcStreamExpertTransport

        return GrpcStreamExpertTransport(endpoints)
    if kind == "torch-dist":
        from moemesh.expert.transports.torch_dist import DistExpertTransport

        return DistExpertTransport(endpoints, dist_backend, host)
    if kind == "socket":
        from moemesh.expert.transports.tcp_socket import SocketExpertTransport

        return SocketExpertTransport(endpoints, busy_poll_s)
    raise ValueError(f"expert transport must be one of {TRANSPORTS}, got {kind!r}")
