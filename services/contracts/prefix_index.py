"""Prefix index in Redis: which workers hold which KV blocks, so the router can send a request to
the worker with the longest cached prefix.

Keys (all under ``moemesh:{mesh}:kv:``; ``{h}`` is a block key's hex digest):

    kv:block:{h}          SET   worker ids holding block h
    kv:worker:{id}        SET   hex keys worker id holds (for resync and cleanup)
    kv:meta:{id}          HASH  epoch, seq, block_size, model_id of the worker's last write
    kv:workers            ZSET  worker id -> expiry (unix seconds), refreshed by every write

Protocol. A worker's engine reports block stored/evicted events; its `PrefixIndexPublisher`
sends them in batches, each numbered seq = previous + 1 within the worker's epoch (a random id per
process start). `apply_batch` (one Lua script, atomic) applies a batch only if the stored epoch
matches and the stored seq is exactly seq - 1; otherwise (a lost batch = a gap, a restarted
worker = a new epoch, or an index reset = Redis lost its data) it returns False and the worker
resyncs: `resync` replaces everything the worker has in the index with a full snapshot and starts
seq at 0. Entries of a worker whose expiry passed (it stopped writing and heartbeating) are
removed by `reap_expired`, which routers and workers call periodically; a stopping worker calls
`remove_worker`. The router additionally ignores workers the registry does not list.

Lookup (router): `longest_prefixes` sends the request's key chain in one script call (one round
trip) and gets, per worker, the number of leading blocks of the chain it holds consecutively.
(The scripts build key names from a prefix, so the index needs a single Redis, not a cluster.)

Callers: workers call `resync` at start-up, `apply_batch` per batch, `touch` on every heartbeat
and `remove_worker` at shutdown; routers call `longest_prefixes` per request and `reap_expired`
on their refresh timer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis

from moemesh.contracts import redis_keys
from moemesh.contracts.block_hash import BlockHash

Clock = redis_keys.Clock


def index_prefix(mesh: str) -> str:
    return f"{redis_keys.mesh_prefix(mesh)}:kv:"


def block_key(mesh: str, block_hash: BlockHash) -> str:
    return f"{index_prefix(mesh)}block:{block_hash.hex()}"


def worker_blocks_key(mesh: str, worker_id: str) -> str:
    return f"{index_prefix(mesh)}worker:{worker_id}"


def meta_key(mesh: str, worker_id: str) -> str:
    return f"{index_prefix(mesh)}meta:{worker_id}"


def workers_key(mesh: str) -> str:
    return f"{index_prefix(mesh)}workers"


# KEYS: none (single-instance Redis). ARGV[1] = index prefix.
_DROP_WORKER = """
local function drop_worker(prefix, worker)
  local wkey = prefix .. 'worker:' .. worker
  local hashes = redis.call('SMEMBERS', wkey)
  for _, h in ipairs(hashes) do
    local bkey = prefix .. 'block:' .. h
    redis.call('SREM', bkey, worker)
  end
  redis.call('DEL', wkey, prefix .. 'meta:' .. worker)
  redis.call('ZREM', prefix .. 'workers', worker)
  return #hashes
end
"""

# ARGV: prefix, worker, epoch, block_size, model_id, expiry, hashes...
_RESYNC = (
    _DROP_WORKER
    + """
local prefix, worker = ARGV[1], ARGV[2]
drop_worker(prefix, worker)
local wkey = prefix .. 'worker:' .. worker
for i = 7, #ARGV do
  redis.call('SADD', prefix .. 'block:' .. ARGV[i], worker)
  redis.call('SADD', wkey, ARGV[i])
end
redis.call('HSET', prefix .. 'meta:' .. worker, 'epoch', ARGV[3], 'seq', 0, 'block_size', ARGV[4], 'model_id', ARGV[5])
redis.call('ZADD', prefix .. 'workers', ARGV[6], worker)
return #ARGV - 6
"""
)

# ARGV: prefix, worker, epoch, seq, expiry, num_stored, stored..., removed...
_APPLY = """
local prefix, worker = ARGV[1], ARGV[2]
local mkey = prefix .. 'meta:' .. worker
local meta = redis.call('HMGET', mkey, 'epoch', 'seq')
if meta[1] ~= ARGV[3] or tonumber(meta[2]) ~= tonumber(ARGV[4]) - 1 then
  return 0
end
local wkey = prefix .. 'worker:' .. worker
local num_stored = tonumber(ARGV[6])
for i = 7, 6 + num_stored do
  redis.call('SADD', prefix .. 'block:' .. ARGV[i], worker)
  redis.call('SADD', wkey, ARGV[i])
end
for i = 7 + num_stored, #ARGV do
  redis.call('SREM', prefix .. 'block:' .. ARGV[i], worker)
  redis.call('SREM', wkey, ARGV[i])
