"""Routing policies: pick one worker among candidates. Pure and fast (no I/O): the caller has
already looked up each candidate's cached prefix and load.

kv_aware (the default) minimizes, over candidates w,

    cost(w) = prefill_weight * prefill_blocks(w) + decode_blocks(w) + queue_weight * num_queued(w)

    prefill_blocks(w) = num_prompt_blocks - cached_blocks(w)   blocks w would have to prefill for it
                        + pending_prefill_blocks(w)            and the uncached blocks it is prefilling
    decode_blocks(w)  = active_blocks(w)                       KV blocks of this router's requests in flight on w
    num_queued(w)     = requests waiting for admission on w (registry heartbeat: every router's load)

with cached_blocks(w) the longest consecutive prefix of the prompt's block-key chain that w holds
(prefix index in Redis, merged with the router's record of where it recently sent each chain).
This is Dynamo's KV router cost (overlap weight * potential prefill blocks + potential decode blocks,
where the prefill term also counts the worker's outstanding prefills) plus a queue
term in the spirit of llm-d's weighted queue scorer. Defaults: prefill_weight 2 (Dynamo uses 1;
on the shared-prefix benchmark 2 keeps ~96% of the possible hits and cuts mean TTFT ~3x vs
round_robin, where 1 moved too many requests off the worker holding their prefix), queue_weight
4. Higher prefill_weight favours cache hits (TTFT), lower favours balance (ITL); queue_weight 0
ignores the registry's queue lengths. Ties go
to the longer cached prefix, then to the fewest requests in flight, then round robin.

round_robin cycles through the candidates; least_loaded picks the fewest requests in flight plus
queued (ties: fewer active blocks, then round robin). Neither looks at the cache.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from moemesh.router.settings import RoutingSettings


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    cached_blocks: int  # leading prompt blocks this worker holds
    active_blocks: int  # KV blocks of its requests in flight
    num_queued: int  # waiting for admission (from its heartbeat)
    in_flight: int  # requests this router has in flight on it
    pending_prefill_blocks: int = 0  # uncached blocks of those it has not finished prefilling


class RoutingPolicy(abc.ABC):
    """Called by the router once per request (and per retry) with the live candidates."""

    name: str

    def __init__(self):
        self._turn = itertools.count()

    @abc.abstractmethod
    def choose(self, candidates: Sequence[Candidate], num_prompt_blocks: int) -> Candidate:
        """The chosen candidate; `candidates` is non-empty."""

    def _rotate(self, candidates: Sequence[Candidate]) -> Candidate:
        return candidates[next(self._turn) % len(candidates)]


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def choose(self, candidates, num_prompt_blocks):
        return self._rotate(candidates)


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def choose(self, candidates, num_prompt_blocks):
        best = min((c.in_flight + c.num_queued, c.active_blocks) for c in candidates)
        tied = [c for c in candidates if (c.in_flight + c.num_queued, c.active_blocks) == best]
        return self._rotate(tied)


class KVAware(RoutingPolicy):
    name = "kv_aware"

    def __init__(self, prefill_weight: float = 2.0, queue_weight: float = 4.0):
        super().__init__()
        self.prefill_weight = prefill_weight
        self.queue_weight = queue_weight

    def cost(self, candidate: Candidate, num_prompt_blocks: int) -> float:
        prefill_blocks = max(num_prompt_blocks - candidate.cached_blocks, 0) + candidate.pending_prefill_blocks
        return self.prefill_weight * prefill_blocks + candidate.active_blocks + self.queue_weight * candidate.num_queued

    def choose(self, candidates, num_prompt_blocks):
        keys = [(self.cost(c, num_prompt_blocks), -c.cached_blocks, c.in_flight) for c in candidates]
        best = min(keys)
        tied = [c for c, key in zip(candidates, keys) if key == best]
        return tied[0] if len(tied) == 1 else self._rotate(tied)


def make_policy(settings: RoutingSettings) -> RoutingPolicy:
    if settings.policy == "round_robin":
        return RoundRobin()
    if settings.policy == "least_loaded":
        return LeastLoaded()
    return KVAware(settings.prefill_weight, settings.queue_weight)
