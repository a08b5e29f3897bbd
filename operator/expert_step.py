"""Expert-worker scaling step of the timer: registry, expert load and placements (Redis) ->
``decide_expert_workers`` -> ``next_action``. The handler applies the action: ``ScaleTo`` patches
the expert StatefulSet, ``PlaceOver`` makes the EPLB step plan and publish (two-phase) a placement
over that many workers; ``placement_workers`` is the worker count the EPLB step plans for.

A worker is drained when it holds no expert weights (its heartbeat's ``num_experts_held``; it
releases a placement's replicas once that placement is neither active nor pending and no call for
it came for its release grace) or when it is not registered at all (its pod is gone).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from moemesh.contracts import redis_keys
from moemesh.contracts.expert_load_records import read_expert_load
from moemesh.contracts.placement import PlacementStore
from moemesh.contracts.registry import WorkerRecord
from moemesh.operator.autoscaler import AutoscalerState
from moemesh.operator.expert_scaling import (
    Action,
    ExpertScalingPolicy,
    ExpertTelemetry,
    PlaceOver,
    ScaleTo,
    applied,
    decide_expert_workers,
    next_action,
)
from moemesh.operator.manifests import expert_worker_ids


@dataclass(frozen=True)
class ExpertScaleOutcome:
    desired: int  # expert workers the decision wants (stabilised, within min/max and memory)
    action: Action
    placement_workers: int  # workers the EPLB step plans over this tick
    telemetry: ExpertTelemetry


def expert_scale_step(
    client: redis.Redis,
    mesh: str,  # the mesh id (namespace/name)
    name: str,  # the InferenceMesh's name: worker ids are f"{name}-expert-{ordinal}"
    state: AutoscalerState,
    now: float,  # the operator's clock (windows and periods)
    replicas: int,  # the expert StatefulSet's spec.replicas now
    workers: list[WorkerRecord],  # the registry's live workers (every role)
    policy: ExpertScalingPolicy,
    num_layers: int,
    num_experts: int,
    clock: redis_keys.Clock,  # unix time, for the load windows' expiry
) -> tuple[ExpertScaleOutcome, AutoscalerState]:
    store = PlacementStore(client, mesh)
    experts = {w.worker_id: w for w in workers if w.role == "expert"}
    ids = expert_worker_ids(name, max(replicas, policy.max_workers))
    num_registered = sum(1 for worker_id in ids[:replicas] if worker_id in experts)
    load = read_expert_load(client, mesh, num_layers, num_experts, clock=clock)
    tokens_per_second = float(load.counts.sum()) / load.max_window_s if load.num_workers else 0.0
    telemetry = ExpertTelemetry(
        num_ready=num_registered, num_pending=replicas - num_registered, tokens_per_second=tokens_per_second
    )
    desired, state = decide_expert_workers(state, now, replicas, telemetry, policy, num_experts)
    active, pending = store.current(), store.pending()
    leaving = [experts.get(worker_id) for worker_id in ids[desired:replicas]]
    drained = all(record is None or record.num_experts_held == 0 for record in leaving)
    action = next_action(
        replicas,
        desired,
        num_registered,
        active.num_workers if active else None,
        pending.num_workers if pending else None,
        drained,
    )
    if isinstance(action, ScaleTo):
        state = applied(state, now, replicas, action.num_workers)
    if isinstance(action, PlaceOver):
        placement_workers = action.num_workers
    else:
        newest = store.get(store.latest_version()) if store.latest_version() else None
        placement_workers = newest.num_workers if newest is not None else replicas
    return ExpertScaleOutcome(desired, action, placement_workers, telemetry), state
