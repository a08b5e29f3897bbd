"""Continuous batching under a per-round token budget, with chunked prefill and preemption.

Each round picks S_t with sum(q_i) <= B_t: running requests first (their decode token, or the
next chunk of an unfinished prefill), then waiting requests FCFS while the budget, max_num_seqs
and free blocks allow. Scheduling a request advances its `num_computed_tokens` at once; a round
that reaches the end of a request's tokens adds an output placeholder, resolved by
`update_from_output`. With execution overlap the next round is scheduled before that: it
decodes at the placeholder's position (the runner, which runs rounds in order, knows the token
by then), so a request holds at most two placeholders. A running request that cannot get a block preempts the most recently
admitted running request (recompute: its blocks are freed, it returns to the head of the queue).

KV connector hooks (connectors/base.py): at admission the connector may claim tokens after the
prefix-cache hit. Claimed asynchronously, the request gets blocks for them and waits in
`waiting_for_kv` (status WAITING_FOR_EXTERNAL_KV, nothing scheduled, a `KVLoadStarted` event)
until `update_from_connector` reports its load: it then runs from the tokens that arrived (and the
first token, if the load brought one). Claimed synchronously, they count as computed at once. Each
round carries the connector's metadata; a finished request whose blocks the connector keeps for a
save waits in `kv_held` until `update_from_connector` reports it saved.
"""

from __future__ import annotations

import time
from collections import deque

