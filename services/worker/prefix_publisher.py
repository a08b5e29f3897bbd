"""Worker side of the prefix index: batch the engine's block stored/evicted events into Redis.

Callers (all in the worker's asyncio loop):
- the engine thread's event hand-off calls `add(events)` after every step with changes
  (`events.changes`: block key -> stored True / removed False, `events.cleared`);
- the worker runs `run()` as a task: every `flush_interval_s` it sends the pending changes as
  batch seq + 1, or a full snapshot (`resync`) when the index asked for one: at start-up, after a
  gap (a batch lost while Redis was unreachable), a new epoch (this process restarted) or an
  index reset (Redis lost its data; noticed by `apply_batch` or the heartbeat's `touch`);
- the heartbeat calls `heartbeat()`; shutdown calls `close()` (removes this worker's entries).

Redis calls are blocking and run in a thread. While Redis is unreachable batches are dropped
(the seq still advances, so the next successful write sees a gap and resyncs); the error is
logged once per outage.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

import redis

from moemesh.contracts.block_hash import BlockHash
from moemesh.contracts.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

Snapshot = Callable[[], Awaitable[list[BlockHash]]]


class PrefixIndexPublisher:
    def __init__(
        self,
        index: PrefixIndex,
        worker_id: str,
        block_size: int,
        model_id: str,
        snapshot: Snapshot,
        ttl_s: float,
        flush_interval_s: float = 0.02,
    ):
        self.index = index
        self.worker_id = worker_id
        self.block_size = block_size
        self.model_id = model_id
        self.snapshot = snapshot
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self.num_resyncs = 0
        self._pending: dict[BlockHash, bool] = {}
        self._need_resync = True
        self._redis_ok = True
        self._wake = asyncio.Event()
        self._closed = False

    # -- engine events ---------------------------------------------------------------------
    def add(self, events) -> None:
        if events.cleared:
            self._pending.clear()
            self._need_resync = True
        self._pending.update(events.changes)
        self._wake.set()

    # -- the flush task --------------------------------------------------------------------
    async def run(self) -> None:
        while not self._closed:
            await self.flush()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(self.flush_interval_s, 0.5))
            except TimeoutError:
                pass
            self._wake.clear()
            await asyncio.sleep(self.flush_interval_s)  # gather a batch

    async def flush(self) -> None:
        """Send what is pending now (a resync if one is due)."""
        if self._need_resync:
            self._pending.clear()  # the snapshot covers every change so far
            hashes = await self.snapshot()
            if (
                await self._call(
                    self.index.resync, self.worker_id, self.epoch, hashes, self.block_size, self.model_id, self.ttl_s
                )
                is not None
            ):
                self.seq = 0
                self.num_resyncs += 1
                self._need_resync = False
            return
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        self.seq += 1
        stored = [h for h, present in batch.items() if present]
        removed = [h for h, present in batch.items() if not present]
        applied = await self._call(
            self.index.apply_batch, self.worker_id, self.epoch, self.seq, stored, removed, self.ttl_s
        )
        if applied is False:
            logger.info(
                "prefix index: batch %d of %s not applied (gap, restart or reset); resyncing", self.seq, self.worker_id
            )
            self._need_resync = True
            self._wake.set()

    async def heartbeat(self) -> None:
        """Extend this worker's expiry in the index (resync if its entries are gone)."""
        if (
            not self._need_resync
            and await self._call(self.index.touch, self.worker_id, self.epoch, self.ttl_s) is False
        ):
            self._need_resync = True
            self._wake.set()

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        await self._call(self.index.remove_worker, self.worker_id)

    async def _call(self, fn, *args):
        """Run a Redis call in a thread; None if Redis is unreachable or refused it (logged once
        per outage). Anything else is a bug here and propagates."""
        try:
            result = await asyncio.to_thread(fn, *args)
        except (redis.RedisError, OSError) as e:  # connection refused/reset, timeouts, server errors
            if self._redis_ok:
                logger.warning("prefix index: Redis unreachable (%s); batches are dropped until it returns", e)
                self._redis_ok = False
            return None
        if not self._redis_ok:
            logger.info("prefix index: Redis is back")
            self._redis_ok = True
        return result
