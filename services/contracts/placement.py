"""Expert placement: which logical expert each physical slot holds, and which worker owns it.

A ``Placement`` is one version of the mesh's expert layout:

- ``phy2log`` [num_layers, num_slots]: the logical expert held by each physical slot (a slot
  holds one *replica* of an *expert*);
- ``slot_owner`` [num_slots]: the index into ``worker_ids`` of the expert worker owning each
  slot. It is the same for every layer (a worker owns slot s in all layers; this is how the
  expert StatefulSet is laid out: worker w owns ``num_slots / num_workers`` slots);
- derived: ``replica_counts`` [num_layers, num_experts] and ``log2phy``
  [num_layers, num_experts, max_replicas] (slot ids, padded with -1).

Validation rejects wrong shapes, an expert with no replica in some layer, slots of unknown
workers and (when ``equal_slots``) workers with unequal slot counts, naming the problem.

``PlacementStore`` keeps versions in Redis (keys in ``redis_keys``) and applies a new one in two
phases, so no request fails during a rebalance:

1. the operator ``publish``es version v (``current`` stays the old version);
2. each expert worker sees ``pending()``, loads the weights for its new replicas, keeps serving
   the old ones, and calls ``mark_ready(worker_id, v)``;
3. the operator calls ``activate(v)`` once ``missing_workers(v)`` is empty;
4. dispatchers (the ExpertExecutor of prefill/decode workers) poll ``current_version()`` at a
   step boundary and switch to ``current()``; expert workers drop replicas of the old version
   once their in-flight calls finish. The previous version stays readable for them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import redis

from moemesh.contracts import redis_keys


class PlacementError(ValueError):
    """An invalid placement, or an invalid step of the two-phase apply."""


class PlacementNotReadyError(PlacementError):
    """``activate`` was called before every owning worker marked the version ready."""


def _frozen_int_array(value: object, name: str, ndim: int) -> np.ndarray:
    array = np.array(value, dtype=np.int64, copy=True)
    if array.ndim != ndim:
        raise PlacementError(f"{name} must have {ndim} dimension(s), got shape {array.shape}")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Placement:
    version: int
    num_experts: int
    worker_ids: tuple[str, ...]
    slot_owner: np.ndarray  # [num_slots] index into worker_ids
    phy2log: np.ndarray  # [num_layers, num_slots] logical expert per slot
    equal_slots: bool = True  # every worker owns the same number of slots

    def __post_init__(self) -> None:
        set_field = functools.partial(object.__setattr__, self)
        set_field("worker_ids", tuple(self.worker_ids))
        set_field("slot_owner", _frozen_int_array(self.slot_owner, "slot_owner", 1))
        set_field("phy2log", _frozen_int_array(self.phy2log, "phy2log", 2))
        self._validate()

    def _validate(self) -> None:
        if self.version < 0:
            raise PlacementError(f"version must be >= 0, got {self.version}")
        if self.num_experts < 1:
            raise PlacementError(f"num_experts must be >= 1, got {self.num_experts}")
        if not self.worker_ids or len(set(self.worker_ids)) != len(self.worker_ids):
            raise PlacementError(f"worker_ids must be non-empty and unique, got {self.worker_ids}")
        num_layers, num_slots = self.phy2log.shape
        if num_layers < 1 or num_slots < 1:
            raise PlacementError(f"phy2log must be [num_layers, num_slots] >= 1, got {self.phy2log.shape}")
        if self.slot_owner.shape != (num_slots,):
            raise PlacementError(f"slot_owner must have shape [num_slots]=({num_slots},), got {self.slot_owner.shape}")
        bad = np.flatnonzero((self.slot_owner < 0) | (self.slot_owner >= len(self.worker_ids)))
        if bad.size:
            raise PlacementError(
                f"slots {bad.tolist()} reference unknown workers {self.slot_owner[bad].tolist()} "
                f"(there are {len(self.worker_ids)} workers)"
            )
        if ((self.phy2log < 0) | (self.phy2log >= self.num_experts)).any():
            layer, slot = np.argwhere((self.phy2log < 0) | (self.phy2log >= self.num_experts))[0]
            raise PlacementError(
                f"layer {layer} slot {slot} holds expert {self.phy2log[layer, slot]}, outside 0..{self.num_experts - 1}"
            )
        missing = np.argwhere(self.replica_counts == 0)
        if missing.size:
            layer, expert = missing[0]
            raise PlacementError(
                f"expert {expert} has no replica in layer {layer} ({len(missing)} (layer, expert) pairs lack one)"
            )
        slots_per_worker = np.bincount(self.slot_owner, minlength=len(self.worker_ids))
        if self.equal_slots and (slots_per_worker != slots_per_worker[0]).any():
            raise PlacementError(
                f"workers own unequal slot counts {dict(zip(self.worker_ids, slots_per_worker.tolist()))}"
            )

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def num_workers(self) -> int:
        return len(self.worker_ids)

    @functools.cached_property
    def replica_counts(self) -> np.ndarray:
        """[num_layers, num_experts] number of replicas of each expert."""
        offsets = np.arange(self.num_layers)[:, None] * self.num_experts
        counts = np.bincount((self.phy2log + offsets).ravel(), minlength=self.num_layers * self.num_experts)
        counts = counts.reshape(self.num_layers, self.num_experts)
        counts.setflags(write=False)
        return counts

    @functools.cached_property
    def log2phy(self) -> np.ndarray:
        """[num_layers, num_experts, max_replicas] slot ids of each expert's replicas, -1 padded."""
        max_replicas = int(self.replica_counts.max())
        table = np.full((self.num_layers, self.num_experts, max_replicas), -1, dtype=np.int64)
        for layer in range(self.num_layers):
            order = np.argsort(self.phy2log[layer], kind="stable")  # slots grouped by expert
            experts = self.phy2log[layer, order]
            first = np.searchsorted(experts, experts, side="left")
            table[layer, experts, np.arange(self.num_slots) - first] = order
        table.setflags(write=False)
        return table

    def slots_of(self, worker_id: str) -> np.ndarray:
        """[num_slots_of_worker] slot ids owned by ``worker_id`` (the same in every layer)."""
        if worker_id not in self.worker_ids:
            raise PlacementError(f"unknown worker {worker_id!r}; workers are {self.worker_ids}")
        return np.flatnonzero(self.slot_owner == self.worker_ids.index(worker_id))

    def same_layout(self, other: Placement) -> bool:
        """Same slots, owners and experts (versions may differ)."""
        return (
            self.num_experts == other.num_experts
            and self.worker_ids == other.worker_ids
            and np.array_equal(self.slot_owner, other.slot_owner)
            and np.array_equal(self.phy2log, other.phy2log)
        )

    def with_version(self, version: int) -> Placement:
        return dataclasses.replace(self, version=version)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "num_experts": self.num_experts,
                "worker_ids": list(self.worker_ids),
                "slot_owner": self.slot_owner.tolist(),
                "phy2log": self.phy2log.tolist(),
                "equal_slots": self.equal_slots,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Placement:
        try:
            data = json.loads(text)
            return cls(
                version=int(data["version"]),
                num_experts=int(data["num_experts"]),
                worker_ids=tuple(str(w) for w in data["worker_ids"]),
                slot_owner=data["slot_owner"],
                phy2log=data["phy2log"],
                equal_slots=bool(data.get("equal_slots", True)),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise PlacementError(f"malformed placement JSON: {exc!r}") from exc


def contiguous_slot_owner(num_slots: int, num_workers: int) -> np.ndarray:
    """[num_slots] owner of each slot when worker w owns slots [w*k, (w+1)*k), k = slots/worker."""
    if num_workers < 1 or num_slots % num_workers:
        raise PlacementError(f"{num_slots} slots do not divide evenly over {num_workers} workers")
    return np.repeat(np.arange(num_workers), num_slots // num_workers)


class PlacementStore:
    """Versioned placements of one mesh in Redis, applied in two phases (see module doc)."""

    def __init__(self, client: redis.Redis, mesh: str) -> None:
        self._client = client
        self._mesh = mesh

    # -- read side: dispatchers, expert workers, the operator --------------------------------

    def current_version(self) -> int:
        """Active version, 0 when none. Polled by dispatchers at every step boundary (cheap)."""
        return int(self._client.get(redis_keys.placement_current_key(self._mesh)) or 0)

    def latest_version(self) -> int:
        """Highest published version, 0 when none."""
        return int(self._client.get(redis_keys.placement_latest_key(self._mesh)) or 0)

    def get(self, version: int) -> Placement | None:
        text = self._client.get(redis_keys.placement_key(self._mesh, version))
        return None if text is None else Placement.from_json(text)

    def current(self) -> Placement | None:
        """The active placement. Read by dispatchers when ``current_version`` changed."""
        version = self.current_version()
        return self.get(version) if version else None

    def pending(self) -> Placement | None:
        """The published, not yet active placement. Polled by expert workers to preload."""
        latest = self.latest_version()
        return self.get(latest) if latest > self.current_version() else None

    def ready_workers(self, version: int) -> frozenset[str]:
        members = self._client.smembers(redis_keys.placement_ready_key(self._mesh, version))
        return frozenset(redis_keys.text(m) for m in members)

    def missing_workers(self, version: int) -> tuple[str, ...]:
        """Owning workers of ``version`` that did not mark it ready yet. Called by the operator."""
        placement = self._require(version)
        if version <= self.current_version():
            return ()
        ready = self.ready_workers(version)
        return tuple(w for w in placement.worker_ids if w not in ready)

    # -- write side -----------------------------------------------------------------------------

    def publish(self, placement: Placement) -> None:
        """Store a new version; ``current`` is unchanged. Called by the operator after planning.

        The version must exceed the latest published one; a newer publish supersedes a pending
        version that never got activated.
        """
        latest_key = redis_keys.placement_latest_key(self._mesh)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(latest_key)
            latest = int(pipe.get(latest_key) or 0)
            if placement.version <= latest:
                raise PlacementError(f"placement version {placement.version} must exceed the latest published {latest}")
            pipe.multi()
            pipe.set(redis_keys.placement_key(self._mesh, placement.version), placement.to_json())
            pipe.set(latest_key, placement.version)
            pipe.zadd(redis_keys.placement_versions_key(self._mesh), {str(placement.version): placement.version})
            pipe.execute()  # raises WatchError if another publisher raced us

    def mark_ready(self, worker_id: str, version: int) -> None:
        """Called by an expert worker once it holds the weights of ``version``'s replicas."""
        placement = self._require(version)
        if worker_id not in placement.worker_ids:
            raise PlacementError(f"worker {worker_id!r} owns no slot of placement {version}")
        if version <= self.current_version():
            return  # already active: nothing left to coordinate
        self._client.sadd(redis_keys.placement_ready_key(self._mesh, version), worker_id)

    def activate(self, version: int) -> None:
        """Make ``version`` current. Called by the operator when ``missing_workers`` is empty.

        Keeps the previous current version readable (in-flight calls may still use it) and
        deletes anything older.
        """
        missing = self.missing_workers(version)
        if missing:
            raise PlacementNotReadyError(f"placement {version} is not ready on workers {list(missing)}")
        current_key = redis_keys.placement_current_key(self._mesh)
        versions_key = redis_keys.placement_versions_key(self._mesh)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(current_key, versions_key)
            previous = int(redis_keys.text(pipe.get(current_key) or 0))
            if version <= previous:
                raise PlacementError(f"placement {version} is not newer than the current {previous}")
            older = [int(redis_keys.text(v)) for v in pipe.zrangebyscore(versions_key, "-inf", version - 1)]
            stale = [v for v in older if v != previous]
            pipe.multi()
            pipe.set(current_key, version)
            for v in stale:
                pipe.delete(redis_keys.placement_key(self._mesh, v))
            if stale:
                pipe.zrem(versions_key, *stale)
            for v in [*older, version]:
                pipe.delete(redis_keys.placement_ready_key(self._mesh, v))
            pipe.execute()

    def restore(self, placement: Placement) -> bool:
        """Store ``placement`` as published and active under its own version, but only while this
        mesh has no placement at all (Redis lost its keys: a restart without persistence). The
        workers still hold that version, so they go on as before. Returns False (and changes
        nothing) when some placement is stored. Called by the local launcher, which stands in
        for the operator and remembers the active placement."""
        latest_key = redis_keys.placement_latest_key(self._mesh)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(latest_key)
            if pipe.get(latest_key) is not None:
                return False
            pipe.multi()
            pipe.set(redis_keys.placement_key(self._mesh, placement.version), placement.to_json())
            pipe.set(latest_key, placement.version)
            pipe.zadd(redis_keys.placement_versions_key(self._mesh), {str(placement.version): placement.version})
            pipe.set(redis_keys.placement_current_key(self._mesh), placement.version)
            pipe.execute()  # raises WatchError if a publisher raced us
        return True

    def _require(self, version: int) -> Placement:
        placement = self.get(version)
        if placement is None:
            raise PlacementError(f"placement version {version} was never published (or was deleted)")
        return placement


def make_placement(
    version: int,
    phy2log: Sequence[Sequence[int]] | np.ndarray,  # [num_layers, num_slots]
    worker_ids: Sequence[str],
    num_experts: int,
) -> Placement:
    """A placement whose workers own contiguous, equal slot ranges."""
    num_slots = int(np.shape(phy2log)[-1])
    return Placement(
        version=version,
        num_experts=num_experts,
        worker_ids=tuple(worker_ids),
        slot_owner=contiguous_slot_owner(num_slots, len(worker_ids)),
        phy2log=np.asarray(phy2log),
    )
