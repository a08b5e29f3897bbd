"""Redis key schema of a mesh, and the expiring-index pattern the registry and telemetry share.

Every key of one mesh starts with ``moemesh:{mesh}:`` where ``mesh`` is the InferenceMesh's
``namespace/name`` on Kubernetes (any string locally, e.g. ``local``). The full schema:

    moemesh:{mesh}:workers                    ZSET  worker_id -> expiry (unix seconds)
    moemesh:{mesh}:worker:{worker_id}         STRING  WorkerRecord JSON, PX ttl
    moemesh:{mesh}:expert_load                ZSET  worker_id -> expiry (unix seconds)
    moemesh:{mesh}:expert_load:{worker_id}    HASH  shape, dtype, counts, window_s, timestamp; PX ttl
    moemesh:{mesh}:placement:{version}        STRING  Placement JSON
    moemesh:{mesh}:placement:{version}:ready  SET  worker ids that loaded this version's replicas
    moemesh:{mesh}:placement:versions         ZSET  stored versions (score = version)
    moemesh:{mesh}:placement:latest           STRING  highest published version
    moemesh:{mesh}:placement:current          STRING  version the dispatchers must use

Expiring index: a record lives in its own key with a TTL (so a dead writer's data vanishes even
if nobody lists), and its member in an index ZSET is scored with the record's expiry time. A
reader first drops index members whose expiry has passed (and their record keys), then reads the
rest; so listing never returns an expired entry and never leaves a stale one behind. Times are
unix seconds taken from a caller-supplied clock, so tests need no sleeping; writers on different
hosts should keep their clocks in sync within a fraction of the TTL (NTP does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

KEY_PREFIX = "moemesh"

Clock = Callable[[], float]


def text(value: Any) -> str:
    """A Redis reply as text: clients without `decode_responses` return bytes."""
    return value.decode() if isinstance(value, bytes) else str(value)


def mesh_prefix(mesh: str) -> str:
    if not mesh or any(ch.isspace() for ch in mesh):
        raise ValueError(f"mesh id must be a non-empty string without spaces, got {mesh!r}")
    return f"{KEY_PREFIX}:{mesh}"


def workers_index_key(mesh: str) -> str:
    return f"{mesh_prefix(mesh)}:workers"


def worker_key_prefix(mesh: str) -> str:
    return f"{mesh_prefix(mesh)}:worker:"


def worker_key(mesh: str, worker_id: str) -> str:
    return worker_key_prefix(mesh) + worker_id


def expert_load_index_key(mesh: str) -> str:
    return f"{mesh_prefix(mesh)}:expert_load"


def expert_load_key_prefix(mesh: str) -> str:
    return f"{mesh_prefix(mesh)}:expert_load:"


def expert_load_key(mesh: str, worker_id: str) -> str:
    return expert_load_key_prefix(mesh) + worker_id


def placement_key(mesh: str, version: int) -> str:
    return f"{mesh_prefix(mesh)}:placement:{version}"


def placement_ready_key(mesh: str, version: int) -> str:
    return f"{mesh_prefix(mesh)}:placement:{version}:ready"


def placement_versions_key(mesh: str) -> str:
    return f"{mesh_prefix(mesh)}:placement:versions"


def placement_latest_key(mesh: str) -> str:
    return f"{mesh_prefix(mesh)}:placement:latest"


def placement_current_key(mesh: str) -> str:
    return f"{mesh_prefix(mesh)}:placement:current"


def put_expiring(
    client: redis.Redis,
    index_key: str,
    member: str,
    record_key: str,
    ttl_s: float,
    now: float,
    write: Callable[[redis.client.Pipeline], object],  # queues the record's writes; its result is unused
) -> None:
    """Atomically (MULTI) write a record via ``write``, give it a TTL and index it with its expiry."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    pipe = client.pipeline(transaction=True)
    write(pipe)
    pipe.pexpire(record_key, max(1, int(ttl_s * 1000)))
    pipe.zadd(index_key, {member: now + ttl_s})
    pipe.execute()


def drop_expiring(client: redis.Redis, index_key: str, member: str, record_key: str) -> None:
    """Remove one record and its index member (a clean shutdown)."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(record_key)
    pipe.zrem(index_key, member)
    pipe.execute()


_LIVE_MEMBERS_LUA = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, member in ipairs(expired) do
  redis.call('ZREM', KEYS[1], member)
  redis.call('DEL', ARGV[2] .. member)
end
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf')
"""


def live_members(client: redis.Redis, index_key: str, record_prefix: str, now: float) -> list[str]:
    """Members whose expiry is after ``now``, sorted; expired members and their records
    (``record_prefix + member``) are deleted in the same atomic script."""
    members = client.eval(_LIVE_MEMBERS_LUA, 1, index_key, repr(float(now)), record_prefix)
    return sorted(m.decode() for m in members)


def forget_members(client: redis.Redis, index_key: str, record_prefix: str, members: list[str]) -> None:
    """Drop index members whose record key vanished (its Redis TTL fired before its index expiry)."""
    if members:
        pipe = client.pipeline(transaction=True)
        pipe.zrem(index_key, *members)
        pipe.delete(*[record_prefix + m for m in members])
        pipe.execute()
