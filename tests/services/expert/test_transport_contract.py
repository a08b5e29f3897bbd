"""The ExpertTransport contract, for every transport (grpc, grpc-stream, torch-dist, socket),
against an in-process expert side: a real grpc.aio server answering RunExperts, RunExpertsStream
and OpenDataPlane (through the real `DistDataPlane`: gloo groups over loopback, and the real
`SocketDataPlane`: raw frames over loopback TCP). The replies come
from a stand-in `answer` (2 * hidden_states), so the tests see the transport alone: replies
matched to calls in any collection order, refused requests, a hung peer (deadline, then a fresh
stream or group), a worker not in the registry or not listening. Whole meshes over each
transport: test_transports.py."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
import torch

from moemesh.expert.protocol.call import CallError, ExpertReply, ExpertRequest, reply_to_proto, request_from_proto
from moemesh.expert.server.dist_server import DistDataPlane
from moemesh.expert.server.socket_server import SocketDataPlane
from moemesh.expert.transports.base import ExpertCallError
from moemesh.expert.transports.factory import make_transport
from moemesh.proto.v1 import expert_pb2, expert_pb2_grpc


class _Servicer(expert_pb2_grpc.ExpertWorkerServicer):
    def __init__(self, dist_plane, socket_plane):
        self.planes = {"socket": socket_plane, "dist": dist_plane}  # factories, then the planes
        self.opened: list[str] = []  # torch-dist / socket sessions and grpc-stream streams, in order
        self.hang = asyncio.Event()  # set: answers wait for `release`
        self.release = asyncio.Event()

    async def OpenDataPlane(self, request, context):
        family = "socket" if request.backend == "socket" else "dist"
        if callable(self.planes[family]):
            self.planes[family] = self.planes[family]()
        try:
            port = await asyncio.to_thread(self.planes[family].open, request.session, request.backend)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.opened.append(request.session)
        return expert_pb2.OpenDataPlaneResponse(store_port=port)

    async def RunExperts(self, request, context):
        reply = await self.answer_message(request)
        if reply.error_code:
            await context.abort(grpc.StatusCode[reply.error_code], reply.error)
        return reply

    async def RunExpertsStream(self, requests, context):
        self.opened.append("stream")
        async for request in requests:
            yield await self.answer_message(request)

    async def answer(self, request: ExpertRequest) -> ExpertReply:
        """2 * hidden_states; CallError for a negative layer (a refused request)."""
        if self.hang.is_set():
            await self.release.wait()
        if request.layer < 0:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"layer {request.layer}")
        return ExpertReply(2 * request.hidden_states)

    async def answer_message(self, message: expert_pb2.RunExpertsRequest) -> expert_pb2.RunExpertsResponse:
        try:
            reply = reply_to_proto(await self.answer(request_from_proto(message)))
        except CallError as e:
            reply = expert_pb2.RunExpertsResponse(error_code=e.code.name, error=str(e))
        reply.sequence_id = message.sequence_id
        return reply


@pytest.fixture
def expert_side():
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def serve():
        def answer_blocking(request, deliver=None):  # the servicer's blocking path: on the plane's thread
            reply = asyncio.run_coroutine_threadsafe(servicer.answer(request), loop).result()
            if deliver is not None:
                deliver(reply)
            return reply

        servicer = _Servicer(
            lambda: DistDataPlane("127.0.0.1", "expert-0", answer_blocking),
            lambda: SocketDataPlane("127.0.0.1", 0, "expert-0", answer_blocking),
        )
        server = grpc.aio.server()
        expert_pb2_grpc.add_ExpertWorkerServicer_to_server(servicer, server)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        holder.update(servicer=servicer, server=server, stop=asyncio.Event())
        started.set()
        await holder["stop"].wait()
        if not callable(servicer.planes["socket"]):
            servicer.planes["socket"].close()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(60), "the in-process expert server did not start"
    yield holder["servicer"], f"127.0.0.1:{holder['port']}", loop
    loop.call_soon_threadsafe(holder["servicer"].release.set)
    loop.call_soon_threadsafe(holder["stop"].set)
    thread.join(60)


def request(layer: int, rows: int, seed: int) -> ExpertRequest:
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed))
    none = np.zeros(0, dtype=np.int32)
    return ExpertRequest(layer, 1, x, none, none, none, none)


TRANSPORTS = ["grpc", "grpc-stream", "torch-dist", "socket"]
KEEPS_A_CONNECTION = {"grpc-stream", "torch-dist", "socket"}  # one stream / group / connection per expert worker


@pytest.fixture(params=TRANSPORTS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def transport(expert_side, kind):
    """`kind` to the expert side as "expert-0", and to a closed port as "gone"."""
    _, endpoint, _ = expert_side
    transport = make_transport(kind, {"expert-0": endpoint, "gone": "127.0.0.1:1"})
    yield transport
    transport.close()


def test_replies_reach_their_calls_in_any_collection_order(expert_side, kind, transport):
    servicer, _, _ = expert_side
    requests = [request(0, rows, seed) for seed, rows in enumerate([3, 64, 1, 17])]
    calls = [transport.submit("expert-0", r, timeout_s=60) for r in requests]
    for i in (2, 0, 3, 1):  # not the order sent
        assert torch.equal(calls[i].result().outputs, 2 * requests[i].hidden_states)
    assert len(servicer.opened) == (kind in KEEPS_A_CONNECTION)  # one stream / group carried them all


def test_a_refused_request_raises_its_code_and_the_connection_stays_open(expert_side, kind, transport):
    servicer, _, _ = expert_side
    with pytest.raises(ExpertCallError) as refused:
        transport.submit("expert-0", request(-1, 2, 0), timeout_s=60).result()
    assert refused.value.code == "INVALID_ARGUMENT" and "layer -1" in refused.value.details
    assert transport.submit("expert-0", request(0, 2, 1), timeout_s=60).result().outputs.shape == (2, 16)
    assert len(servicer.opened) == (kind in KEEPS_A_CONNECTION)


def test_a_hung_peer_misses_the_deadline_and_the_next_call_starts_afresh(expert_side, kind, transport):
    servicer, _, loop = expert_side
    transport.submit("expert-0", request(0, 2, 0), timeout_s=60).result()
    loop.call_soon_threadsafe(servicer.hang.set)
    first, second = (transport.submit("expert-0", request(0, 2, s), timeout_s=0.5) for s in (1, 2))
    with pytest.raises(ExpertCallError) as late:
        first.result()
    assert late.value.code == "DEADLINE_EXCEEDED"
    with pytest.raises(ExpertCallError):  # the other call fails too (its stream / group, or its deadline)
        second.result()
    loop.call_soon_threadsafe(servicer.hang.clear)
    loop.call_soon_threadsafe(servicer.release.set)
    reply = transport.submit("expert-0", request(0, 5, 3), timeout_s=60).result()
    assert torch.equal(reply.outputs, 2 * request(0, 5, 3).hidden_states)
    assert len(servicer.opened) == 2 * (kind in KEEPS_A_CONNECTION)


def test_a_polling_socket_transport_runs_the_callers_rehearsal_while_it_waits(expert_side):
    """While a reply is outstanding the socket transport keeps the dispatch path warm: it runs
    the rehearsal set with set_rehearsal (and re-decodes / re-encodes its last frames)."""
    servicer, endpoint, loop = expert_side
    transport = make_transport("socket", {"expert-0": endpoint}, busy_poll_s=60.0)
    try:
        first = request(0, 3, 0)
        assert torch.equal(transport.submit("expert-0", first, timeout_s=60).result().outputs, 2 * first.hidden_states)
        loop.call_soon_threadsafe(servicer.hang.set)
        rehearsals = []

        def rehearsal():
            rehearsals.append(1)
            loop.call_soon_threadsafe(servicer.release.set)  # the reply comes once the wait has rehearsed

        transport.set_rehearsal(rehearsal)
        second = request(0, 5, 1)
        assert torch.equal(
            transport.submit("expert-0", second, timeout_s=60).result().outputs, 2 * second.hidden_states
        )
        assert rehearsals
    finally:
        transport.close()


def test_a_worker_not_in_the_registry_or_not_listening_is_unavailable_at_once(transport):
    for worker_id in ("nobody", "gone"):
        with pytest.raises(ExpertCallError) as failed:
            transport.submit(worker_id, request(0, 2, 0), timeout_s=60).result()
        assert failed.value.code == "UNAVAILABLE"


def test_open_data_plane_refuses_a_reused_session_or_an_unknown_backend(expert_side):
    _, endpoint, _ = expert_side
    with grpc.insecure_channel(endpoint) as channel:
        stub = expert_pb2_grpc.ExpertWorkerStub(channel)
        stub.OpenDataPlane(expert_pb2.OpenDataPlaneRequest(session="taken", backend="gloo"), timeout=30)
        stub.OpenDataPlane(expert_pb2.OpenDataPlaneRequest(session="taken", backend="socket"), timeout=30)
        cases = (
            ("s", "mpi", "backend"),
            ("", "gloo", "session name"),
            ("taken", "gloo", "already open"),
            ("", "socket", "session name"),
            ("taken", "socket", "already open"),
        )
        for session, backend, message in cases:
            with pytest.raises(grpc.RpcError) as refused:
                stub.OpenDataPlane(expert_pb2.OpenDataPlaneRequest(session=session, backend=backend), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl can form groups on this machine")
def test_nccl_without_a_gpu_is_refused_on_both_sides_naming_gloo(expert_side):
    """An nccl group needs a CUDA build with a GPU: the expert side answers INVALID_ARGUMENT before
    it starts a thread, the attention side fails the call before it asks."""
    servicer, endpoint, _ = expert_side
    with grpc.insecure_channel(endpoint) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            expert_pb2_grpc.ExpertWorkerStub(channel).OpenDataPlane(
                expert_pb2.OpenDataPlaneRequest(session="n", backend="nccl"), timeout=30
            )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "(use gloo)" in refused.value.details()
    transport = make_transport("torch-dist", {"expert-0": endpoint}, dist_backend="nccl")
    try:
        with pytest.raises(ExpertCallError) as failed:
            transport.submit("expert-0", request(0, 2, 0), timeout_s=60).result()
    finally:
        transport.close()
    assert failed.value.code == "FAILED_PRECONDITION" and "needs a CUDA build" in failed.value.details
    assert servicer.opened == []  # neither side started a session


def test_framing_carries_empty_and_multi_megabyte_messages_both_ways():
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from moemesh.expert.protocol.dist_group import REPLY_TAGS, REQUEST_TAGS, Framing, pair_group

    timeout = datetime.timedelta(seconds=30)
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    stores = [master, dist.TCPStore("127.0.0.1", master.port, None, False, timeout)]  # one client per rank
    with ThreadPoolExecutor(2) as pool:
        groups = list(
            pool.map(
                lambda rank: pair_group(dist.PrefixStore("t", stores[rank]), rank, "gloo", "127.0.0.1", timeout), (0, 1)
            )
        )
    expert, attention = Framing(groups[0], 1, torch.device("cpu")), Framing(groups[1], 0, torch.device("cpu"))
    big = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for message in (b"", b"x", big.numpy().tobytes()):
        attention.send(message, REQUEST_TAGS)
        assert expert.recv(REQUEST_TAGS, timeout) == message
        expert.send(message[::-1], REPLY_TAGS)
        assert attention.recv(REPLY_TAGS, timeout) == message[::-1]
        attention.reap()
        expert.reap()
