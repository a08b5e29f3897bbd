"""Worker registry: who is alive in a mesh, where, and how loaded.

Contract (keys in ``redis_keys``): each worker writes its ``WorkerRecord`` as JSON to
``moemesh:{mesh}:worker:{worker_id}`` with a TTL and indexes it in ``moemesh:{mesh}:workers``
scored by its expiry. A worker that stops heartbeating disappears on its own: its key expires in
Redis and ``list_workers`` drops the index member. ``updated_at`` and the expiry come from the
caller's clock (unix seconds).

Callers:
- every router/prefill/decode/expert worker calls ``heartbeat`` at start-up and then every
  ``ttl_s / 3`` seconds with its current load, and ``deregister`` on graceful shutdown;
- the router calls ``list_workers(role=...)`` to pick prefill/decode workers;
- the operator's timer calls ``list_workers()`` to build autoscaling telemetry.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import redis

from moemesh.contracts import redis_keys

ROLES = ("router", "prefill", "decode", "both", "expert")

DEFAULT_TTL_S = 15.0


@dataclass(frozen=True)
class WorkerRecord:
    """One worker's heartbeat. ``role`` 'both' is an aggregated prefill+decode worker."""

    worker_id: str
    role: str
    endpoint: str  # 'host:port' of its gRPC server
    model: str
    num_queued: int = 0  # requests waiting for admission
    num_running: int = 0  # requests in the running batch
    kv_usage: float = 0.0  # num_blocks_used / num_blocks_total, 0..1
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    ttft_p90_s: float = 0.0  # time to first token, p90 over the last window
    itl_p90_s: float = 0.0  # inter-token latency, p90 over the last window
    num_experts_held: int = 0  # expert workers: (layer, expert) weights in memory over every loaded placement
    updated_at: float = 0.0  # unix seconds, set by heartbeat()

    def __post_init__(self) -> None:
        if not self.worker_id or ":" in self.worker_id:
            raise ValueError(f"worker_id must be non-empty without ':', got {self.worker_id!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        host, sep, port = self.endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"endpoint must be 'host:port', got {self.endpoint!r}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be within 0..1, got {self.kv_usage}")
        for name in ("num_queued", "num_running", "num_blocks_total", "num_blocks_used", "num_experts_held"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        data = json.loads(text)
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def heartbeat(
    client: redis.Redis,
    mesh: str,
    record: WorkerRecord,
    ttl_s: float = DEFAULT_TTL_S,
    clock: redis_keys.Clock = time.time,
) -> WorkerRecord:
    """Register or refresh ``record``; returns it with ``updated_at`` set. Called by workers."""
    now = clock()
    stamped = dataclasses.replace(record, updated_at=now)
    key = redis_keys.worker_key(mesh, record.worker_id)
    redis_keys.put_expiring(
        client,
        redis_keys.workers_index_key(mesh),
        record.worker_id,
        key,
        ttl_s,
        now,
        lambda pipe: pipe.set(key, stamped.to_json()),
    )
    return stamped


register = heartbeat  # the first heartbeat is the registration


def deregister(client: redis.Redis, mesh: str, worker_id: str) -> None:
    """Remove a worker at once. Called by a worker on graceful shutdown."""
    redis_keys.drop_expiring(
        client,
        redis_keys.workers_index_key(mesh),
        worker_id,
        redis_keys.worker_key(mesh, worker_id),
    )


def list_workers(
    client: redis.Redis,
    mesh: str,
    role: str | None = None,
    clock: redis_keys.Clock = time.time,
) -> list[WorkerRecord]:
    """Live workers sorted by id, optionally of one role; expired entries are deleted."""
    if role is not None and role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    index_key = redis_keys.workers_index_key(mesh)
    prefix = redis_keys.worker_key_prefix(mesh)
    worker_ids = redis_keys.live_members(client, index_key, prefix, clock())
    if not worker_ids:
        return []
    values = client.mget([prefix + worker_id for worker_id in worker_ids])
    vanished = [wid for wid, value in zip(worker_ids, values) if value is None]
    redis_keys.forget_members(client, index_key, prefix, vanished)
    records = [WorkerRecord.from_json(value) for value in values if value is not None]
    return [record for record in records if role is None or record.role == role]
