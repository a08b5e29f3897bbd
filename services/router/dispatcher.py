"""One request through the mesh: hash the prompt's blocks, route, call the decode worker, detokenize
incrementally and apply stop strings (text/output_processor.py, as the offline engine does), and
stream deltas back to the API layer.

A worker that fails before sending any token is marked down and the request is retried on
another one (up to `max_attempts`). A worker that fails (or gives the request up, as a draining
one does) after tokens were streamed is replaced by migration: another decode worker gets the
prompt plus the tokens already sent (`resume_token_ids`), prefills them itself (its prefix cache
helps), and continues with the same max_tokens, stop checks and seed (its generator is
fast-forwarded past the sent tokens' draws), so the client sees one uninterrupted stream with no
repeated or missing token. At most `max_migrations` per request; each is a span event
("migrated") and counts in `moemesh:router_migrations_total`. Leaving the iteration early (client
gone, stop string) cancels the worker call, which aborts the request on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field

import grpc

from moemesh.contracts.block_hash import HashExtra, hash_block_chain
from moemesh.contracts.finish_reason import FinishReason, finish_reason_from_proto
from moemesh.contracts.sampling import SamplingParams
from moemesh.contracts.sampling_proto import sampling_to_proto
from moemesh.proto.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from moemesh.router.worker_pool import NoWorkerError, Route, WorkerPool
from moemesh.runtime import telemetry
from moemesh.runtime.grpc_util import ChannelPool
from moemesh.runtime.metrics import RouterMetrics
from moemesh.text.errors import InvalidRequestError
from moemesh.text.output_processor import OutputProcessor

logger = logging.getLogger(__name__)

_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


class RouterError(Exception):
    """An error for the client: `status` is the HTTP status, `code` the gRPC status."""

    status = 500
    code = grpc.StatusCode.INTERNAL
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidRequest(RouterError):
    status, code, error_type = 400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error"


@contextlib.contextmanager
def invalid_request() -> Iterator[None]:
    """The contracts' InvalidRequestError (a request the engine would refuse too) raised inside,
    as InvalidRequest naming the same field."""
    try:
        yield
    except InvalidRequestError as e:
        raise InvalidRequest(str(e), param=e.param) from None


class ModelNotFound(RouterError):
    status, code, error_type = 404, grpc.StatusCode.NOT_FOUND, "invalid_request_error"


class Overloaded(RouterError):
    status, code, error_type = 429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_exceeded"


class Unavailable(RouterError):
    status, code, error_type = 503, grpc.StatusCode.UNAVAILABLE, "service_unavailable"


class WorkerFailedError(Unavailable):
    """The decode worker failed after tokens were streamed, and the request could not move."""


class FirstTokenTimeout(Unavailable):
    """No first token within the (prompt-scaled) first-token timeout."""


class _WorkerLost(Exception):
    """The decode worker failed or gave the request up; another one can take over."""


@dataclass
class _Stream:
    """What the client has been sent so far, across attempts and migrations."""

    output: OutputProcessor  # the text so far, carried over a migration
    sent: list[int] = field(default_factory=list)  # output token ids streamed


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # checked (contracts/sampling.py); the stop strings are applied here


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far
    num_cached_tokens: int = 0
    worker_id: str = ""


class Dispatcher:
    def __init__(
        self,
        pool: WorkerPool,
        channels: ChannelPool,
        tokenizer,
        extra: HashExtra,
        metrics: RouterMetrics,
        max_attempts: int = 3,
        first_token_timeout_s: float = 120.0,
        max_migrations: int = 3,
        first_token_timeout_per_token_s: float = 0.05,
    ):
        self.pool = pool
        self.channels = channels
        self.tokenizer = tokenizer
        self.extra = extra
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.first_token_timeout_s = first_token_timeout_s
        self.max_migrations = max_migrations
        self.first_token_timeout_per_token_s = first_token_timeout_per_token_s
        self._tracer = telemetry.tracer("moemesh.router")

    def block_chain(self, prompt_token_ids: list[int]):
        return hash_block_chain(prompt_token_ids, self.pool.block_size, self.extra)

    async def generate(self, request: GenerateInput) -> AsyncGenerator[Delta, None]:
        span = self._tracer.start_span("router.generate")
        span.set_attribute("moemesh.request_id", request.request_id)
        span.set_attribute("moemesh.num_prompt_tokens", len(request.prompt_token_ids))
        ctx = telemetry.child_context(span)
        params = request.params
        stream = _Stream(OutputProcessor(self.tokenizer, params.stop, request.prompt_token_ids, params.min_tokens))
        try:
            chain = self.block_chain(request.prompt_token_ids)
            cached = await self.pool.cached_prefixes(chain)
            excluded: set[str] = set()
            attempts = migrations = 0
            while True:
                started = time.perf_counter()
                try:
                    route = self.pool.choose(chain, len(request.prompt_token_ids), cached, excluded)
                except NoWorkerError as e:
                    if stream.sent:
                        raise WorkerFailedError(f"{e}: the request could not be migrated") from None
                    raise Unavailable(str(e)) from None
                if stream.sent:  # a migrated request prefills its prompt and the sent tokens itself
                    route = Route(route.decode, None, route.cached_blocks)
                self.metrics.decision_seconds.observe(time.perf_counter() - started)
                span.set_attribute("moemesh.decode_worker", route.decode.worker_id)
                span.set_attribute("moemesh.cached_blocks", route.cached_blocks)
                sent_before = len(stream.sent)
                try:
                    async with contextlib.aclosing(self._call(request, route, chain, cached, ctx, stream)) as deltas:
                        async for delta in deltas:
                            yield delta
                    return
                except _WorkerLost as lost:
                    excluded.add(route.decode.worker_id)
                    if not stream.sent:  # failed before any token: retry elsewhere
                        attempts += 1
                        if attempts >= self.max_attempts:
                            raise Unavailable(
                                f"no decode worker could serve the request after {attempts} attempts ({lost})"
                            ) from None
                        logger.info(
                            "request %s: retrying after decode worker %s failed (attempt %d)",
                            request.request_id,
                            route.decode.worker_id,
                            attempts,
                        )
                        continue
                    if migrations >= self.max_migrations:
                        raise WorkerFailedError(
                            f"{lost} after {len(stream.sent)} tokens; {migrations} migrations "
                            f"already (the most allowed)"
                        ) from None
                    migrations += 1
                    self.metrics.migrations.inc()
                    span.add_event(
                        "migrated",
                        {
                            "moemesh.from_worker": route.decode.worker_id,
                            "moemesh.num_sent_tokens": len(stream.sent),
                            "moemesh.reason": str(lost),
                        },
                    )
                    logger.warning(
                        "request %s: %s after %d tokens (%d on it); migrating (%d of at most %d)",
                        request.request_id,
                        lost,
                        len(stream.sent),
                        len(stream.sent) - sent_before,
                        migrations,
                        self.max_migrations,
                    )
        except RouterError as e:
            span.set_attribute("moemesh.error", str(e))
            raise
        finally:
            span.end()

    async def _call(
        self, request: GenerateInput, route: Route, chain, cached, ctx, stream: _Stream
    ) -> AsyncGenerator[Delta, None]:
        """Deltas of one attempt; raises _WorkerLost when the worker fails in a way another worker
        can make up for (before the first token: a retry; after: a migration)."""
        worker = route.decode
        call_request = decode_pb2.WorkerGenerateRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_to_proto(request.params),
            prefill_endpoint=route.prefill.endpoint if route.prefill is not None else "",
            resume_token_ids=stream.sent,
        )
        stub = decode_pb2_grpc.DecodeWorkerStub(self.channels.get(worker.endpoint))
        call = stub.Generate(call_request, metadata=telemetry.inject_metadata(ctx))
        charge = self.pool.begin(route, chain, len(request.prompt_token_ids), cached)
        self.metrics.route(worker.worker_id, "decode")
        if route.prefill is not None:
            self.metrics.route(route.prefill.worker_id, "prefill")
        num_new = 0  # tokens of this attempt
        started = last = time.monotonic()
        try:
            messages = call.__aiter__()
            while True:
                try:
                    timeout = self._first_token_timeout(request) if num_new == 0 else None
                    message = await asyncio.wait_for(messages.__anext__(), timeout)
                except StopAsyncIteration:
                    raise _WorkerLost(f"decode worker {worker.worker_id} ended the stream early") from None
                except TimeoutError:
                    waited = f"{self._first_token_timeout(request):.0f} s"
                    if stream.sent:
                        raise _WorkerLost(f"no token from {worker.worker_id} in {waited}") from None
                    raise FirstTokenTimeout(f"no first token from {worker.worker_id} in {waited}") from None
                now = time.monotonic()
                if num_new == 0:
                    if not stream.sent:
                        self.metrics.ttft.observe(now - started)
                    self.pool.end_prefill(route, charge)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                finish = finish_reason_from_proto(message.finish_reason)
                if finish is FinishReason.ABORT:  # e.g. a draining worker gave it up
                    raise _WorkerLost(f"decode worker {worker.worker_id} aborted the request")
                delta = self._delta(stream.output, message, finish, len(stream.sent), len(request.prompt_token_ids))
                num_new += len(delta.token_ids)
                stream.sent.extend(delta.token_ids)
                yield delta
                if delta.finish_reason is not None:
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() in _RETRYABLE:
                self.pool.mark_down(worker)
                raise _WorkerLost(f"decode worker {worker.worker_id} failed ({e.code().name}: {e.details()})") from None
            raise _rpc_error(e, worker.worker_id, streamed=bool(stream.sent)) from None
        finally:
            call.cancel()  # a no-op when the call completed; else aborts it on the workers
            self.pool.end(route, charge)

    def _first_token_timeout(self, request: GenerateInput) -> float:
        """Long prompts take long to prefill: the wait grows with the prompt."""
        return self.first_token_timeout_s + self.first_token_timeout_per_token_s * len(request.prompt_token_ids)

    def _delta(
        self, output: OutputProcessor, message, finish: FinishReason | None, num_output: int, num_prompt: int
    ) -> Delta:
        """The worker's message as text: tokens after one that completed a stop string are dropped
        (the request ends there: leaving the stream cancels the worker's call)."""
        out = output.process(message.token_ids, finish is not None)
        token_ids = list(message.token_ids[: out.num_kept])
        return Delta(
            text=out.text,
            token_ids=token_ids,
            logprobs=list(message.logprobs[: out.num_kept]),
            finish_reason=FinishReason.STOP if out.stopped else finish,
            num_prompt_tokens=num_prompt,
            num_output_tokens=num_output + len(token_ids),
            num_cached_tokens=min(message.num_cached_tokens, num_prompt),  # a resumed call counts sent tokens too
            worker_id=message.worker_id,
        )


def _rpc_error(error: grpc.aio.AioRpcError, worker_id: str, streamed: bool) -> RouterError:
    code, details = error.code(), error.details() or ""
    param = dict(error.trailing_metadata() or ()).get("moemesh-param")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details, param=param)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"decode worker {worker_id} is overloaded: {details}")
    if streamed:
        return WorkerFailedError(f"decode worker {worker_id} failed mid-stream ({code.name}): {details}")
    return Unavailable(f"decode worker {worker_id}: {code.name}: {details}")
