"""StartupGate: a worker's server answers health checks while it starts, refuses its own calls
(unary and streaming) with UNAVAILABLE, and passes them once opened."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh.common.grpc_util import HealthReporter, StartupGate, create_server
from moemesh.proto.v1 import decode_pb2, decode_pb2_grpc, telemetry_pb2


class Answering(decode_pb2_grpc.DecodeWorkerServicer):
    async def GetLoad(self, request, context):
        return telemetry_pb2.LoadReport(worker_id="w", num_running=3)

    async def Generate(self, request, context):
        yield decode_pb2.WorkerGenerateResponse(worker_id=request.request_id)


def test_calls_are_refused_with_unavailable_until_the_gate_opens():
    async def scenario():
        health, gate = HealthReporter([]), StartupGate("worker w")
        server, port = create_server("127.0.0.1", 0, health, (gate,))
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(Answering(), server)
        await server.start()
        outcomes = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = decode_pb2_grpc.DecodeWorkerStub(channel)
                await health.set_serving(False)
                check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                outcomes.append(health_pb2.HealthCheckResponse.ServingStatus.Name(check.status))
                for _ in range(2):  # closed, then open
                    try:
                        outcomes.append((await stub.GetLoad(telemetry_pb2.LoadRequest())).num_running)
                    except grpc.aio.AioRpcError as e:
                        outcomes.append((e.code(), e.details()))
                    try:
                        stream = stub.Generate(decode_pb2.WorkerGenerateRequest(request_id="r"))
                        outcomes.append((await stream.read()).worker_id)
                    except grpc.aio.AioRpcError as e:
                        outcomes.append((e.code(), e.details()))
                    gate.open()
        finally:
            await server.stop(None)
        return outcomes

    refused = (grpc.StatusCode.UNAVAILABLE, "worker w is starting (not serving yet)")
    assert asyncio.run(scenario()) == ["NOT_SERVING", refused, refused, 3, "r"]
