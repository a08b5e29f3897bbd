"""P/D disaggregation as one KV connector: a decode worker (D) gets the KV of a prompt's uncached
suffix and the first token from a prefill worker (P), which hands that KV out as its chunked
prefill progresses.

One connector with both ends, chosen per request by its parameters (vLLM's `kv_both` role):
`RemotePrefillParams` makes a request the consumer end (D), `KVExportParams` the producer end (P).
The ends are one protocol: the same wire layout and transfer types (kv_transfer.py), and a 'both'
worker runs them in one engine when it prefills for itself. Two connectors would have to be
composed for that worker; the ends share no state, so one class costs nothing.

Consumer (D). At the request's first admission, if at least `min_remote_tokens` of its prompt are
not in the prefix cache, the connector claims them all as an asynchronous load: the scheduler
allocates their blocks and parks the request. The connector fetches the KV through its
`KVTransport` in the worker's event loop (one `kv_transfer` span, child of the request's trace
context), adding the pieces to a `RemoteKV` as they arrive. When the transfer completes, the
engine's next step writes the KV and the request runs from P's first token; when it fails (nothing
for `timeout_s`, not done after `timeout_s` plus `timeout_per_token_s` per token, P gone) the
whole pieces before the last prompt token are kept (that token's logits are needed here) and the
rest is prefilled locally, in the same blocks (`moemesh:kv_transfer_resumed_tokens_total`). An
abort (client gone) cancels the fetch, which cancels P's call, which aborts P's request.

Producer (P). A request with `KVExportParams(start)` hands out the KV of its prompt from `start`
on: after each round, the whole blocks that round completed (never a block the next round is still
writing); when it finishes, its blocks are held until `save_kv` has sent the tail and the first
token, then freed. The pieces are `ExportedKV` events in the request's stream. A preempted request
recomputes its prefix; tokens already handed out are not sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from moemesh.contracts.finish_reason import FinishReason
from moemesh.engine.connectors.base import (
    NO_METADATA,
    ConnectorRequest,
    FinishedLoad,
    FinishedTransfers,
    FirstToken,
    KVBlockIds,
    KVCacheGroup,
    KVCaches,
    KVConnector,
    KVConnectorEvent,
    KVConnectorMetadata,
    KVTransferParams,
    ScheduledRound,
)
from moemesh.engine.connectors.kv_transfer import (
    ExportedKV,
    KVLayout,
    KVPiece,
    KVTransferError,
    KVTransport,
    NullKVTransport,
    RemoteKV,
    RemotePrefillTask,
    gather_kv,
    kv_layout,
    scatter_kv,
)
from moemesh.engine.errors import InvalidRequestError
from moemesh.runtime import telemetry
from moemesh.runtime.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemotePrefillParams(KVTransferParams):
    """D: the request may be prefilled by the prefill worker at `endpoint`, when at least
    `min_remote_tokens` of its prompt are not in the prefix cache at its first admission."""

    min_remote_tokens: int = 1
    endpoint: str = ""
    sampling: object = None  # the transport's wire form of the sampling parameters
    trace_context: Any = None  # the parent of the transfer's span (an OpenTelemetry Context)


@dataclass(frozen=True)
class KVExportParams(KVTransferParams):
    """P: hand out the KV of the prompt from token `start` on (D holds the tokens before)."""

    start: int


@dataclass
class _Transfer:
    """D: one remote prefill, from parking to its end."""

    block_ids: list[int]
    task: RemotePrefillTask
    kv: RemoteKV
    trace_context: Any
    future: Future | None = None  # the fetch running in the event loop


@dataclass
class _Export:
    """P: one exporting request."""

    request: ConnectorRequest
    num_sent: int  # the end of the KV handed out so far
    block_ids: list[int] = dataclasses.field(default_factory=list)  # its blocks now (group 0)


@dataclass(frozen=True)
class _ExportRound(KVConnectorMetadata):
    """P: the exporting requests a round computes: (request id, the end of its KV after the round,
    its preemption count then: a request preempted since has other blocks or none)."""

    ends: tuple[tuple[str, int, int], ...]


class RemotePrefillConnector(KVConnector):
    def __init__(
        self,
        transport: KVTransport | None = None,
        metrics: WorkerMetrics | None = None,
        timeout_s: float = 30.0,  # the longest wait for the next piece of KV, and the base of ...
        timeout_per_token_s: float = 0.02,  # ... the whole transfer's deadline, which grows per token
    ):
        self.transport = transport if transport is not None else NullKVTransport()
        self.metrics = metrics if metrics is not None else WorkerMetrics("", "", dict)  # a registry nobody reads
        self.timeout_s = timeout_s
        self.timeout_per_token_s = timeout_per_token_s
        self.layout: KVLayout | None = None  # set by register_kv_caches
        self._group: KVCacheGroup | None = None
        self._tracer = telemetry.tracer("moemesh.decode")
        self._loop: asyncio.AbstractEventLoop | None = None  # None: transfers end by `receive` calls
        self._wake: Callable[[], None] = lambda: None
        # consumer
        self._admitted: set[str] = set()  # admitted once: a remote prefill is tried at the first admission only
        self._transfers: dict[str, _Transfer] = {}  # parked, their KV coming
        self._received: queue.SimpleQueue[tuple[str, RemoteKV, list[KVPiece]]] = queue.SimpleQueue()
        # producer
        self._exports: dict[str, _Export] = {}
        self._finishing: list[str] = []  # finished, blocks held: their tail goes out at the next save_kv
        self._saved: set[str] = set()
        self._events: list[KVConnectorEvent] = []

    # -- scheduler half ----------------------------------------------------------------------
    def check_request(self, request: ConnectorRequest) -> None:
        params = request.kv_transfer_params
        if isinstance(params, KVExportParams) and not 0 <= params.start < request.num_prompt_tokens:
            raise InvalidRequestError(
                f"kv_export_start must be in [0, {request.num_prompt_tokens}), got {params.start}",
                param="kv_export_start",
            )
        if isinstance(params, RemotePrefillParams) and request.output_token_ids:
            raise InvalidRequestError("resumed tokens cannot come with a remote prefill", param="resume_token_ids")

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, RemotePrefillParams) or request.request_id in self._admitted:
            return 0, False  # prefilled here; a preempted request recomputes locally
        num_new = request.num_tokens - num_computed_tokens
        return (num_new, True) if num_new >= params.min_remote_tokens else (0, False)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: KVBlockIds, num_external_tokens: int
    ) -> None:
        request_id, params = request.request_id, request.kv_transfer_params
        if isinstance(params, KVExportParams):
            self._exports.setdefault(request_id, _Export(request, params.start))
        if not isinstance(params, RemotePrefillParams):
            return
        self._admitted.add(request_id)
        if num_external_tokens == 0:
            return
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_external_tokens
        assert end == request.num_prompt_tokens, "a remote prefill computes the rest of the prompt"
        task = RemotePrefillTask(
            endpoint=params.endpoint,
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=params.sampling,
            num_computed_tokens=start,
            layout=self.layout,
            timeout_s=self.timeout_s + self.timeout_per_token_s * num_external_tokens,
            idle_timeout_s=self.timeout_s,
        )
        transfer = _Transfer(
            list(block_ids[0]), task, RemoteKV(start, end, self.layout.bytes_per_token), params.trace_context
        )
        self._transfers[request_id] = transfer
        if self._loop is not None:
            transfer.future = asyncio.run_coroutine_threadsafe(self._fetch(transfer), self._loop)

    def build_connector_meta(self, scheduler_output: ScheduledRound) -> KVConnectorMetadata:
        if not self._exports:
            return NO_METADATA
        for new in scheduler_output.scheduled_new_reqs:
            if (export := self._exports.get(new.request_id)) is not None:
                export.block_ids = list(new.block_ids)
        for cached in scheduler_output.scheduled_cached_reqs:
            if (export := self._exports.get(cached.request_id)) is not None:
                export.block_ids.extend(cached.new_block_ids)
        ends = tuple(
            (request_id, export.request.num_computed_tokens, export.request.num_preemptions)
            for request_id in scheduler_output.num_scheduled_tokens
            if (export := self._exports.get(request_id)) is not None
        )
        return _ExportRound(ends)

    def request_finished(self, request: ConnectorRequest, block_ids: KVBlockIds) -> bool:
        request_id = request.request_id
        self._admitted.discard(request_id)
        transfer = self._transfers.pop(request_id, None)
        if transfer is not None and transfer.future is not None:
            transfer.future.cancel()  # cancels the fetch, and with it P's request
        export = self._exports.get(request_id)
        if export is None:
            return False
        if request.finish_reason == FinishReason.ABORT:
            del self._exports[request_id]
            return False
        export.block_ids = list(block_ids[0])
        self._finishing.append(request_id)
        return True

    # -- worker half ---------------------------------------------------------------------------
    def register_kv_caches(self, caches: KVCaches) -> None:
        (self._group,) = caches.groups  # a transfer moves one cache group
        self.layout = kv_layout(caches)

    def bind(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._loop, self._wake = loop, wake

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        return None  # remote KV is written between steps (get_finished), once its transfer ended

    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        for request_id in self._finishing:  # the tail and the first token; their blocks are freed next
            export = self._exports.pop(request_id)
            request = export.request
            logprob = request.output_logprobs[0] if request.output_logprobs else None
            first = FirstToken(request.output_token_ids[0], logprob, max(request.num_cached_tokens, 0))
            piece = self._gather(export, export.num_sent, request.num_prompt_tokens)
            self._events.append(ExportedKV(request_id, piece, first))
            self._saved.add(request_id)
        self._finishing = []
        if not isinstance(metadata, _ExportRound):
            return
        block_size = self._group.block_size
        for request_id, num_computed, num_preemptions in metadata.ends:
            export = self._exports.get(request_id)
            if export is None or export.request.num_preemptions != num_preemptions:
                continue  # finished (above) or aborted, or preempted since the round was scheduled
            end = min(num_computed // block_size * block_size, export.request.num_prompt_tokens)
            if end > export.num_sent:
                self._events.append(ExportedKV(request_id, self._gather(export, export.num_sent, end)))
                export.num_sent = end

    def get_finished(self) -> FinishedTransfers:
        finished = FinishedTransfers(saved=self._saved)
        self._saved = set()
        while not self._received.empty():
            request_id, kv, pieces = self._received.get_nowait()
            transfer = self._transfers.pop(request_id, None)
            if transfer is None:  # aborted meanwhile
                continue
            group = self._group
            for piece in pieces:
                scatter_kv(group.tensors, transfer.block_ids, group.block_size, piece.start, piece.end, piece.data)
            finished.loads[request_id] = FinishedLoad(sum(p.num_tokens for p in pieces), kv.first_token)
        return finished

    @property
    def has_finished(self) -> bool:
        return bool(self._saved) or not self._received.empty()

    def take_events(self) -> list[KVConnectorEvent]:
        events, self._events = self._events, []
        return events

    # -- consumer transfers --------------------------------------------------------------------
    def receive(self, request_id: str, kv: RemoteKV) -> int:
        """A transfer for a parked request ended; `kv` holds what arrived. Thread-safe: called by
        the connector's fetch in the event loop, or by a caller that drives transfers itself (a
        synchronous engine, tests). The engine's next step writes the KV kept and runs the request.
        Returns the number of tokens kept: all with the first token, else the whole pieces before
        the last prompt token."""
        transfer = self._transfers.get(request_id)
        if transfer is not None and (kv.start, kv.end) != (transfer.kv.start, transfer.kv.end):
            raise ValueError(
                f"expected the KV of tokens [{transfer.kv.start}, {transfer.kv.end}), got [{kv.start}, {kv.end})"
            )
        pieces = kv.pieces if kv.complete else kv.pieces_before(kv.end - 1)
        self._received.put((request_id, kv, pieces))
        self._wake()
        return sum(p.num_tokens for p in pieces)

    async def _fetch(self, transfer: _Transfer) -> None:
        """In the event loop: fetch the KV and first token, then hand them to the engine."""
        task, kv = transfer.task, transfer.kv
        with self._tracer.start_as_current_span("kv_transfer", context=transfer.trace_context) as span:
            span.set_attribute("moemesh.prefill_endpoint", task.endpoint)
            task = dataclasses.replace(task, metadata=telemetry.inject_metadata(telemetry.child_context(span)))
            started = time.monotonic()
            try:
                async with contextlib.aclosing(self.transport.fetch(task)) as received:
                    async for item in received:
                        kv.add(item)
                        if isinstance(item, KVPiece):
                            self.metrics.count_kv_bytes("received", item.data.numel())
            except Exception as e:  # noqa: BLE001 - any broken transfer: prefill the rest here
                num_kept = self.receive(task.request_id, kv)
                logger.warning(
                    "request %s: remote prefill failed after %d of %d tokens (%s); kept the KV of %d, "
                    "prefilling the other %d locally",
                    task.request_id,
                    kv.num_received_tokens,
                    kv.end - kv.start,
                    e,
                    num_kept,
                    kv.end - kv.start - num_kept,
                    exc_info=not isinstance(e, KVTransferError),
                )
                span.set_attribute("moemesh.fallback", True)
                span.set_attribute("moemesh.num_resumed_tokens", num_kept)
                self.metrics.kv_resumed_tokens.inc(num_kept)
                return
            span.set_attribute("moemesh.num_bytes", sum(p.data.numel() for p in kv.pieces))
            self.metrics.observe_kv_transfer(time.monotonic() - started)
            self.receive(task.request_id, kv)

    # -- producer ------------------------------------------------------------------------------
    def _gather(self, export: _Export, start: int, end: int) -> KVPiece:
        group = self._group
        data = gather_kv(group.tensors, export.block_ids, group.block_size, start, end)  # [num_bytes]
        return KVPiece(start, end - start, data)
