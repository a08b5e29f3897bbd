"""PrefillWorker gRPC servicer: translation between proto and the engine only.

Prefill(request): run the prompt as a 1-token request that keeps its blocks at the end
(`kv_export_start` = the decode worker's computed tokens), then stream a PrefillHeader (first
token, sizes) and the exported KV in chunks. A cancelled call aborts the request (blocks freed).
"""

from __future__ import annotations

import dataclasses
import time

import grpc

from moemesh.common import telemetry
from moemesh.common.metrics import WorkerMetrics
from moemesh.engine.async_engine import AsyncEngine
from moemesh.engine.kv_transfer import ExportedKV
from moemesh.proto.convert import layout_from_proto, load_report, logprob_to_proto
from moemesh.proto.v1 import prefill_pb2, prefill_pb2_grpc, telemetry_pb2
from moemesh.worker.grpc_status import admit, engine_errors_as_status


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, engine: AsyncEngine, worker_id: str, role: str, metrics: WorkerMetrics, chunk_bytes: int):
        self.engine = engine
        self.worker_id = worker_id
        self.role = role
        self.metrics = metrics
        self.chunk_bytes = chunk_bytes
        self._tracer = telemetry.tracer("moemesh.prefill")

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        sampling = await admit(self.engine, request.sampling, context)
        layout = self.engine.engine.kv_layout
        if layout_from_proto(request.layout) != layout:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"KV layout mismatch: this worker has {layout}")  # fmt: skip
        # one token; EOS and stop ids stay in the params so that min_tokens masks them for it too
        params = dataclasses.replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1), stop=())
        start = time.monotonic()
        parent = telemetry.extract_context(context)
        with self._tracer.start_as_current_span("prefill", context=parent) as span:  # no yield inside
            span.set_attribute("moemesh.request_id", request.request_id)
            span.set_attribute("moemesh.num_prompt_tokens", len(request.prompt_token_ids))
            exported = await self._run(request, params, context)
            span.set_attribute("moemesh.num_cached_tokens", exported.num_cached_tokens)
            self.metrics.observe_ttft(time.monotonic() - start)
            self.metrics.prefills.inc()
        span = self._tracer.start_span("kv_transfer.send", context=telemetry.extract_context(context))
        span.set_attribute("moemesh.num_bytes", exported.data.numel())
        sent_at = time.monotonic()
        try:
            yield prefill_pb2.PrefillResponse(header=self._header(exported))
            view = memoryview(exported.data.numpy())
            chunk = min(request.max_chunk_bytes or self.chunk_bytes, self.chunk_bytes)
            for offset in range(0, len(view), chunk):
                yield prefill_pb2.PrefillResponse(
                    chunk=prefill_pb2.KVChunk(offset=offset, data=view[offset : offset + chunk].tobytes())
                )
            self.metrics.transferred("sent", len(view), time.monotonic() - sent_at)
        finally:
            span.end()

    async def _run(self, request, params, context) -> ExportedKV:
        events = self.engine.generate(  # own id space: a 'both' worker may prefill for itself
            f"{request.request_id}/prefill", list(request.prompt_token_ids), params,
            kv_export_start=request.num_computed_tokens,
        )  # fmt: skip
        try:
            async with engine_errors_as_status(context):
                async for event in events:
                    if isinstance(event, ExportedKV):
                        return event
        finally:
            await events.aclose()
        await context.abort(grpc.StatusCode.ABORTED, "the prefill was aborted")

    def _header(self, exported: ExportedKV) -> prefill_pb2.PrefillHeader:
        header = prefill_pb2.PrefillHeader(
            first_token_id=exported.first_token_id,
            num_tokens=exported.num_tokens,
            num_bytes=exported.data.numel(),
            num_cached_tokens=exported.num_cached_tokens,
        )
        if exported.first_logprob is not None:
            header.first_logprob.CopyFrom(logprob_to_proto(exported.first_logprob))
        return header

    async def GetLoad(self, request, context) -> telemetry_pb2.LoadReport:
        return load_report(self.engine.stats, self.worker_id, self.role, self.metrics)
