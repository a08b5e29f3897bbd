"""PrefillWorker gRPC servicer: translation between proto and the engine only.

Prefill(request): run the prompt as a 1-token request with `KVExportParams` from the decode
worker's computed tokens: the KV connector (engine/connectors/remote_prefill.py) hands out its KV
as its chunked prefill progresses (`ExportedKV` events). Stream each round's KV at once as KVChunks
(whole tokens, at most the chunk size each), then a PrefillDone with the first token. A cancelled
call aborts the request (blocks freed).
"""

from __future__ import annotations

import dataclasses
import time

import grpc

from moemesh.engine.async_engine import AsyncEngine
from moemesh.engine.connectors.base import FirstToken
from moemesh.engine.connectors.kv_transfer import ExportedKV, split_kv
from moemesh.engine.connectors.remote_prefill import KVExportParams, RemotePrefillConnector
from moemesh.proto.v1 import prefill_pb2, prefill_pb2_grpc, telemetry_pb2
from moemesh.runtime import telemetry
from moemesh.runtime.metrics import WorkerMetrics
from moemesh.worker.convert import layout_from_proto, load_report, logprob_to_proto
from moemesh.worker.grpc_status import admit, engine_errors_as_status


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        connector: RemotePrefillConnector,
        worker_id: str,
        role: str,
        metrics: WorkerMetrics,
        chunk_bytes: int,
    ):
        self.engine = engine
        self.connector = connector  # the engine's, for the KV layout
        self.worker_id = worker_id
        self.role = role
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes
        self._tracer = telemetry.tracer("moemesh.prefill")

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        sampling = await admit(self.engine, request.sampling, context)
        layout = self.connector.layout
        if layout_from_proto(request.layout) != layout:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout mismatch: this worker has {layout}")
        # one token; EOS and stop ids stay in the params so that min_tokens masks them for it too
        params = dataclasses.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1), stop=())
        chunk_bytes = min(request.max_chunk_bytes or self.chunk_bytes, self.chunk_bytes)
        start = time.monotonic()
        span = self._tracer.start_span("prefill", context=telemetry.extract_context(context))
        span.set_attribute("moemesh.request_id", request.request_id)
        span.set_attribute("moemesh.num_prompt_tokens", len(request.prompt_token_ids))
        events = self.engine.generate(  # own id space: a 'both' worker may prefill for itself
            f"{request.request_id}/prefill",
            list(request.prompt_token_ids),
            params,
            kv_transfer_params=KVExportParams(request.num_computed_tokens),
        )
        num_bytes = 0
        try:
            async with engine_errors_as_status(context):
                async for event in events:
                    if not isinstance(event, ExportedKV):
                        continue
                    for first, data in split_kv(event.piece.data, layout, event.piece.start, chunk_bytes):
                        yield prefill_pb2.PrefillResponse(
                            chunk=prefill_pb2.KVChunk(
                                start_token=first, num_tokens=len(data) // layout.bytes_per_token, data=data
                            )
                        )
                        self.metrics.count_kv_bytes("sent", len(data))
                        num_bytes += len(data)
                    if event.first_token is not None:
                        span.set_attribute("moemesh.num_cached_tokens", event.first_token.num_cached_tokens)
                        span.set_attribute("moemesh.num_bytes", num_bytes)
                        self.metrics.observe_ttft(time.monotonic() - start)
                        self.metrics.observe_kv_transfer(time.monotonic() - start)
                        self.metrics.prefills.inc()
                        yield prefill_pb2.PrefillResponse(done=self._done(event.first_token))
                        return
        finally:
            span.end()
            await events.aclose()
        await context.abort(grpc.StatusCode.ABORTED, "the prefill was aborted")

    def _done(self, first: FirstToken) -> prefill_pb2.PrefillDone:
        done = prefill_pb2.PrefillDone(first_token_id=first.token_id, num_cached_tokens=first.num_cached_tokens)
        if first.logprob is not None:
            done.first_logprob.CopyFrom(logprob_to_proto(first.logprob))
        return done

    async def GetLoad(self, request, context) -> telemetry_pb2.LoadReport:
        return load_report(self.engine.stats, self.worker_id, self.role, self.metrics)
