"""The router's view of the workers: who is alive (registry), how loaded (registry + what this
router has in flight), and which prompt prefixes each holds (prefix index + recent routes).

Redis outages: when a registry poll or an index lookup fails, the pool logs once, keeps the last
worker list (plus static endpoints), skips index lookups and routes on its own view (in-flight
counts, recent routes) until a poll succeeds again; the view is then rebuilt from the registry.
A registry that lost its data (Redis restarted empty: not even this router's own record, `self_id`,
is listed) does not drop known workers at once: they get `missing_grace_s` to heartbeat again.
Otherwise a worker leaves the view as soon as its record expires, so readiness (`live`) follows
the registry's TTL.

Callers: the router's refresh task calls `run()`; the dispatcher calls `route(...)` per request,
`begin` / `end` around each call to a worker and `mark_down` when a worker fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import redis

from moemesh.contracts import registry
from moemesh.contracts.block_hash import BlockHash
from moemesh.contracts.prefix_index import PrefixIndex
from moemesh.router.policy import Candidate, RoutingPolicy

logger = logging.getLogger(__name__)

DECODE_ROLES = ("decode", "both")
PREFILL_ROLES = ("prefill", "both")


@dataclass
class WorkerState:
    worker_id: str
    role: str
    endpoint: str
    num_queued: int = 0  # from the last heartbeat
    num_blocks_used: int = 0  # from the last heartbeat
    in_flight: int = 0  # this router's requests on it
    active_blocks: int = 0  # KV blocks of this router's requests on it
    pending_prefill_blocks: int = 0  # uncached blocks of this router's requests it still has to prefill
    down_until: float = 0.0  # after a failure: not chosen before this time
    static: bool = False
    last_seen: float = 0.0  # when the registry last listed it
    heartbeat_at: float = 0.0  # its last heartbeat's stamp (the registry record's updated_at)
    failed_beat: float | None = None  # heartbeat_at when a call to it last failed

    def is_down(self, now: float, registry_ok: bool) -> bool:
        """Down for `down_s` after a failure; and while the registry answers, a worker it has
        listed (static or not) that failed stays down until it heartbeats again: a dead process
        never does, so it leaves the view (and readiness) instead of coming back every `down_s`.
        A static worker the registry never listed (no heartbeat) has only the `down_s` rule."""
        if self.down_until > now:
            return True
        return (
            registry_ok
            and self.heartbeat_at > 0
            and self.failed_beat is not None
            and self.heartbeat_at == self.failed_beat
        )


@dataclass(frozen=True)
class Route:
    decode: WorkerState
    prefill: WorkerState | None
    cached_blocks: int  # the decode worker's cached prefix (blocks), as the router saw it


@dataclass
class Charge:
    """What one request counts on its workers while in flight (see `begin`)."""

    blocks: int  # prompt blocks, on the decode worker until the request ends
    prefill_blocks: int  # uncached blocks, on the prefilling worker until the first token
    prefill_done: bool = False


class NoWorkerError(Exception):
    """No healthy decode worker (HTTP 503)."""


class RecentRoutes:
    """Block key -> {worker id: time} for chains this router sent recently: the KV a worker is
    about to hold, before its events reach the index. Bounded (LRU) and time-limited."""

    def __init__(self, max_blocks: int = 200_000, ttl_s: float = 30.0):
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._blocks: OrderedDict[BlockHash, dict[str, float]] = OrderedDict()

    def add(self, chain: Sequence[BlockHash], worker_id: str, now: float) -> None:
        for block_hash in chain:
            holders = self._blocks.get(block_hash)
            if holders is None:
                holders = self._blocks[block_hash] = {}
            else:
                self._blocks.move_to_end(block_hash)
            holders[worker_id] = now
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def longest_prefixes(self, chain: Sequence[BlockHash], now: float) -> dict[str, int]:
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        oldest = now - self.ttl_s
        for i, block_hash in enumerate(chain):
            holders = self._blocks.get(block_hash)
            if not holders:
                break
            alive = {w for w, t in holders.items() if t >= oldest and (alive is None or w in alive)}
            if not alive:
                break
            for w in alive:
                counts[w] = i + 1
        return counts

    def forget(self, worker_id: str) -> None:
        for holders in self._blocks.values():
            holders.pop(worker_id, None)


class WorkerPool:
    def __init__(
        self,
        client: redis.Redis,
        mesh: str,
        policy: RoutingPolicy,
        prefill_policy: RoutingPolicy,
        block_size: int,
        disaggregated: bool,
        static_decode: Sequence[str] = (),
        static_prefill: Sequence[str] = (),
        refresh_interval_s: float = 0.5,
        down_s: float = 5.0,
        missing_grace_s: float = 15.0,
        clock=time.monotonic,
        self_id: str | None = None,
    ):
        self.client = client
        self.mesh = mesh
        self.index = PrefixIndex(client, mesh)
        self.policy = policy
        self.prefill_policy = prefill_policy
        self.block_size = block_size
        self.disaggregated = disaggregated
        self.refresh_interval_s = refresh_interval_s
        self.down_s = down_s
        self.missing_grace_s = missing_grace_s
        self.clock = clock
        self.self_id = self_id  # this router's own registry record, the sign the registry is intact
        self.recent = RecentRoutes()
        self.workers: dict[str, WorkerState] = {}
        for role, endpoints in (("decode", static_decode), ("prefill", static_prefill)):
            for endpoint in endpoints:
                worker_id = "static-" + endpoint.replace(":", "-")
                self.workers[worker_id] = WorkerState(worker_id, role, endpoint, static=True)
        self.redis_ok = True
        self.num_refreshes = 0

    # -- the refresh task ------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_interval_s)

    async def refresh(self) -> None:
        try:
            records = await asyncio.to_thread(registry.list_workers, self.client, self.mesh)
            await asyncio.to_thread(self.index.reap_expired)
        except redis.RedisError as e:
            self._redis_failed(e)
            return
        if not self.redis_ok:
            logger.info("Redis is back: worker list and prefix index in use again")
            self.redis_ok = True
        self._apply_records(records)
        self.num_refreshes += 1

    def _apply_records(self, records: list[registry.WorkerRecord]) -> None:
        seen = set()
        by_endpoint = {w.endpoint: w for w in self.workers.values() if w.static}
        for record in records:
            if record.role not in DECODE_ROLES + PREFILL_ROLES:
                continue
            static = by_endpoint.get(record.endpoint)
            if static is not None:  # the registry names a static worker: use its real id
                del self.workers[static.worker_id]
            state = self.workers.get(record.worker_id)
            if state is None or state.endpoint != record.endpoint:
                state = self.workers[record.worker_id] = WorkerState(record.worker_id, record.role, record.endpoint)
                if static is not None:
                    state.static = True
            state.num_queued = record.num_queued
            state.num_blocks_used = record.num_blocks_used
            state.heartbeat_at = record.updated_at
            state.last_seen = self.clock()
            seen.add(record.worker_id)
        lost = not records or (self.self_id is not None and all(r.worker_id != self.self_id for r in records))
        grace = self.missing_grace_s if lost else 0.0  # Redis may have lost its data
        now = self.clock()
        for worker_id, state in list(self.workers.items()):
            if worker_id in seen or state.static or state.in_flight or now - state.last_seen < grace:
                continue
            del self.workers[worker_id]
            self.recent.forget(worker_id)

    def _redis_failed(self, error: Exception) -> None:
        if self.redis_ok:
            logger.warning("Redis unreachable (%s); routing on the router's own view until it returns", error)
            self.redis_ok = False

    # -- routing ---------------------------------------------------------------------------
    def live(self, roles: tuple[str, ...], exclude: Collection[str] = frozenset()) -> list[WorkerState]:
        now = self.clock()
        return [
            w
            for w in self.workers.values()
            if w.role in roles and not w.is_down(now, self.redis_ok) and w.worker_id not in exclude
        ]

    async def cached_prefixes(self, chain: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker id: leading blocks of `chain` it holds (index, merged with recent routes)."""
        cached = self.recent.longest_prefixes(chain, self.clock())
        if self.redis_ok and chain:
            try:
                indexed = await asyncio.to_thread(self.index.longest_prefixes, chain)
            except redis.RedisError as e:
                self._redis_failed(e)
            else:
                for worker_id, count in indexed.items():
                    cached[worker_id] = max(count, cached.get(worker_id, 0))
        return cached

    def choose(
        self,
        chain: Sequence[BlockHash],
        num_prompt_tokens: int,
        cached: dict[str, int],
        exclude: Collection[str] = frozenset(),
    ) -> Route:
        """Pure decision over the current view (no I/O); raises NoWorkerError."""
        decode = self.live(DECODE_ROLES, exclude)
        if not decode:
            raise NoWorkerError("no healthy decode worker")
        num_blocks = -(-num_prompt_tokens // self.block_size)
        chosen = self._pick(self.policy, decode, cached, num_blocks)
        prefill = None
        if self.disaggregated:
            candidates = [w for w in self.live(PREFILL_ROLES, exclude) if w.worker_id != chosen.worker_id]
            if candidates:
                prefill = self._pick(self.prefill_policy, candidates, cached, num_blocks)
        return Route(chosen, prefill, cached.get(chosen.worker_id, 0))

    def _pick(self, policy, workers: list[WorkerState], cached: dict[str, int], num_blocks: int) -> WorkerState:
        candidates = [
            Candidate(
                w.worker_id,
                cached.get(w.worker_id, 0),
                w.active_blocks,
                w.num_queued,
                w.in_flight,
                w.pending_prefill_blocks,
            )
            for w in workers
        ]
        picked = policy.choose(candidates, num_blocks)
        return next(w for w in workers if w.worker_id == picked.worker_id)

    # -- accounting ------------------------------------------------------------------------
    def begin(self, route: Route, chain: Sequence[BlockHash], num_prompt_tokens: int, cached: dict[str, int]) -> Charge:
        """Count a request on its workers until `end_prefill` / `end`: its prompt blocks on the
        decode worker, its uncached blocks on the worker that prefills it (the prefill worker
        when there is one, else the decode worker)."""
        blocks = math.ceil(num_prompt_tokens / self.block_size)
        prefilling = route.prefill or route.decode
        charge = Charge(blocks, max(blocks - cached.get(prefilling.worker_id, 0), 0))
        route.decode.in_flight += 1
        route.decode.active_blocks += blocks
        if route.prefill is not None:
            route.prefill.in_flight += 1
        prefilling.pending_prefill_blocks += charge.prefill_blocks
        now = self.clock()
        for worker in (route.decode, route.prefill):
            if worker is not None:
                self.recent.add(chain, worker.worker_id, now)
        return charge

    def end_prefill(self, route: Route, charge: Charge) -> None:
        """The request's prefill is over (first token received, or it ended)."""
        if charge.prefill_done:
            return
        charge.prefill_done = True
        (route.prefill or route.decode).pending_prefill_blocks -= charge.prefill_blocks
        if route.prefill is not None:
            route.prefill.in_flight -= 1

    def end(self, route: Route, charge: Charge) -> None:
        self.end_prefill(route, charge)
        route.decode.in_flight -= 1
        route.decode.active_blocks -= charge.blocks

    def mark_down(self, worker: WorkerState) -> None:
        worker.down_until = self.clock() + self.down_s
        worker.failed_beat = worker.heartbeat_at  # only a newer heartbeat (any stamp: no clock skew) clears it
        self.recent.forget(worker.worker_id)
        logger.warning(
            "worker %s (%s) failed; not routing to it for %.0f s", worker.worker_id, worker.endpoint, self.down_s
        )
