"""The KV connector interface: everything that moves KV into or out of the engine's paged cache
(remote prefill between workers, offload tiers in host RAM, on disk or in a shared store) is one
`KVConnector`, called by the scheduler and the engine at fixed points (vLLM's
`KVConnectorBase_V1` is the model). Neither knows what a connector does.

A connector has two halves. The **scheduler half** decides: how many tokens of a request, after
its local prefix-cache hit, can come from outside and whether they arrive asynchronously; what to
remember once blocks are allocated for them; whether a finished request's blocks must stay
allocated until a save has read them; and, once per round, what the worker half must do (its
`KVConnectorMetadata`). The **worker half** moves bytes between the source and the paged KV and
reports which requests' loads and saves have finished. Both halves live on one object here (the
scheduler and the model runner share the engine's process); they are called:

    admission   Scheduler.schedule: get_num_new_matched_tokens, then update_state_after_alloc
    each round  Scheduler.schedule: build_connector_meta (-> SchedulerOutput.kv_connector_metadata)
                LLMEngine, on the thread that runs the round, just before it: start_load_kv
                LLMEngine, once the round's outputs are processed: save_kv
    each step   LLMEngine, at its start and after each round: get_finished -> Scheduler.update_from_connector
    finish      Scheduler, once per request, before its blocks are freed: request_finished

Asynchronous loads: the scheduler allocates blocks for the external tokens and parks the request in
WAITING_FOR_EXTERNAL_KV, scheduling nothing for it, until `get_finished` reports its load. A load
may deliver fewer tokens than it claimed (the rest are computed locally, in the same blocks) and,
when the source computed the whole prompt, the token after it (a remote prefill's first token).
Synchronous loads count as computed at admission; `start_load_kv` writes them before the round
that reads them runs. Saves: a connector that keeps a finished request's blocks (`request_finished`
returns True) reports the request in `FinishedTransfers.saved` once it has read them; the scheduler
frees them then.

Cache groups: a request holds one block table per KV cache group (docs/architecture.md); block ids
travel as `KVBlockIds` (one list per group, in group order) and the paged KV as one `KVCacheGroup`
per group. Every model has one group today.

Layering: connectors sit below the scheduler and do not import `engine.core`; they read a request
and a round through the `ConnectorRequest` and `ScheduledRound` protocols.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moemesh.contracts.finish_reason import FinishReason

KVBlockIds = tuple[list[int], ...]  # a request's block ids, one list per KV cache group


@dataclass(frozen=True)
class KVCacheGroup:
    """The paged KV of the layers of one cache group."""

    block_size: int
    tensors: tuple[torch.Tensor, ...]  # per cache tensor, in layer order: [num_blocks, block_size, *token_shape]


@dataclass(frozen=True)
class KVCaches:
    """The engine's paged KV, handed to its connector once the model is built."""

    model_id: str
    groups: tuple[KVCacheGroup, ...]  # one per cache group


def kv_caches(model, model_id: str, block_size: int) -> KVCaches:
    """The model's KV cache tensors as cache groups (one group: every attention layer). Attention
    layers bind `k_cache` and `v_cache`; MLA layers one `kv_cache`."""
    tensors = []
    for layer in model.attention_layers():
        tensors.extend([layer.k_cache, layer.v_cache] if hasattr(layer, "k_cache") else [layer.kv_cache])
    return KVCaches(model_id, (KVCacheGroup(block_size, tuple(tensors)),))


class KVTransferParams:
    """Base of a connector's per-request parameters (`Request.kv_transfer_params`): set by whoever
    adds the request (a worker servicer), read by the connector only; the engine carries them."""


class KVConnectorMetadata:
    """Base of what the scheduler half tells the worker half about one round."""


NO_METADATA = KVConnectorMetadata()


@dataclass(frozen=True)
class FirstToken:
    """The token after an externally computed prompt, sampled where its KV was computed."""

    token_id: int
    logprob: Any  # its core.request.Logprob, or None when logprobs were not asked for
    num_cached_tokens: int  # prompt tokens the source served from its own prefix cache


@dataclass(frozen=True)
class FinishedLoad:
    """An asynchronous load that ended (completely or not)."""

    num_tokens: int  # tokens after the request's computed ones whose KV is now in its blocks
    first_token: FirstToken | None = None  # the source computed the whole prompt: its next token


@dataclass
class FinishedTransfers:
    """What the worker half finished since its last report."""

    loads: dict[str, FinishedLoad] = field(default_factory=dict)  # request id -> its load
    saved: set[str] = field(default_factory=set)  # held requests whose blocks may be freed

    def __bool__(self) -> bool:
        return bool(self.loads or self.saved)


@dataclass(frozen=True)
class KVConnectorEvent:
    """Something about one request that its stream reports (the AsyncEngine delivers a step's
    connector events before the step's outputs). Connectors may define their own."""

    request_id: str