from moemesh.engine.config import SchedulerConfig
from moemesh.engine.connectors.base import (
    FinishedTransfers,
    KVBlockIds,
    KVConnector,
    KVConnectorEvent,
    KVLoadFinished,
    KVLoadStarted,
    NullConnector,
)
from moemesh.engine.core.kv_cache_manager import KVCacheManager
from moemesh.engine.core.request import FinishReason, Request, RequestStatus
from moemesh.engine.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        kv_connector: KVConnector | None = None,
    ):
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_req_ids: set[str] = set()
        self._sent_to_runner: set[str] = set()  # ids whose full data the runner holds
        self.num_preemptions = 0
        self.kv_connector = kv_connector if kv_connector is not None else NullConnector()
        self.waiting_for_kv: dict[str, Request] = {}  # admitted, their KV being loaded by the connector
        self.kv_held: dict[str, Request] = {}  # finished, blocks kept until the connector has saved them
        self._events: list[KVConnectorEvent] = []  # loads started / finished, for the requests' streams

    # -- requests in and out -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, reason: FinishReason) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests in any state; frees their blocks
        (unless the connector keeps them for a save)."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_EXTERNAL_KV:
                del self.waiting_for_kv[request_id]
            else:
                self.waiting.remove(request)
            request.finish(reason)
            self._free(request)
            finished.append(request)
        return finished

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    @property
    def has_schedulable_requests(self) -> bool:
        """False when every unfinished request is waiting for external KV (nothing to step)."""
        return bool(self.waiting or self.running)

    # -- the connector's reports -------------------------------------------------------------
    def update_from_connector(self, finished: FinishedTransfers) -> list[Request]:
        """What the connector's worker half finished: saved requests' blocks are freed; a loaded
        request's KV is in its blocks, so its full blocks are keyed and it runs, from the tokens
        that arrived (the rest are computed here) or, if the load brought the first token, from
        that token (finishing if it ends the request). Returns the requests that got a token."""
        for request_id in finished.saved:
            request = self.kv_held.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
        updated = []
        for request_id, load in finished.loads.items():
            request = self.waiting_for_kv.pop(request_id, None)
            if request is None:  # aborted meanwhile
                continue
            request.num_computed_tokens += load.num_tokens
            self.kv.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            first = load.first_token
            self._events.append(KVLoadFinished(request_id, load.num_tokens, first is not None))
            if first is None:
                assert request.num_computed_tokens < request.num_tokens, "the last token is computed here"
                self.running.append(request)
                continue
            assert request.num_computed_tokens == request.num_tokens, "the first token follows the whole prompt"
            request.num_cached_tokens = max(request.num_cached_tokens, first.num_cached_tokens)
            request.output_token_ids.append(first.token_id)
            updated.append(request)
            reason = self._check_stop(request, first.token_id)
            if reason is not None:
                request.finish(reason)
                self._free(request)
            else:
                self.running.append(request)
        return updated

    def take_events(self) -> list[KVConnectorEvent]:
        """Loads started and finished since the last call (each request's in order)."""
        events, self._events = self._events, []
        return events

    # -- one round -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_known = request.num_tokens + request.num_output_placeholders
            num_new = min(num_known + len(request.spec_token_ids) - request.num_computed_tokens, budget)
            if num_new == 0 or self._ends_in_flight(request):  # nothing to compute / the pending token ends it
                i += 1
                continue
            while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = self.running.pop()  # most recently admitted, not yet scheduled
                self._preempt(victim)
                out.preempted_req_ids.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            num_spec = num_new - (num_known - request.num_computed_tokens)
            self._schedule(out, request, num_new, new_blocks)
            del request.spec_token_ids[max(num_spec, 0) :]  # the budget may cut the drafts short
            if request.spec_token_ids:
                out.scheduled_spec_token_ids[request.request_id] = list(request.spec_token_ids)
            budget -= num_new
            i += 1

        while self.waiting and budget > 0 and not out.preempted_req_ids:
            if len(self.running) + len(self.waiting_for_kv) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_external, load_async = self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)
            if load_async and num_external > 0:
                if not self._admit_to_load(request, hit_blocks, num_hit_tokens, num_external):
                    break
                continue
            # external tokens loaded synchronously count as computed; the rest is computed here
            num_new = request.num_tokens - num_hit_tokens - num_external
            assert num_new > 0, "the last token is computed here"
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            new_blocks = self.kv.allocate_slots(request, num_external + num_new, hit_blocks)
            if new_blocks is None:
                break
            self._admit(request, num_hit_tokens, num_external, RequestStatus.RUNNING)
            request.num_computed_tokens += num_external
            self.running.append(request)
            self._schedule(out, request, num_new, new_blocks)
            budget -= num_new
        out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out

    def _admit_to_load(self, request: Request, hit_blocks, num_hit_tokens: int, num_external: int) -> bool:
        """Allocate blocks for the external tokens (unkeyed until their KV is there) and park the
        request until the connector reports its load."""
        if self.kv.allocate_slots(request, num_external, hit_blocks, cache=False) is None:
            return False
        self._admit(request, num_hit_tokens, num_external, RequestStatus.WAITING_FOR_EXTERNAL_KV)
        self.waiting_for_kv[request.request_id] = request
        self._events.append(KVLoadStarted(request.request_id, num_hit_tokens, num_external))
        return True

    def _admit(self, request: Request, num_hit_tokens: int, num_external: int, status: RequestStatus) -> None:
        """The head of the queue got its blocks: it leaves the queue, and the connector learns them."""
        self.waiting.popleft()
        request.status = status
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:  # first admission
            request.num_cached_tokens = num_hit_tokens
            request.scheduled_time = time.monotonic()
        self.kv_connector.update_state_after_alloc(request, self._block_ids(request), num_external)

    def _block_ids(self, request: Request) -> KVBlockIds:
        return (self.kv.get_block_ids(request.request_id),)  # one cache group

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int, new_blocks) -> None:
        request_id = request.request_id
        if request_id in self._sent_to_runner:
            out.scheduled_cached_reqs.append(
                CachedRequestData(request_id, [b.block_id for b in new_blocks], request.num_computed_tokens)
            )
        else:
            out.scheduled_new_reqs.append(
                NewRequestData(
                    request_id,
                    request.all_token_ids,
                    request.sampling_params,
                    self.kv.get_block_ids(request_id),
                    request.num_computed_tokens,
                    request.num_output_tokens,
                    request.eos_token_id,
                )
            )
            self._sent_to_runner.add(request_id)
        out.num_scheduled_tokens[request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        # The round computes these tokens; if it reaches the end of the known ones (and the
        # drafts), it samples a token that is a placeholder until `update_from_output`.
        request.num_computed_tokens += num_new
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1

    def _ends_in_flight(self, request: Request) -> bool:
        """Overlap: the token a round in flight samples will end the request (max_tokens or the
        context), so a next round for it would be wasted."""
        n = request.num_output_placeholders
        return n > 0 and (
            request.num_output_tokens + n >= request.sampling_params.max_tokens
            or request.num_tokens + n >= self.max_model_len
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.num_output_placeholders = 0  # a round in flight for it is discarded
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._sent_to_runner.discard(request.request_id)
        self._finished_req_ids.add(request.request_id)  # the runner drops its copy
        self.waiting.appendleft(request)

    # -- after the model ran -----------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Resolve the round's placeholders: append sampled tokens (with speculation: the
        accepted drafts and one more), roll back the rejected drafts' computed tokens, and finish
        requests that hit EOS, a stop token, max_tokens or the context length. Requests that
        finished or were preempted since the round was scheduled are skipped (with overlap, a
        round may have computed one token too many for them). Returns the requests that got
        tokens."""
        updated = []
        for request_id in out.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            token_ids = sampled.get(request_id)
            num_spec = len(out.scheduled_spec_token_ids.get(request_id, ()))
            request.spec_token_ids = []
            if token_ids is None:  # a prefill chunk that did not reach the end
                continue
            request.num_output_placeholders -= 1
            # KV is valid for the last token and the accepted drafts; rejected slots get rewritten.
            request.num_computed_tokens -= num_spec - (len(token_ids) - 1)
            updated.append(request)
            for token_id in token_ids:
                request.output_token_ids.append(token_id)
                reason = self._check_stop(request, token_id)
                if reason is not None:
                    self.running.remove(request)
                    request.finish(reason)
                    self._free(request)
                    break
        return updated

    def _check_stop(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        if not params.ignore_eos and token_id == request.eos_token_id:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _free(self, request: Request) -> None:
        if self.kv_connector.request_finished(request, self._block_ids(request)):
            self.kv_held[request.request_id] = request  # freed once the connector has saved it
        else:
            self.kv.free(request)
        if request.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(request.request_id)
            self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
