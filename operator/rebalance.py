"""EPLB step of the timer: activate ready placements, plan and publish new ones (Redis only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import redis

from moemesh.contracts import redis_keys
from moemesh.contracts.expert_load_records import read_expert_load
from moemesh.contracts.placement import Placement, PlacementStore, contiguous_slot_owner
from moemesh.operator.eplb import EplbLayout, plan_from_scratch
from moemesh.operator.eplb_replan import replan, should_publish


@dataclass(frozen=True)
class RebalanceOutcome:
    active_version: int  # 0 when none is active yet
    pending_version: int  # 0 when nothing waits for workers
    published_version: int  # 0 when this step published nothing
    planned: bool  # the step read load and ran the planner
    imbalance_before: float | None  # current placement under the observed load
    imbalance_after: float | None  # the published (or rejected) plan under the same load
    moves: int | None
    reason: str


def _compatible(placement: Placement | None, layout: EplbLayout, num_layers: int, worker_ids: list[str]) -> bool:
    return (
        placement is not None
        and placement.worker_ids == tuple(worker_ids)
        and placement.num_slots == layout.num_slots
        and placement.num_experts == layout.num_experts
        and placement.num_layers == num_layers
    )


def rebalance_step(
    client: redis.Redis,
    mesh: str,
    layout: EplbLayout,
    num_layers: int,
    worker_ids: list[str],
    threshold: float,
    plan_due: bool,
    clock: redis_keys.Clock,
    last_version: int = 0,
) -> RebalanceOutcome:
    """One timer tick of the two-phase apply (see ``moemesh.contracts.placement``). `last_version`:
    the highest version the mesh has used (its status). A new version exceeds it too, so a Redis
    that lost its keys never gets a version number that expert workers already hold with
    another layout (they would take it as loaded and never mark it ready)."""
    store = PlacementStore(client, mesh)
    pending = store.pending()
    if pending is not None and not store.missing_workers(pending.version):
        store.activate(pending.version)
        pending = None
    latest_version = store.latest_version()
    newest = store.get(latest_version) if latest_version else None

    def publish(phy2log: np.ndarray) -> int:
        version = max(latest_version, last_version) + 1
        store.publish(
            Placement(
                version=version,
                num_experts=layout.num_experts,
                worker_ids=tuple(worker_ids),
                slot_owner=contiguous_slot_owner(layout.num_slots, layout.num_workers),
                phy2log=phy2log,
            )
        )
        return version

    def outcome(published: int, planned: bool, before=None, after=None, moves=None, reason="") -> RebalanceOutcome:
        return RebalanceOutcome(
            active_version=store.current_version(),
            pending_version=published or (pending.version if pending is not None else 0),
            published_version=published,
            planned=planned,
            imbalance_before=before,
            imbalance_after=after,
            moves=moves,
            reason=reason,
        )

    if not _compatible(newest, layout, num_layers, worker_ids):
        if newest is None:
            return outcome(
                publish(plan_from_scratch(np.ones((num_layers, layout.num_experts)), layout).phy2log),
                False,
                reason="initial placement",
            )
        # a new worker count (expert autoscaling) or spec: plan for the load seen so far
        load = read_expert_load(client, mesh, num_layers, layout.num_experts, clock=clock)
        counts = load.counts if load.counts.any() else np.ones((num_layers, layout.num_experts))
        plan = plan_from_scratch(counts, layout)
        version = publish(plan.phy2log)
        return outcome(
            version,
            True,
            after=plan.imbalance if load.counts.any() else None,
            reason=f"expert layout changed: {layout.num_workers} workers, {layout.num_slots} slots",
        )
    if pending is not None or not plan_due:
        return outcome(0, False, reason="waiting for workers" if pending is not None else "not due")
    load = read_expert_load(client, mesh, num_layers, layout.num_experts, clock=clock)
    if load.num_workers == 0 or not load.counts.any():
        return outcome(0, True, reason="no expert load reported")
    assert newest is not None, "_compatible is False without a placement"
    result = replan(load.counts, layout, newest.phy2log)
    before, after = result.current_imbalance, result.plan.imbalance
    if not should_publish(before, after, threshold):
        return outcome(0, True, before, after, 0, reason="improvement below threshold")
    version = publish(result.plan.phy2log)
    return outcome(version, True, before, after, result.moves, reason="rebalanced")


def delete_placements(client: redis.Redis, mesh: str) -> int:
    """Delete every placement key of ``mesh`` (the mesh was deleted); returns how many."""
    pattern = f"{redis_keys.mesh_prefix(mesh)}:placement:*"
    keys = list(client.scan_iter(match=pattern, count=500))
    if keys:
        client.delete(*keys)
    return len(keys)
