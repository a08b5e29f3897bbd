"""Applying a placement without the operator: the local cluster, `moemesh placement apply` and
tests drive the same two-phase protocol the operator's EPLB timer drives (see placement.py).

`apply_placement` checks the placement against the mesh first (every named worker is a live
expert worker in the registry; the model shape equals the active placement's), then publishes it
under the next version, waits until every owning worker marked it ready, and activates it. A
rejected placement changes nothing; on a timeout the version stays pending (a newer publish
supersedes it) and the active one keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import redis

from moemesh.contracts import registry
from moemesh.contracts.placement import Placement, PlacementError, PlacementStore, contiguous_slot_owner


class PlacementTimeoutError(PlacementError):
    """The owning workers did not all load the placement in time (it stays pending)."""


def even_placement(
    num_layers: int, num_experts: int, worker_ids: Sequence[str], version: int = 1, replicas: int = 1
) -> Placement:
    """Slot s holds expert s mod num_experts in every layer; slots are the fewest that hold
    `replicas` copies of every expert and divide evenly over the workers (extra slots replicate
    experts 0, 1, ...); worker w owns a contiguous range. A worker's range is at most
    num_experts slots long when replicas <= workers, so an expert's copies (num_experts slots
    apart) sit on different workers: with replicas >= 2 any one worker can die. With
    replicas == 1 and num_experts a multiple of the workers it is the identity."""
    num_workers = len(worker_ids)
    if num_workers < 1:
        raise PlacementError("an expert placement needs at least one expert worker")
    if not 1 <= replicas <= num_workers:
        raise PlacementError(f"{replicas} replicas of each expert need as many expert workers, not {num_workers}")
    num_slots = -(-replicas * num_experts // num_workers) * num_workers
    phy2log = np.tile(np.arange(num_slots) % num_experts, (num_layers, 1))
    return Placement(
        version=version,
        num_experts=num_experts,
        worker_ids=tuple(worker_ids),
        slot_owner=contiguous_slot_owner(num_slots, num_workers),
        phy2log=phy2log,
    )


def check_placement(placement: Placement, live_workers: Sequence[str], current: Placement | None) -> None:
    """Raises PlacementError when `placement` cannot be applied to this mesh now."""
    missing = [w for w in placement.worker_ids if w not in set(live_workers)]
    if missing:
        raise PlacementError(
            f"placement names expert workers that are not running: {missing} (live: {sorted(live_workers)})"
        )
    if current is not None and (placement.num_layers, placement.num_experts) != (
        current.num_layers,
        current.num_experts,
    ):
        raise PlacementError(
            f"placement covers {placement.num_layers} MoE layers x {placement.num_experts} experts; the active "
            f"placement {current.version} (the model) has {current.num_layers} x {current.num_experts}"
        )


def apply_placement(
    client: redis.Redis,
    mesh: str,
    placement: Placement,
    timeout_s: float = 120.0,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Placement:
    """Validate, publish as the next version, wait for every owner to be ready, activate.
    Returns the placement as activated (with its version)."""
    store = PlacementStore(client, mesh)
    live = [w.worker_id for w in registry.list_workers(client, mesh, role="expert")]
    check_placement(placement, live, store.current())
    placement = placement.with_version(store.latest_version() + 1)
    store.publish(placement)
    deadline = clock() + timeout_s
    while missing := store.missing_workers(placement.version):
        if clock() > deadline:
            raise PlacementTimeoutError(
                f"placement {placement.version} was not loaded by {list(missing)} within {timeout_s} s; "
                f"placement {store.current_version()} stays active"
            )
        sleep(poll_s)
    store.activate(placement.version)
    return placement