end
redis.call('HSET', mkey, 'seq', ARGV[4])
redis.call('ZADD', prefix .. 'workers', ARGV[5], worker)
return 1
"""

# ARGV: prefix, worker, epoch, expiry
_TOUCH = """
local prefix, worker = ARGV[1], ARGV[2]
if redis.call('HGET', prefix .. 'meta:' .. ARGV[2], 'epoch') ~= ARGV[3] then
  return 0
end
redis.call('ZADD', prefix .. 'workers', ARGV[4], worker)
return 1
"""

# ARGV: prefix, now
_REAP = (
    _DROP_WORKER
    + """
local prefix = ARGV[1]
local expired = redis.call('ZRANGEBYSCORE', prefix .. 'workers', '-inf', ARGV[2])
for _, worker in ipairs(expired) do
  drop_worker(prefix, worker)
end
return expired
"""
)

# ARGV: prefix, worker
_REMOVE = (
    _DROP_WORKER
    + """
return drop_worker(ARGV[1], ARGV[2])
"""
)

# ARGV: prefix, hashes... -> flat [worker, count, ...]
_LONGEST = """
local prefix = ARGV[1]
local counts, alive = {}, nil
for i = 2, #ARGV do
  local members = redis.call('SMEMBERS', prefix .. 'block:' .. ARGV[i])
  local next_alive, any = {}, false
  for _, m in ipairs(members) do
    if alive == nil or alive[m] then
      next_alive[m] = true
      counts[m] = i - 1
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for m, c in pairs(counts) do
  table.insert(out, m)
  table.insert(out, c)
end
return out
"""


class PrefixIndex:
    """Thin typed access to the index of one mesh (scripts registered once per client)."""

    def __init__(self, client: redis.Redis, mesh: str, clock: Clock = time.time):
        self.client = client
        self.mesh = mesh
        self.prefix = index_prefix(mesh)
        self.clock = clock
        self._resync = client.register_script(_RESYNC)
        self._apply = client.register_script(_APPLY)
        self._touch = client.register_script(_TOUCH)
        self._reap = client.register_script(_REAP)
        self._remove = client.register_script(_REMOVE)
        self._longest = client.register_script(_LONGEST)

    # -- workers ---------------------------------------------------------------------------
    def resync(
        self,
        worker_id: str,
        epoch: str,
        block_hashes: Sequence[BlockHash],
        block_size: int,
        model_id: str,
        ttl_s: float,
    ) -> int:
        """Replace all of the worker's entries with this snapshot; its seq restarts at 0.
        Returns the number of blocks written."""
        expiry = self.clock() + ttl_s
        args: list[str | int] = [self.prefix, worker_id, epoch, block_size, model_id, repr(expiry)]
        return int(self._resync(args=args + [h.hex() for h in block_hashes]))

    def apply_batch(
        self,
        worker_id: str,
        epoch: str,
        seq: int,
        stored: Sequence[BlockHash],
        removed: Sequence[BlockHash],
        ttl_s: float,
    ) -> bool:
        """Apply batch `seq`; False (nothing applied) when the worker must resync."""
        expiry = self.clock() + ttl_s
        args: list[str | int] = [self.prefix, worker_id, epoch, seq, repr(expiry), len(stored)]
        args += [h.hex() for h in stored] + [h.hex() for h in removed]
        return bool(self._apply(args=args))

    def touch(self, worker_id: str, epoch: str, ttl_s: float) -> bool:
        """Extend the worker's expiry; False when its entries are gone (must resync)."""
        return bool(self._touch(args=[self.prefix, worker_id, epoch, repr(self.clock() + ttl_s)]))

    def remove_worker(self, worker_id: str) -> None:
        self._remove(args=[self.prefix, worker_id])

    def reap_expired(self) -> list[str]:
        """Drop every entry of workers whose expiry passed; returns their ids."""
        return [redis_keys.text(w) for w in self._reap(args=[self.prefix, repr(self.clock())])]

    # -- router ----------------------------------------------------------------------------
    def longest_prefixes(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker: how many leading blocks of the chain it holds (workers with none omitted)."""
        if not block_hashes:
            return {}
        flat = self._longest(args=[self.prefix, *[h.hex() for h in block_hashes]])
        return {redis_keys.text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def worker_blocks(self, worker_id: str) -> set[BlockHash]:
        """Every key the index holds for one worker (tests and debugging)."""
        return {
            bytes.fromhex(redis_keys.text(h)) for h in self.client.smembers(worker_blocks_key(self.mesh, worker_id))
        }

    def indexed_workers(self) -> list[str]:
        return sorted(redis_keys.text(w) for w in self.client.zrange(workers_key(self.mesh), 0, -1))
