"""EPLB planner: expert replicas and their placement from per-expert load (pure numpy, no torch).

This is the expert-parallel load balancer DeepSeek published for DeepSeek-V3, written from its
description:

- hierarchical policy (expert groups divide evenly over nodes): pack the expert groups onto the
  nodes so every node gets the same number of groups and the most even load; inside each node,
  replicate experts (each extra slot goes to the expert with the highest load per replica); then
  pack the node's replicas onto its workers so each worker gets the same number of slots and the
  most even load;
- global policy (otherwise): the same with one group and one node: replicate over all slots and
  pack all replicas onto all workers.

``plan_deepseek`` is that policy as published; ``plan_from_scratch`` (what the operator uses)
refines it with ``moemesh.operator.eplb_refine``: replica swaps and replica re-counts that lower
each layer's most loaded worker without adding slots or moving a replica to another node.

Every step is vectorised over rows (layers, or layers x nodes), so planning 61 layers x 256
experts x 288 slots costs a few milliseconds. Slot s belongs to worker ``s // slots_per_worker``
and workers ``[n * workers_per_node, (n + 1) * workers_per_node)`` form node n.

A replica serves ``load[expert] / replica_count[expert]`` tokens (dispatchers split an expert's
tokens evenly over its replicas); a worker's load is the sum over its slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moemesh.operator.eplb_refine import refine_rows


class EplbError(ValueError):
    """Planner inputs that cannot describe a valid layout."""


@dataclass(frozen=True)
class EplbLayout:
    """The shape of the expert deployment the planner fills."""

    num_experts: int  # logical experts per MoE layer
    num_slots: int  # physical slots per layer over all workers (num_experts + redundant)
    num_workers: int  # expert workers (GPUs)
    num_groups: int = 1  # expert groups (DeepSeek-V3: 8 groups of 32)
    num_nodes: int = 1  # nodes the workers spread over, each with num_workers / num_nodes

    def __post_init__(self) -> None:
        if min(self.num_experts, self.num_slots, self.num_workers, self.num_groups, self.num_nodes) < 1:
            raise EplbError(f"every count must be >= 1: {self}")
        if self.num_slots < self.num_experts:
            raise EplbError(f"num_slots {self.num_slots} must be >= num_experts {self.num_experts}")
        if self.num_slots % self.num_workers:
            raise EplbError(f"num_slots {self.num_slots} must divide evenly over {self.num_workers} workers")
        if self.num_workers % self.num_nodes:
            raise EplbError(f"num_workers {self.num_workers} must divide evenly over {self.num_nodes} nodes")
        if self.num_experts % self.num_groups:
            raise EplbError(f"num_experts {self.num_experts} must divide into {self.num_groups} groups")

    @property
    def slots_per_worker(self) -> int:
        return self.num_slots // self.num_workers

    @property
    def hierarchical(self) -> bool:
        """Groups divide evenly over nodes (and experts/slots over nodes)."""
        return self.num_groups % self.num_nodes == 0 and self.num_slots % self.num_nodes == 0 and self.num_nodes > 1

    @property
    def slot_worker(self) -> np.ndarray:
        """[num_slots] worker index of each slot."""
        return np.repeat(np.arange(self.num_workers), self.slots_per_worker)


@dataclass(frozen=True, eq=False)
class Plan:
    phy2log: np.ndarray  # [num_layers, num_slots] logical expert held by each slot
    replica_counts: np.ndarray  # [num_layers, num_experts]
    worker_loads: np.ndarray  # [num_layers, num_workers] predicted tokens per worker
    imbalance: float  # sum over layers of max worker load / sum of mean worker load


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack each row's items into ``num_packs`` packs of equal item count, evening pack weights.

    weight: [num_rows, num_items]. Greedy: heaviest item first, into the lightest pack that still
    has room. Returns (pack_index, rank_in_pack), both [num_rows, num_items].
    """
    num_rows, num_items = weight.shape
    assert num_items % num_packs == 0, (num_items, num_packs)
    capacity = num_items // num_packs
    rows = np.arange(num_rows)
    pack_index = np.empty((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, num_items), dtype=np.int64)
    if capacity == 1:
        order = np.argsort(-weight, axis=1, kind="stable")
        pack_index[rows[:, None], order] = np.arange(num_items)
        rank_in_pack[:] = 0
        return pack_index, rank_in_pack
    order = np.argsort(-weight, axis=1, kind="stable")  # [num_rows, num_items]
    pack_weight = np.zeros((num_rows, num_packs))
    pack_count = np.zeros((num_rows, num_packs), dtype=np.int64)
    for step in range(num_items):
        item = order[:, step]
        candidates = np.where(pack_count < capacity, pack_weight, np.inf)
        pack = np.argmin(candidates, axis=1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_count[rows, pack]
        pack_count[rows, pack] += 1
        pack_weight[rows, pack] += weight[rows, item]
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_replicas: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give each row's experts ``num_replicas`` replicas in total, at least one each.

    weight: [num_rows, num_experts]. Each extra replica goes to the expert with the highest load
    per replica. Returns phy2log [num_rows, num_replicas], replica rank [num_rows, num_replicas]
    and replica counts [num_rows, num_experts].
    """
    num_rows, num_experts = weight.shape
    assert num_replicas >= num_experts
    rows = np.arange(num_rows)
    phy2log = np.empty((num_rows, num_replicas), dtype=np.int64)
    rank = np.zeros((num_rows, num_replicas), dtype=np.int64)
    phy2log[:, :num_experts] = np.arange(num_experts)
    counts = np.ones((num_rows, num_experts), dtype=np.int64)
    for slot in range(num_experts, num_replicas):
        expert = np.argmax(weight / counts, axis=1)
        phy2log[:, slot] = expert
        rank[:, slot] = counts[rows, expert]
        counts[rows, expert] += 1
    return phy2log, rank, counts


def _inverse(permutation: np.ndarray) -> np.ndarray:
    """Row-wise inverse of a [num_rows, n] permutation."""
    inverse = np.empty_like(permutation)
    np.put_along_axis(inverse, permutation, np.arange(permutation.shape[1])[None, :], axis=1)
    return inverse


def _place_hierarchical(weight: np.ndarray, layout: EplbLayout, num_groups: int, num_nodes: int) -> np.ndarray:
    """phy2log [num_layers, num_slots] by the hierarchical policy with the given groups/nodes."""
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_experts // num_nodes
    slots_per_node = layout.num_slots // num_nodes
    workers_per_node = layout.num_workers // num_nodes

    # 1. expert groups -> nodes; mlog ("middle" ids) number experts node by node.
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1)  # [L, G]
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    group_mlog = (group_pack * groups_per_node + group_rank) * group_size  # [L, G]
    log2mlog = (group_mlog[:, :, None] + np.arange(group_size)).reshape(num_layers, num_experts)
    mlog2log = _inverse(log2mlog)  # [L, E]

    # 2. replicate inside each node.
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, experts_per_node)
    phy2mlog, _, mlog_counts = replicate_experts(tokens_per_mlog, slots_per_node)  # [L*N, S/N]

    # 3. node replicas -> the node's workers.
    tokens_per_replica = np.take_along_axis(tokens_per_mlog / mlog_counts, phy2mlog, axis=1)
    pack_index, rank_in_pack = balanced_packing(tokens_per_replica, workers_per_node)
    phy2pphy = pack_index * layout.slots_per_worker + rank_in_pack
    pphy2mlog = np.take_along_axis(phy2mlog, _inverse(phy2pphy), axis=1)
    node_offset = (np.arange(num_nodes) * experts_per_node)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + node_offset).reshape(num_layers, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


def worker_loads(weight: np.ndarray, phy2log: np.ndarray, layout: EplbLayout) -> np.ndarray:
    """[num_layers, num_workers] predicted tokens per worker for ``phy2log`` under ``weight``."""
    num_layers = weight.shape[0]
    offsets = np.arange(num_layers)[:, None] * layout.num_experts
    counts = np.bincount((phy2log + offsets).ravel(), minlength=num_layers * layout.num_experts)
    counts = counts.reshape(num_layers, layout.num_experts)
    per_replica = np.take_along_axis(weight / np.maximum(counts, 1), phy2log, axis=1)
    return per_replica.reshape(num_layers, layout.num_workers, layout.slots_per_worker).sum(-1)


def imbalance(loads: np.ndarray) -> float:
    """Sum over layers of max worker load / sum of mean worker load (1.0 = perfect, or no load).

    Each MoE layer waits for its most loaded worker, so this is the step-time ratio to perfect.
    """
    mean = float(loads.mean(axis=1).sum())
    return float(loads.max(axis=1).sum()) / mean if mean > 0 else 1.0


def validate_load(weight: np.ndarray, layout: EplbLayout) -> np.ndarray:
    array = np.asarray(weight, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != layout.num_experts or array.shape[0] < 1:
        raise EplbError(f"load must be [num_layers, {layout.num_experts}], got {array.shape}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise EplbError("load must be finite and non-negative")
    return array


def plan_deepseek(weight: np.ndarray, layout: EplbLayout) -> Plan:
    """DeepSeek's EPLB policy, unrefined: the baseline ``plan_from_scratch`` improves on."""
    weight = validate_load(weight, layout)
    if layout.hierarchical:
        phy2log = _place_hierarchical(weight, layout, layout.num_groups, layout.num_nodes)
    else:
        phy2log = _place_hierarchical(weight, layout, 1, 1)
    return make_plan(weight, phy2log, layout)


def refine_placement(
    weight: np.ndarray,  # [num_layers, num_experts]
    phy2log: np.ndarray,  # [num_layers, num_slots]
    layout: EplbLayout,
    stop_at: np.ndarray | None = None,  # [num_layers] stop a layer once its max worker load is <= this
) -> np.ndarray:
    """[num_layers, num_slots] ``phy2log`` with a lower (never higher) max worker load per layer.

    Same slots per worker; replicas only move and re-count inside their node (hierarchical
    policy), so a placement whose groups each sit on one node keeps them there."""
    num_layers = weight.shape[0]
    num_nodes = layout.num_nodes if layout.hierarchical else 1
    rows = refine_rows(
        np.repeat(weight, num_nodes, axis=0),  # [num_layers * num_nodes, num_experts]
        phy2log.reshape(num_layers * num_nodes, -1),  # [num_layers * num_nodes, slots_per_node]
        layout.slots_per_worker,
        stop_at=None if stop_at is None else np.repeat(stop_at, num_nodes),
    )
    return rows.reshape(num_layers, layout.num_slots)


def plan_from_scratch(weight: np.ndarray, layout: EplbLayout) -> Plan:
    """Replicate and place every layer's experts from ``weight`` [num_layers, num_experts].

    DeepSeek's policy (``plan_deepseek``) then ``refine_placement``: never a higher max worker
    load than DeepSeek's plan in any layer, under the same slot and group/node constraints."""
    weight = validate_load(weight, layout)
    baseline = plan_deepseek(weight, layout)
    return make_plan(weight, refine_placement(weight, baseline.phy2log, layout), layout)


def make_plan(weight: np.ndarray, phy2log: np.ndarray, layout: EplbLayout) -> Plan:
    num_layers = weight.shape[0]
    offsets = np.arange(num_layers)[:, None] * layout.num_experts
    counts = np.bincount((phy2log + offsets).ravel(), minlength=num_layers * layout.num_experts)
    loads = worker_loads(weight, phy2log, layout)
    return Plan(
        phy2log=phy2log,
        replica_counts=counts.reshape(num_layers, layout.num_experts),
        worker_loads=loads,
        imbalance=imbalance(loads),
    )
