"""AdmissionGate: a worker's server answers health checks while it starts, refuses its own calls
(unary and streaming) with UNAVAILABLE, passes them once opened, and once draining refuses only
the calls that start new work."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh.proto.v1 import decode_pb2, decode_pb2_grpc, telemetry_pb2
from moemesh.runtime.grpc_util import AdmissionGate, HealthReporter, create_server


class Answering(decode_pb2_grpc.DecodeWorkerServicer):
    async def GetLoad(self, request, context):
        return telemetry_pb2.LoadReport(worker_id="w", num_running=3)

    async def Generate(self, request, context):
        yield decode_pb2.WorkerGenerateResponse(worker_id=request.request_id)


def test_calls_are_refused_with_unavailable_until_the_gate_opens():
    async def scenario():
        health = HealthReporter([])
        gate = AdmissionGate("worker w", ("/moemesh.v1.DecodeWorker/Generate",))
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
                for step in (gate.open, gate.drain, None):  # starting, open, draining
                    try:
                        outcomes.append((await stub.GetLoad(telemetry_pb2.LoadRequest())).num_running)
                    except grpc.aio.AioRpcError as e:
                        outcomes.append((e.code(), e.details()))
                    try:
                        stream = stub.Generate(decode_pb2.WorkerGenerateRequest(request_id="r"))
                        outcomes.append((await stream.read()).worker_id)
                    except grpc.aio.AioRpcError as e:
                        outcomes.append((e.code(), e.details()))
                    if step is not None:
                        step()
        finally:
            await server.stop(None)
        return outcomes

    starting = (grpc.StatusCode.UNAVAILABLE, "worker w is starting (not serving yet)")
    draining = (grpc.StatusCode.UNAVAILABLE, "worker w is draining (shutting down; send new requests elsewhere)")
    assert asyncio.run(scenario()) == ["NOT_SERVING", starting, starting, 3, "r", 3, draining]
