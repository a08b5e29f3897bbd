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

from moemesh.operator.eplb import (
    EplbError,
    EplbLayout,
    Plan,
    make_plan,
    plan_deepseek,
    refine_placement,
    validate_load,
    worker_loads,
)

_EPS = 1e-9
_TOLERANCE = 0.005  # re-planning stops once a layer's max worker load is within 0.5 % of scratch's


@dataclass(frozen=True, eq=False)
class Replan:
    plan: Plan  # what to publish
    moves: int  # replicas to copy to go from the current placement to ``plan``
    scratch: Plan  # the from-scratch plan, for comparison
    scratch_moves: int
    current_imbalance: float  # the current placement under the same load


def count_moves(old_phy2log: np.ndarray, new_phy2log: np.ndarray, layout: EplbLayout) -> int:
    """Replicas in ``new`` that their worker does not already hold in ``old`` (all layers)."""
    return int(_layer_moves(old_phy2log, new_phy2log, layout).sum())


def _layer_moves(old_phy2log: np.ndarray, new_phy2log: np.ndarray, layout: EplbLayout) -> np.ndarray:
    """[num_layers] ``count_moves`` of each layer: per worker, the multiset difference new - old
    of its slots' experts (a worker's slots are compared pairwise: slots_per_worker is small)."""
    num_layers, spw = old_phy2log.shape[0], layout.slots_per_worker
    old = old_phy2log.reshape(num_layers, layout.num_workers, spw)
    new = new_phy2log.reshape(num_layers, layout.num_workers, spw)
    in_old = (new[..., :, None] == old[..., None, :]).sum(-1)  # [L, W, spw] copies the worker held before
    earlier = np.tril(np.ones((spw, spw), dtype=bool), -1)  # [i, j]: j < i
    rank = ((new[..., :, None] == new[..., None, :]) & earlier).sum(-1)  # earlier copies of the same expert
    return (rank >= in_old).reshape(num_layers, -1).sum(axis=1)


def _node_counts(phy2log: np.ndarray, num_nodes: int, num_experts: int) -> np.ndarray:
    """[num_layers, num_nodes, num_experts] replicas of each expert on each node."""
    num_layers, num_slots = phy2log.shape
    node = np.arange(num_slots) // (num_slots // num_nodes)
    index = (np.arange(num_layers)[:, None] * num_nodes + node) * num_experts + phy2log
    counts = np.bincount(index.ravel(), minlength=num_layers * num_nodes * num_experts)
    return counts.reshape(num_layers, num_nodes, num_experts)


