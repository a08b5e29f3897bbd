"""Migration-aware EPLB re-planning and the publish rule.

Moving a replica means copying an expert's weights to another worker, so a re-plan keeps
replicas where they are unless moving them improves the balance:

1. the from-scratch plan (``eplb.plan_from_scratch``) fixes how many replicas each expert gets
   on each node (for the hierarchical policy, scratch nodes are first relabelled to the current
   nodes they overlap most);
2. per (layer, node), every current replica still wanted stays in its slot; freed slots take the
   missing replicas, heaviest first, on the least loaded worker (preferring one without a copy);
3. while the most loaded worker is above the scratch plan's max, the best load-reducing swap of
   one replica with a lighter worker's replica is applied.

``moves`` counts replicas a worker must newly load (per-worker multiset difference), so slot
reordering inside a worker is free. If the result needs more moves than the scratch plan it
falls back to the scratch plan, so ``moves <= scratch_moves`` always holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moemesh.operator.eplb import EplbError, EplbLayout, Plan, make_plan, plan_from_scratch, validate_load

_EPS = 1e-9


@dataclass(frozen=True, eq=False)
class Replan:
    plan: Plan  # what to publish
    moves: int  # replicas to copy to go from the current placement to ``plan``
    scratch: Plan  # the from-scratch plan, for comparison
    scratch_moves: int
    current_imbalance: float  # the current placement under the same load


def count_moves(old_phy2log: np.ndarray, new_phy2log: np.ndarray, layout: EplbLayout) -> int:
    """Replicas in ``new`` that their worker does not already hold in ``old`` (all layers)."""
    num_layers = old_phy2log.shape[0]
    worker = np.broadcast_to(layout.slot_worker, old_phy2log.shape)
    base = (np.arange(num_layers)[:, None] * layout.num_workers + worker) * layout.num_experts
    size = num_layers * layout.num_workers * layout.num_experts
    old = np.bincount((base + old_phy2log).ravel(), minlength=size)
    new = np.bincount((base + new_phy2log).ravel(), minlength=size)
    return int(np.maximum(new - old, 0).sum())


def _node_counts(phy2log: np.ndarray, layout: EplbLayout) -> np.ndarray:
    """[num_layers, num_nodes, num_experts] replicas of each expert on each node."""
    num_layers = phy2log.shape[0]
    num_nodes = layout.num_nodes
    node = layout.slot_worker // (layout.num_workers // num_nodes)
    index = (np.arange(num_layers)[:, None] * num_nodes + node) * layout.num_experts + phy2log
    counts = np.bincount(index.ravel(), minlength=num_layers * num_nodes * layout.num_experts)
    return counts.reshape(num_layers, num_nodes, layout.num_experts)


def _relabel_nodes(demand: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Permute each layer's scratch nodes onto the current nodes they overlap most (greedy)."""
    num_layers, num_nodes, _ = demand.shape
    if num_nodes == 1:
        return demand
    relabelled = np.empty_like(demand)
    for layer in range(num_layers):
        overlap = np.minimum(demand[layer][:, None, :], current[layer][None, :, :]).sum(-1)
        overlap = overlap.astype(np.float64)
        for _ in range(num_nodes):
            scratch_node, current_node = np.unravel_index(np.argmax(overlap), overlap.shape)
            relabelled[layer, current_node] = demand[layer, scratch_node]
            overlap[scratch_node, :] = -1.0
            overlap[:, current_node] = -1.0
    return relabelled