@dataclass(frozen=True)
class KVLoadStarted(KVConnectorEvent):
    """The request waits for external KV: its blocks are allocated, nothing is scheduled for it."""

    num_computed_tokens: int  # its local prefix-cache hit
    num_external_tokens: int  # claimed by the connector, after those


@dataclass(frozen=True)
class KVLoadFinished(KVConnectorEvent):
    """The request's load ended; it runs from here (its first token, if any, comes next)."""

    num_tokens: int  # tokens whose KV the load wrote (the rest of the claimed ones are computed here)
    with_first_token: bool  # the source computed the whole prompt and sampled the next token


class ConnectorRequest(Protocol):
    """What a connector reads of a request (core.request.Request)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[Any]
    num_computed_tokens: int  # KV in the cache (at admission: the prefix-cache hit)
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: FinishReason | None
    kv_transfer_params: KVTransferParams | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class ScheduledRound(Protocol):
    """What a connector reads of a round (core.scheduler_output.SchedulerOutput): the requests it
    computes, new ones with their block ids in full, the others with the blocks added (group 0)."""

    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list  # NewRequestData: request_id, block_ids
    scheduled_cached_reqs: list  # CachedRequestData: request_id, new_block_ids


class KVConnector(abc.ABC):
    """Both halves of one connector; each method says who calls it and when."""

    # -- scheduler half: called by the Scheduler on the engine's caller thread ------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Called when the scheduler considers admitting a waiting request, after its prefix-cache
        lookup found `num_computed_tokens`. Returns how many tokens after those the connector can
        supply, and whether they arrive asynchronously (the request then waits for them, parked)
        or are loaded before the round that admits it (then fewer than the remaining tokens: the
        last one is computed here). Side-effect free: the scheduler may ask again when the
        admission failed for lack of blocks."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: KVBlockIds, num_external_tokens: int
    ) -> None:
        """Called once per admission (also a preempted request's), after the request's blocks were
        allocated: `block_ids` are all of them, `request.num_computed_tokens` its prefix-cache hit,
        `num_external_tokens` what `get_num_new_matched_tokens` claimed (0: nothing to load)."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: ScheduledRound) -> KVConnectorMetadata:
        """Called at the end of each `schedule()`: what the worker half does for this round (the
        engine hands it to `start_load_kv` and `save_kv`). Does not change the round."""

    @abc.abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: KVBlockIds) -> bool:
        """Called once when a request finishes (any reason, abort included; a load of it may be in
        flight), before its blocks are freed. True: the connector saves or sends its KV; the
        scheduler keeps the blocks until `get_finished` lists the request in `saved`."""

    def check_request(self, request: ConnectorRequest) -> None:  # noqa: B027 - most connectors check nothing
        """Called by `LLMEngine.add_request` before the request is queued: raise InvalidRequestError
        when its `kv_transfer_params` do not fit it."""

    # -- worker half: called by the LLMEngine ---------------------------------------------------
    def register_kv_caches(self, caches: KVCaches) -> None:  # noqa: B027 - a connector that moves no KV
        """Called once the model is built (and when the connector is plugged in): the paged KV."""

    def bind(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:  # noqa: B027
        """Called by the AsyncEngine on its engine thread once the engine is built: the event loop
        where the connector may run its I/O (`asyncio.run_coroutine_threadsafe`), and a thread-safe
        callback that wakes the engine thread when a transfer finished while it idles. A
        synchronous engine (the offline LLM) never calls it."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Called before each round runs, on the thread that runs it (the runner thread with
        execution overlap), with that round's metadata: write the synchronous loads, start the
        asynchronous ones that need a round's ordering."""

    @abc.abstractmethod
    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        """Called on the caller thread once a round's outputs are processed, with that round's
        metadata: the KV it computed is in the cache (the next round, maybe already running, only
        writes after it), and the requests it finished were passed to `request_finished`."""

    @abc.abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Called on the caller thread at the start of each step and after each round: the loads
        and saves that finished since the last call. A load's KV must be in its blocks by then."""

    @property
    def has_finished(self) -> bool:
        """Thread-safe: `get_finished` would report something (the engine steps to collect it)."""
        return False

    def take_events(self) -> list[KVConnectorEvent]:
        """The connector's own events since the last call, for the requests' streams."""
        return []


class NullConnector(KVConnector):
    """No KV moves in or out: every token is computed here and blocks are freed at once."""

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: KVBlockIds, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: ScheduledRound) -> KVConnectorMetadata:
        return NO_METADATA

    def request_finished(self, request: ConnectorRequest, block_ids: KVBlockIds) -> bool:
        return False

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        return None

    def save_kv(self, metadata: KVConnectorMetadata) -> None:
        return None

    def get_finished(self) -> FinishedTransfers:
        return FinishedTransfers()
