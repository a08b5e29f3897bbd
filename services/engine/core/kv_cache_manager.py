"""Per-request block tables on top of the block pool, with hash-chained prefix reuse.

Addressing: token position t lives in logical block b = t // P at offset t % P, in physical block
block_table[b]. Only full blocks are cached; a hit never covers a request's last token (it must
be computed to produce logits).

Callers: the scheduler calls `get_computed_blocks` once when it admits a waiting request,
`allocate_slots` each round it schedules a request, and `free` when a request finishes or is
preempted. For a remote prefill it allocates with `cache=False` (the blocks are not computed yet)
and calls `cache_blocks` once the KV has arrived. The worker's engine thread drains `events`
(blocks stored / evicted) after each step for the prefix index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.contracts.block_hash import BlockHash, HashExtra, hash_block_chain
from moemesh.engine.core.block_pool import BlockPool, KVCacheBlock
from moemesh.engine.core.request import Request


@dataclass
class KVEvents:
    """Net prefix-cache changes since the last drain: stored (True) / removed (False) per key;
    `cleared` means every key was dropped first (the index must resync)."""

    changes: dict[BlockHash, bool] = field(default_factory=dict)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.changes) or self.cleared


class _RecordingBlockMap(dict):
    """The block pool's hash -> block map, recording every key stored or evicted into `events`.
    (BlockPool writes it with `[]=`, `del` and `clear()` only.)"""

    def __init__(self, events: KVEvents):
        super().__init__()
        self.events = events

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.events.changes[key] = True

    def __delitem__(self, key):
        super().__delitem__(key)
        self.events.changes[key] = False

    def clear(self):
        super().clear()
        self.events.changes.clear()
        self.events.cleared = True


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, extra: HashExtra):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra = extra
        self.pool = BlockPool(num_blocks, enable_caching)
        self.events = KVEvents()
        self.pool.cached_blocks = _RecordingBlockMap(self.events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already keyed
        self.stats = PrefixCacheStats()

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / (len(self.pool.blocks) - 1)

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every key in the prefix cache now (a full snapshot for an index resync)."""
        return list(self.pool.cached_blocks)

    def drain_events(self) -> KVEvents:
        """Changes since the last drain; called by the worker's engine thread after each step."""
        events = KVEvents(dict(self.events.changes), self.events.cleared)
        self.events.changes.clear()
        self.events.cleared = False
        return events

    # -- the scheduler's calls ---------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a waiting request: (blocks, number of tokens)."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.num_queries += request.num_tokens
        self.stats.num_hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = (),
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (its own computed
        tokens plus `new_computed_blocks`, a prefix hit). Returns the newly allocated blocks, or
        None, changing nothing, when the pool cannot supply them. `cache=False` leaves the new
        full blocks unkeyed (their KV comes later from a prefill worker; see `cache_blocks`)."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        num_hits_from_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_hits_from_free:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if self.enable_caching and cache:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Key the request's full blocks among its first `num_tokens` tokens (their KV is there now)."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    # -- internals ---------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        """Extend the request's key chain over its full blocks of known tokens."""
        num_full = request.num_tokens // self.block_size
        have = len(request.block_hashes)
        if have < num_full:
            parent = request.block_hashes[-1] if have else None
            tokens = request.all_token_ids[: num_full * self.block_size]
            request.block_hashes.extend(
                hash_block_chain(tokens, self.block_size, self.extra, parent=parent, start=have * self.block_size)
            )

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, num_full)
