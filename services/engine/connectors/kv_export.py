"""Prefill worker: hands out the KV of requests with `kv_export_start` as their prefill progresses.

A prefill request computes its prompt over several rounds (chunked prefill under the token
budget). After each round, `take()` gathers the tokens that round completed, in whole blocks, so
P's servicer can stream them while the next rounds run; once the request has finished (its one
output token sampled), the tail and the first token follow and its blocks are freed.

"Completed" counts only rounds whose outputs were processed: with execution overlap the
scheduler has already advanced `num_computed_tokens` past a round still running, so the exporter
tracks each round's end itself (`record_round`). Whole blocks only, so a block the next round is
still writing is never read. A preempted request recomputes from its prefix; tokens already
handed out are not sent again.

Caller: the LLMEngine, on its caller's thread (`record_round` after each round's outputs are
processed, `take` between steps, `forget` when requests are aborted).
"""

from __future__ import annotations

import torch

from moemesh.engine.connectors.kv_transfer import ExportedKV, FirstToken, KVPiece, gather_kv
from moemesh.engine.core.request import RequestStatus
from moemesh.engine.core.scheduler import Scheduler
from moemesh.engine.core.scheduler_output import SchedulerOutput


class KVExporter:
    def __init__(self, scheduler: Scheduler, tensors: list[torch.Tensor]):
        self.scheduler = scheduler
        self.tensors = tensors  # the cache tensors, in layer order
        self._num_ready: dict[str, int] = {}  # request id -> tokens whose KV processed rounds wrote
        self._num_sent: dict[str, int] = {}  # request id -> end of the KV handed out so far

    def record_round(self, out: SchedulerOutput) -> None:
        """A round's outputs were processed: its running export requests hold KV up to its end."""
        starts = {r.request_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        starts.update((r.request_id, r.num_computed_tokens) for r in out.scheduled_cached_reqs)
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.kv_export_start is not None and request.status == RequestStatus.RUNNING:
                self._num_ready[request_id] = starts[request_id] + num_tokens

    def take(self) -> list[ExportedKV]:
        """The KV completed since the last call: whole blocks of running requests, and the rest
        plus the first token of finished ones (whose blocks are freed here)."""
        exports = []
        for request_id, request in list(self.scheduler.kv_held.items()):
            start = self._num_sent.pop(request_id, request.kv_export_start)
            self._num_ready.pop(request_id, None)
            logprob = request.output_logprobs[0] if request.output_logprobs else None
            first = FirstToken(request.output_token_ids[0], logprob, max(request.num_cached_tokens, 0))
            exports.append(ExportedKV(request_id, self._gather(request_id, start, request.num_prompt_tokens), first))
            self.scheduler.release_held(request_id)
        block_size = self.scheduler.kv.block_size
        for request_id, num_ready in list(self._num_ready.items()):
            request = self.scheduler.requests.get(request_id)
            if request is None:  # finished without a hold (aborted)
                self.forget([request_id])
                continue
            start = self._num_sent.get(request_id, request.kv_export_start)
            end = min(num_ready // block_size * block_size, request.num_prompt_tokens)
            if end > start and request.status == RequestStatus.RUNNING:
                exports.append(ExportedKV(request_id, self._gather(request_id, start, end)))
                self._num_sent[request_id] = end
        return exports

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._num_ready.pop(request_id, None)
            self._num_sent.pop(request_id, None)

    def _gather(self, request_id: str, start: int, end: int) -> KVPiece:
        kv = self.scheduler.kv
        data = gather_kv(self.tensors, kv.get_block_ids(request_id), kv.block_size, start, end)  # [num_bytes]
        return KVPiece(start, end - start, data)
