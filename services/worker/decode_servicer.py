"""DecodeWorker gRPC servicer: translation between proto and the engine only.

Generate(request, prefill_endpoint): the request goes to the engine with `RemotePrefillParams`
when a prefill endpoint is given (decode-first flow). The engine admits it reusing this worker's
cached prefix; if at least `min_remote_prefill_tokens` prompt tokens are uncached, the KV connector
(engine/connectors/remote_prefill.py) parks it and fetches their KV and the first token from the
prefill worker, or, if the transfer fails, keeps what arrived and prefills only the rest here. The
servicer sees that as connector events (load started / finished) for its spans and the response's
`num_remote_prefill_tokens`. Tokens stream back one message per engine step. A cancelled call
aborts the request here, and (the connector cancelling the transfer) on the prefill worker.
"""

from __future__ import annotations

import time

import grpc
from opentelemetry import trace

from moemesh.contracts.finish_reason import finish_reason_to_proto
from moemesh.engine.async_engine import AsyncEngine
from moemesh.engine.connectors.base import KVLoadFinished, KVLoadStarted
from moemesh.engine.connectors.remote_prefill import RemotePrefillParams
from moemesh.engine.outputs import RequestDelta
from moemesh.proto.v1 import decode_pb2, decode_pb2_grpc, telemetry_pb2
from moemesh.runtime import telemetry
from moemesh.runtime.metrics import RequestTimes, WorkerMetrics
from moemesh.worker.convert import load_report, logprob_to_proto
from moemesh.worker.grpc_status import admit, engine_errors_as_status


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        worker_id: str,
        role: str,
        metrics: WorkerMetrics,
        min_remote_prefill_tokens: int,
        max_queued_requests: int,
    ):
        self.engine = engine
        self.worker_id = worker_id
        self.role = role
        self.metrics = metrics
        self.min_remote_prefill_tokens = min_remote_prefill_tokens
        self.max_queued_requests = max_queued_requests
        self._tracer = telemetry.tracer("moemesh.decode")

    async def Generate(self, request: decode_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext):
        params = await admit(self.engine, request.sampling, context)
        if self.engine.stats.get("num_waiting", 0) >= self.max_queued_requests:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_queued_requests} requests queued")
        arrival = time.monotonic()
        span = self._tracer.start_span("decode.generate", context=telemetry.extract_context(context))
        span.set_attribute("moemesh.request_id", request.request_id)
        span.set_attribute("moemesh.worker_id", self.worker_id)
        span.set_attribute("moemesh.num_prompt_tokens", len(request.prompt_token_ids))
        ctx = telemetry.child_context(span)
        resume = list(request.resume_token_ids)  # a migrated request: prefilled here with its earlier tokens
        remote = None
        if request.prefill_endpoint and not resume:
            remote = RemotePrefillParams(
                self.min_remote_prefill_tokens, request.prefill_endpoint, request.sampling, ctx
            )
        events = self.engine.generate(
            request.request_id,
            list(request.prompt_token_ids),
            params,
            kv_transfer_params=remote,
            resume_token_ids=resume,
        )
        num_remote_tokens, remote_first_token = 0, False
        last = first_token = scheduled = None
        num_generated, recorded = 0, False

        def record(finish_reason: str) -> None:  # once, before the last message leaves (or at an abort)
            nonlocal recorded
            if not recorded:
                recorded = True
                self.metrics.request_finished(
                    RequestTimes(
                        arrival,
                        scheduled,
                        first_token,
                        time.monotonic(),
                        len(request.prompt_token_ids),
                        num_generated,
                        params.max_tokens,
                        finish_reason,
                    )
                )

        # spans: local = "queue+prefill" -> "decode"; remote = "queue" -> "kv_transfer" -> "decode"
        phase = self._tracer.start_span("queue+prefill", context=ctx)
        try:
            async with engine_errors_as_status(context):
                async for event in events:
                    if isinstance(event, KVLoadStarted):  # the connector's span "kv_transfer" follows
                        phase.update_name("queue")
                        phase.end()
                        phase = trace.INVALID_SPAN  # ending it again (cancelled during the transfer) is a no-op
                        continue
                    if isinstance(event, KVLoadFinished):
                        num_remote_tokens, remote_first_token = event.num_tokens, event.with_first_token
                        phase = self._tracer.start_span(
                            "decode" if remote_first_token else "prefill.fallback", context=ctx
                        )
                        continue
                    now = time.monotonic()
                    scheduled = event.scheduled_time or scheduled
                    num_generated = event.num_output_tokens - len(resume)
                    if last is None:
                        first_token = now
                        self.metrics.observe_ttft(now - arrival)
                        if not remote_first_token:
                            phase.end()
                            phase = self._tracer.start_span("decode", context=ctx)
                    else:
                        self.metrics.observe_itl(now - last)
                    last = now
                    if event.finished:
                        record(event.finish_reason)
                        span.set_attribute("moemesh.num_output_tokens", event.num_output_tokens)
                        span.set_attribute("moemesh.num_cached_tokens", event.num_cached_tokens)
                        span.set_attribute("moemesh.num_remote_prefill_tokens", num_remote_tokens)
                    yield self._response(event, num_remote_tokens)
        finally:
            record("abort")
            phase.end()
            span.end()
            await events.aclose()

    def _response(self, delta: RequestDelta, num_remote: int) -> decode_pb2.WorkerGenerateResponse:
        response = decode_pb2.WorkerGenerateResponse(
            token_ids=delta.new_token_ids,
            num_cached_tokens=delta.num_cached_tokens,
            num_remote_prefill_tokens=num_remote,
            worker_id=self.worker_id,
            finish_reason=finish_reason_to_proto(delta.finish_reason if delta.finished else None),
        )
        response.logprobs.extend(logprob_to_proto(lp) for lp in delta.new_logprobs or ())
        return response

    async def Abort(self, request: decode_pb2.AbortRequest, context) -> decode_pb2.AbortResponse:
        for request_id in request.request_ids:
            self.engine.abort(request_id)
        return decode_pb2.AbortResponse(num_aborted=len(request.request_ids))

    async def GetLoad(self, request, context) -> telemetry_pb2.LoadReport:
        return load_report(self.engine.stats, self.worker_id, self.role, self.metrics)