def _replan_node(
    per_replica: np.ndarray,  # [num_experts] tokens per replica under the new demand
    current: np.ndarray,  # [node_slots] experts now held by the node's slots
    demand: np.ndarray,  # [num_experts] replicas wanted on this node
    slots_per_worker: int,
    target_max: float,
) -> np.ndarray:
    """[node_slots] new experts of the node's slots (see module doc, steps 2-3)."""
    num_slots = current.shape[0]
    order = np.argsort(current, kind="stable")
    sorted_experts = current[order]
    occurrence = np.empty(num_slots, dtype=np.int64)
    occurrence[order] = np.arange(num_slots) - np.searchsorted(sorted_experts, sorted_experts)
    keep = occurrence < demand[current]
    new = np.where(keep, current, -1)
    worker = np.arange(num_slots) // slots_per_worker
    num_workers = num_slots // slots_per_worker
    loads = np.bincount(worker[keep], weights=per_replica[current[keep]], minlength=num_workers)

    missing = demand - np.bincount(current[keep], minlength=demand.shape[0])
    to_place = np.repeat(np.arange(demand.shape[0]), missing)
    for expert in to_place[np.argsort(-per_replica[to_place], kind="stable")]:
        free = new == -1
        has_free = np.bincount(worker[free], minlength=num_workers) > 0
        holds = np.bincount(worker[new == expert], minlength=num_workers) > 0
        score = np.where(has_free, loads + np.where(holds, np.inf, 0.0), np.inf)
        if not np.isfinite(score).any():
            score = np.where(has_free, loads, np.inf)
        target = int(np.argmin(score))
        slot = int(np.flatnonzero(free & (worker == target))[0])
        new[slot] = expert
        loads[target] += per_replica[expert]

    for _ in range(num_slots):
        heavy = int(np.argmax(loads))
        if loads[heavy] <= target_max * (1 + 1e-6) + _EPS:
            break
        heavy_slots = np.flatnonzero(worker == heavy)
        best = None
        for light in np.argsort(loads):
            if light == heavy:
                continue
            light_slots = np.flatnonzero(worker == light)
            delta = per_replica[new[heavy_slots]][:, None] - per_replica[new[light_slots]][None, :]
            peak = np.maximum(loads[heavy] - delta, loads[light] + delta)
            peak = np.where(delta > _EPS, peak, np.inf)
            i, j = np.unravel_index(np.argmin(peak), peak.shape)
            if peak[i, j] < loads[heavy] - _EPS:
                best = (heavy_slots[i], light_slots[j], int(light), delta[i, j])
                break
        if best is None:
            break
        slot_a, slot_b, light, delta = best
        new[slot_a], new[slot_b] = new[slot_b], new[slot_a]
        loads[heavy] -= delta
        loads[light] += delta
    return new


def replan(weight: np.ndarray, layout: EplbLayout, current_phy2log: np.ndarray) -> Replan:
    """Re-plan from ``current_phy2log`` [num_layers, num_slots] under ``weight`` [num_layers, num_experts]."""
    weight = validate_load(weight, layout)
    current_phy2log = np.asarray(current_phy2log, dtype=np.int64)
    if current_phy2log.shape != (weight.shape[0], layout.num_slots):
        raise EplbError(
            f"current placement shape {current_phy2log.shape} does not match "
            f"[{weight.shape[0]}, {layout.num_slots}]; plan from scratch instead"
        )
    scratch = plan_from_scratch(weight, layout)
    scratch_moves = count_moves(current_phy2log, scratch.phy2log, layout)
    current_plan = make_plan(weight, current_phy2log, layout)

    num_nodes = layout.num_nodes if layout.hierarchical else 1
    node_layout = EplbLayout(layout.num_experts, layout.num_slots, layout.num_workers, 1, num_nodes)
    demand = _node_counts(scratch.phy2log, node_layout)
    demand = _relabel_nodes(demand, _node_counts(current_phy2log, node_layout))
    replica_counts = demand.sum(axis=1)  # [num_layers, num_experts]
    per_replica = weight / np.maximum(replica_counts, 1)
    slots_per_node = layout.num_slots // num_nodes
    target_max = scratch.worker_loads.max(axis=1)

    phy2log = np.empty_like(current_phy2log)
    for layer in range(weight.shape[0]):
        for node in range(num_nodes):
            span = slice(node * slots_per_node, (node + 1) * slots_per_node)
            phy2log[layer, span] = _replan_node(
                per_replica[layer],
                current_phy2log[layer, span],
                demand[layer, node],
                layout.slots_per_worker,
                float(target_max[layer]),
            )
    plan = make_plan(weight, phy2log, layout)
    moves = count_moves(current_phy2log, phy2log, layout)
    if moves > scratch_moves or (moves == scratch_moves and plan.imbalance > scratch.imbalance):
        plan, moves = scratch, scratch_moves
    return Replan(plan, moves, scratch, scratch_moves, current_plan.imbalance)


def should_publish(current_imbalance: float, new_imbalance: float, threshold: float) -> bool:
    """Publish only when the predicted max/mean load improves by more than ``threshold``
    (relative: ``(current - new) / current > threshold``, e.g. 0.05 = 5 %)."""
    if current_imbalance <= 0:
        return False
    return (current_imbalance - new_imbalance) / current_imbalance > threshold
