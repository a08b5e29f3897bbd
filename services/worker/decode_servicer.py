"""DecodeWorker gRPC servicer: translation between proto and the engine, plus the remote-prefill
hand-off (decode-first flow).

Generate(request, prefill_endpoint): the engine admits the request reusing this worker's cached
prefix. If it parks the request for remote KV (`RemotePrefillNeeded`: a prefill endpoint was
given and at least `min_remote_prefill_tokens` prompt tokens are uncached), the servicer fetches
the KV and first token through the KV transport and hands them to the engine. If the transfer
fails (nothing arrives for `kv_transfer_timeout_s`, not done after that plus
`kv_transfer_timeout_per_token_s` per uncached token, the prefill worker gone), the engine keeps
the KV received so far and prefills only the rest locally. Tokens stream back one message per
engine step. A cancelled call aborts the request here, and (by cancelling the transfer) on the
prefill worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from moemesh.engine.async_engine import AsyncEngine, RemotePrefillNeeded
from moemesh.engine.connectors.kv_transfer import KVPiece, KVTransferError, KVTransport, RemoteKV, RemotePrefillTask
from moemesh.engine.core.request import RemotePrefillParams
from moemesh.engine.outputs import RequestOutput
from moemesh.proto.v1 import decode_pb2, decode_pb2_grpc, telemetry_pb2
from moemesh.runtime import telemetry
from moemesh.runtime.metrics import RequestTimes, WorkerMetrics
from moemesh.worker.convert import FINISH_REASONS, load_report, logprob_to_proto
from moemesh.worker.grpc_status import admit, engine_errors_as_status

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemotePrefillResult:
    num_tokens: int  # prompt tokens whose KV came from the prefill worker
    complete: bool  # the KV and the first token arrived; False: the rest was prefilled here


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        transport: KVTransport,
        worker_id: str,
        role: str,
        metrics: WorkerMetrics,
        min_remote_prefill_tokens: int,
        kv_transfer_timeout_s: float,  # the longest wait for the next piece of KV, and the base of ...
        kv_transfer_timeout_per_token_s: float,  # ... the whole transfer's deadline, which grows per uncached token
        max_queued_requests: int,
    ):
        self.engine = engine
        self.transport = transport
        self.worker_id = worker_id
        self.role = role
        self.metrics = metrics
        self.remote_params = RemotePrefillParams(min_remote_tokens=min_remote_prefill_tokens)
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.kv_transfer_timeout_per_token_s = kv_transfer_timeout_per_token_s
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
        remote = self.remote_params if request.prefill_endpoint and not resume else None
        events = self.engine.generate(request.request_id, list(request.prompt_token_ids), params,
                                      remote_prefill=remote, resume_token_ids=resume)  # fmt: skip
        num_remote_tokens, remote_first_token = 0, False
        last = first_token = scheduled = None
        num_generated, recorded = 0, False

        def record(finish_reason: str) -> None:  # once, before the last message leaves (or at an abort)
            nonlocal recorded
            if not recorded:
                recorded = True
                self.metrics.request_finished(RequestTimes(
                    arrival, scheduled, first_token, time.monotonic(), len(request.prompt_token_ids), num_generated,
                    params.max_tokens, finish_reason))  # fmt: skip

        # spans: local = "queue+prefill" -> "decode"; remote = "queue" -> "kv_transfer" -> "decode"
        phase = self._tracer.start_span("queue+prefill", context=ctx)
        try:
            async with engine_errors_as_status(context):
                async for event in events:
                    if isinstance(event, RemotePrefillNeeded):
                        phase.update_name("queue")
                        phase.end()
                        phase = trace.INVALID_SPAN  # ending it again (cancelled during the transfer) is a no-op
                        remote = await self._remote_prefill(request, event, ctx)
                        num_remote_tokens, remote_first_token = remote.num_tokens, remote.complete
                        phase = self._tracer.start_span("decode" if remote.complete else "prefill.fallback",
                                                        context=ctx)  # fmt: skip
                        continue
                    now = time.monotonic()
                    scheduled = event.scheduled_time or scheduled
                    num_generated = len(event.token_ids) - len(resume)
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
                        span.set_attribute("moemesh.num_output_tokens", len(event.token_ids))
                        span.set_attribute("moemesh.num_cached_tokens", event.num_cached_tokens)
                        span.set_attribute("moemesh.num_remote_prefill_tokens", num_remote_tokens)
                    yield self._response(event, num_remote_tokens)
        finally:
            record("abort")
            phase.end()
            span.end()
            await events.aclose()

    async def _remote_prefill(self, request, event: RemotePrefillNeeded, ctx) -> RemotePrefillResult:
        """Fetch the KV of tokens [num_computed, len(prompt)) and hand it to the engine; after a
        failure the engine keeps the pieces received and prefills the rest locally."""
        num_prompt_tokens = len(request.prompt_token_ids)
        layout = self.engine.engine.kv_layout
        task = RemotePrefillTask(
            endpoint=request.prefill_endpoint,
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            num_computed_tokens=event.num_computed_tokens,
            layout=layout,
            timeout_s=self.kv_transfer_timeout_s
            + self.kv_transfer_timeout_per_token_s * (num_prompt_tokens - event.num_computed_tokens),
            idle_timeout_s=self.kv_transfer_timeout_s,
        )
        kv = RemoteKV(event.num_computed_tokens, num_prompt_tokens, layout.bytes_per_token)
        with self._tracer.start_as_current_span("kv_transfer", context=ctx) as span:  # no yield inside
            span.set_attribute("moemesh.prefill_endpoint", task.endpoint)
            task = _with_metadata(task, telemetry.inject_metadata(telemetry.child_context(span)))
            started = time.monotonic()
            try:
                async with contextlib.aclosing(self.transport.fetch(task)) as received:
                    async for item in received:
                        kv.add(item)
                        if isinstance(item, KVPiece):
                            self.metrics.count_kv_bytes("received", item.data.numel())
            except KVTransferError as e:
                num_kept = await self.engine.fallback_to_local_prefill(request.request_id, kv)
                logger.warning("request %s: remote prefill failed after %d of %d tokens (%s); kept the KV of %d, "
                               "prefilling the other %d locally", request.request_id, kv.num_received_tokens,
                               kv.end - kv.start, e, num_kept, num_prompt_tokens - kv.start - num_kept)  # fmt: skip
                span.set_attribute("moemesh.fallback", True)
                span.set_attribute("moemesh.num_resumed_tokens", num_kept)
                self.metrics.kv_resumed_tokens.inc(num_kept)
                return RemotePrefillResult(num_kept, complete=False)
            span.set_attribute("moemesh.num_bytes", sum(p.data.numel() for p in kv.pieces))
            self.metrics.observe_kv_transfer(time.monotonic() - started)
            await self.engine.finish_remote_prefill(request.request_id, kv)
            return RemotePrefillResult(kv.end - kv.start, complete=True)

    def _response(self, output: RequestOutput, num_remote: int) -> decode_pb2.WorkerGenerateResponse:
        response = decode_pb2.WorkerGenerateResponse(
            token_ids=output.new_token_ids,
            num_cached_tokens=output.num_cached_tokens,
            num_remote_prefill_tokens=num_remote,
            worker_id=self.worker_id,
        )
        if output.logprobs is not None and output.new_token_ids:  # several new tokens with speculation
            new = output.logprobs[-len(output.new_token_ids) :]  # (a resumed request has none for its earlier ones)
            response.logprobs.extend(logprob_to_proto(lp) for lp in new)
        if output.finished:
            response.finish_reason = FINISH_REASONS[output.finish_reason]
        return response

    async def Abort(self, request: decode_pb2.AbortRequest, context) -> decode_pb2.AbortResponse:
        for request_id in request.request_ids:
            self.engine.abort(request_id)
        return decode_pb2.AbortResponse(num_aborted=len(request.request_ids))

    async def GetLoad(self, request, context) -> telemetry_pb2.LoadReport:
        return load_report(self.engine.stats, self.worker_id, self.role, self.metrics)


def _with_metadata(task: RemotePrefillTask, metadata) -> RemotePrefillTask:
    return dataclasses.replace(task, metadata=tuple(metadata))
