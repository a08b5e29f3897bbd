"""Expert load telemetry: tokens routed to each (MoE layer, logical expert) over a window.

Contract (keys in ``redis_keys``): each worker that runs experts writes a HASH at
``moemesh:{mesh}:expert_load:{worker_id}`` with fields

    shape      b"{num_layers},{num_experts}"
    dtype      b"<i8"  (little-endian int64)
    counts     raw bytes of the C-order int64 array [num_layers, num_experts]
    window_s   float, the length of the window the counts cover
    timestamp  float, unix seconds when the window closed

with a TTL, indexed in ``moemesh:{mesh}:expert_load`` by expiry (the expiring-index pattern of
``redis_keys``). No pickle: any language can read it. Each write replaces the worker's previous
window (it is a gauge of the last window, not a running sum).

Callers:
- expert workers (or the local ExpertExecutor when experts run in-process) call
  ``publish_expert_load`` when a counting window closes, with counts of *logical* experts;
- the operator's EPLB timer calls ``read_expert_load`` to sum the live workers' windows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import numpy as np
import redis

from moemesh.contracts import redis_keys

DEFAULT_TTL_S = 120.0
_DTYPE = "<i8"


@dataclass(frozen=True)
class ExpertLoad:
    """Summed load of the live workers. ``counts`` is read-only."""

    counts: np.ndarray  # [num_layers, num_experts] int64
    num_workers: int  # windows that were summed
    max_window_s: float  # the longest window among them

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])


def publish_expert_load(
    client: redis.Redis,
    mesh: str,
    worker_id: str,
    counts: np.ndarray,  # [num_layers, num_experts] integer token counts
    window_s: float,
    ttl_s: float = DEFAULT_TTL_S,
    clock: redis_keys.Clock = time.time,
) -> None:
    """Replace this worker's window of counts. Called by expert workers when a window closes."""
    array = np.asarray(counts)
    if array.ndim != 2 or array.size == 0:
        raise ValueError(f"counts must be a non-empty [num_layers, num_experts] array, got {array.shape}")
    if not np.issubdtype(array.dtype, np.integer) or (array < 0).any():
        raise ValueError("counts must be non-negative integers")
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    now = clock()
    key = redis_keys.expert_load_key(mesh, worker_id)
    payload = np.ascontiguousarray(array, dtype=_DTYPE).tobytes()
    mapping: dict = {  # field -> str or bytes (redis-py's Mapping type is invariant in its keys)
        "shape": f"{array.shape[0]},{array.shape[1]}",
        "dtype": _DTYPE,
        "counts": payload,
        "window_s": repr(float(window_s)),
        "timestamp": repr(float(now)),
    }
    redis_keys.put_expiring(
        client,
        redis_keys.expert_load_index_key(mesh),
        worker_id,
        key,
        ttl_s,
        now,
        lambda pipe: (pipe.delete(key), pipe.hset(key, mapping=mapping)),
    )


def read_expert_load(
    client: redis.Redis,
    mesh: str,
    num_layers: int,
    num_experts: int,
    clock: redis_keys.Clock = time.time,
) -> ExpertLoad:
    """Sum the live windows of shape [num_layers, num_experts]. Called by the operator.

    Windows of another shape (a worker still serving a previous model) are ignored; expired
    windows are deleted. With no live window the counts are all zero and ``num_workers`` is 0.
    """
    index_key = redis_keys.expert_load_index_key(mesh)
    prefix = redis_keys.expert_load_key_prefix(mesh)
    worker_ids = redis_keys.live_members(client, index_key, prefix, clock())
    total = np.zeros((num_layers, num_experts), dtype=np.int64)
    num_workers = 0
    max_window_s = 0.0
    vanished: list[str] = []
    expected_shape = f"{num_layers},{num_experts}".encode()
    for worker_id in worker_ids:
        fields = client.hmget(prefix + worker_id, ["shape", "dtype", "counts", "window_s"])
        shape, dtype, payload, window_s = fields
        if payload is None:
            vanished.append(worker_id)
            continue
        if shape != expected_shape or dtype != _DTYPE.encode():
            continue
        total += np.frombuffer(cast(bytes, payload), dtype=_DTYPE).reshape(num_layers, num_experts)
        num_workers += 1
        max_window_s = max(max_window_s, float(redis_keys.text(window_s)))
    redis_keys.forget_members(client, index_key, prefix, vanished)
    total.setflags(write=False)
    return ExpertLoad(counts=total, num_workers=num_workers, max_window_s=max_window_s)