def _relabel_nodes(demand: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Permute each layer's scratch nodes onto the current nodes they overlap most (greedy)."""
    num_layers, num_nodes, _ = demand.shape
    if num_nodes == 1:
        return demand
    layers = np.arange(num_layers)
    overlap = np.minimum(demand[:, :, None, :], current[:, None, :, :]).sum(-1).astype(np.float64)  # [L, N, N]
    target = np.empty((num_layers, num_nodes), dtype=np.int64)  # current node of each scratch node
    for _ in range(num_nodes):
        scratch_node, current_node = np.divmod(np.argmax(overlap.reshape(num_layers, -1), axis=1), num_nodes)
        target[layers, scratch_node] = current_node
        overlap[layers, scratch_node, :] = -1.0
        overlap[layers, :, current_node] = -1.0
    relabelled = np.empty_like(demand)
    relabelled[layers[:, None], target] = demand
    return relabelled


def _keep_and_fill(
    per_replica: np.ndarray,  # [R, E] tokens per replica under the new demand
    current: np.ndarray,  # [R, S] experts now held by each row's slots
    demand: np.ndarray,  # [R, E] replicas wanted in each row
    slots_per_worker: int,
) -> np.ndarray:
    """[R, S]: every current replica still wanted stays; freed slots take the missing replicas,
    heaviest first, on the least loaded worker with a free slot (preferring one without a copy)."""
    num_rows, num_slots = current.shape
    num_experts = demand.shape[1]
    num_workers = num_slots // slots_per_worker
    rows = np.arange(num_rows)
    key = (current + rows[:, None] * num_experts).ravel()
    order = np.argsort(key, kind="stable")
    occurrence = np.empty(key.size, dtype=np.int64)
    occurrence[order] = np.arange(key.size) - np.searchsorted(key[order], key[order])
    keep = occurrence.reshape(num_rows, num_slots) < np.take_along_axis(demand, current, axis=1)
    new = np.where(keep, current, -1)
    slot_load = np.where(keep, np.take_along_axis(per_replica, current, axis=1), 0.0)
    loads = slot_load.reshape(num_rows, num_workers, slots_per_worker).sum(-1)  # [R, W]

    kept = np.bincount((np.where(keep, current, 0) + rows[:, None] * num_experts)[keep], minlength=demand.size)
    missing = demand.ravel() - kept  # [R * E]
    to_place = np.repeat(np.arange(demand.size), np.maximum(missing, 0))  # row * E + expert, grouped by row
    row_of = to_place // num_experts
    expert_of = to_place % num_experts
    heaviest_first = np.lexsort((-per_replica.ravel()[to_place], row_of))
    row_of, expert_of = row_of[heaviest_first], expert_of[heaviest_first]
    rank = np.arange(row_of.size) - np.searchsorted(row_of, row_of)  # position in its row's queue
    for step in range(int(rank.max(initial=-1)) + 1):
        pick = rank == step
        r, expert = row_of[pick], expert_of[pick]
        by_worker = new[r].reshape(r.size, num_workers, slots_per_worker)
        free = by_worker == -1
        has_free = free.any(-1)  # [n, W]
        holds = (by_worker == expert[:, None, None]).any(-1)
        score = np.where(has_free, loads[r], np.inf)
        score = np.where(holds & (has_free & ~holds).any(-1, keepdims=True), np.inf, score)
        worker = np.argmin(score, axis=1)
        slot = worker * slots_per_worker + np.argmax(free[np.arange(r.size), worker], axis=1)
        new[r, slot] = expert
        loads[r, worker] += per_replica[r, expert]
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
    if current_phy2log.min() < 0 or current_phy2log.max() >= layout.num_experts:
        raise EplbError(f"current placement holds expert ids outside [0, {layout.num_experts})")
    num_layers = weight.shape[0]
    baseline = plan_deepseek(weight, layout)
    scratch = make_plan(weight, refine_placement(weight, baseline.phy2log, layout), layout)
    scratch_layer_moves = _layer_moves(current_phy2log, scratch.phy2log, layout)
    current_plan = make_plan(weight, current_phy2log, layout)

    num_nodes = layout.num_nodes if layout.hierarchical else 1
    demand = _node_counts(scratch.phy2log, num_nodes, layout.num_experts)
    demand = _relabel_nodes(demand, _node_counts(current_phy2log, num_nodes, layout.num_experts))
    per_replica = weight / np.maximum(demand.sum(axis=1), 1)  # [num_layers, num_experts]
    filled = _keep_and_fill(
        np.repeat(per_replica, num_nodes, axis=0),
        current_phy2log.reshape(num_layers * num_nodes, -1),
        demand.reshape(num_layers * num_nodes, -1),
        layout.slots_per_worker,
    ).reshape(num_layers, -1)
    baseline_max = baseline.worker_loads.max(axis=1)
    target = np.minimum(scratch.worker_loads.max(axis=1) * (1 + _TOLERANCE), baseline_max)
    phy2log = refine_placement(weight, filled, layout, stop_at=target)

    # per layer: the re-plan if it is no worse than DeepSeek's plan and moves no more than
    # scratch, else the scratch plan.
    layer_moves = _layer_moves(current_phy2log, phy2log, layout)
    layer_max = worker_loads(weight, phy2log, layout).max(axis=1)
    use = (layer_max <= baseline_max * (1 + _EPS)) & (layer_moves <= scratch_layer_moves)
    phy2log = np.where(use[:, None], phy2log, scratch.phy2log)
    moves = int(np.where(use, layer_moves, scratch_layer_moves).sum())
    return Replan(
        make_plan(weight, phy2log, layout), moves, scratch, int(scratch_layer_moves.sum()), current_plan.imbalance
    )


def should_publish(current_imbalance: float, new_imbalance: float, threshold: float) -> bool:
    """Publish only when the predicted max/mean load improves by more than ``threshold``
    (relative: ``(current - new) / current > threshold``, e.g. 0.05 = 5 %)."""
    if current_imbalance <= 0:
        return False
    return (current_imbalance - new_imbalance) / current_imbalance > threshold
