"""Grouping one MoE layer's routed entries by expert worker, and combining the replies.

An *entry* is one (token, top-k slot) pair of the layer: num_tokens * top_k of them, flattened
token-major. Gating gives each entry a logical expert, the placement a replica (slot). The plan
sorts the entries by (owning worker, replica) (stable, so tokens stay ascending within a replica:
the order the local grouped GEMM uses) and cuts them into one contiguous run per worker
(`split_by_worker`); `group_by_worker` does the same for entries in any order (re-dispatch). Each worker receives
the hidden states of the tokens it needs once, the entries as row indices grouped by replica with
their gate weights, and returns its weighted partial sum per token (the combine runs on the expert
side; the remote executor adds the partials).

`plan_layer` is what the remote executor calls: replicas and the split in one C call
(kernels/csrc/moe_dispatch.c; the same plan as `sort_entries` + `split_by_worker`, with fewer calls
on a path that runs from cold caches), or with numpy where no C compiler is found.
`reroute` moves entries off workers that are down onto other replicas of the same expert.
Pure numpy/torch on the CPU; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moemesh import kernels


@dataclass(frozen=True)
class WorkerBatch:
    """What one expert worker computes for one layer."""

    worker: int  # index into the placement's worker_ids
    positions: np.ndarray  # [num_entries_w] where its outputs go in the sorted entry order
    token_ids: np.ndarray  # [num_tokens_w] distinct tokens it needs, ascending
    row_ids: np.ndarray  # [num_entries_w] row of token_ids for each entry, grouped by replica
    slots: np.ndarray  # [num_groups] replicas, ascending
    experts: np.ndarray  # [num_groups] logical expert of each replica
    group_sizes: np.ndarray  # [num_groups] entries per replica
    span: tuple[int, int] | None = None  # positions are range(*span) (a run of the sorted entries)

    @property
    def num_entries(self) -> int:
        return int(self.positions.size)


@dataclass(frozen=True)
class SortedEntries:
    """A layer's entries sorted by (owning worker, replica id), stable."""

    replicas: np.ndarray  # [num_entries] replica of each sorted entry
    experts: np.ndarray  # [num_entries] logical expert of each sorted entry
    tokens: np.ndarray  # [num_entries] token of each sorted entry
    order: np.ndarray  # [num_entries] index of each sorted entry in the flat [num_tokens * top_k]


def sort_entries(
    replica_ids: np.ndarray,  # [num_tokens, top_k]
    topk_ids: np.ndarray,  # [num_tokens, top_k]
    slot_owner: np.ndarray,  # [num_slots] worker index of each slot
) -> SortedEntries:
    top_k, num_slots = replica_ids.shape[1], slot_owner.size
    flat = replica_ids.reshape(-1)
    order = np.argsort(slot_owner[flat] * num_slots + flat, kind="stable")
    return SortedEntries(flat[order], topk_ids.reshape(-1)[order], order // top_k, order)


def split_by_worker(entries: SortedEntries, slot_owner: np.ndarray, num_tokens: int) -> list[WorkerBatch]:
    """`group_by_worker` of all the entries in their sorted order (positions 0..n-1), without
    re-sorting: each worker's entries are one run, each replica's a run inside it."""
    replicas = entries.replicas
    if replicas.size == 0:
        return []
    group_starts = np.flatnonzero(np.diff(replicas, prepend=-1))  # [num_groups] first entry of each replica
    group_sizes = np.diff(group_starts, append=replicas.size)
    group_owners = slot_owner[replicas[group_starts]]
    worker_starts = np.flatnonzero(np.diff(group_owners, prepend=-1)).tolist()  # first group of each worker
    bounds = [*group_starts[worker_starts].tolist(), replicas.size]  # entry range of each worker
    batches = []
    for i, (first, last) in enumerate(zip(worker_starts, [*worker_starts[1:], group_starts.size])):
        begin, end = bounds[i], bounds[i + 1]
        token_ids, row_ids = token_rows(entries.tokens[begin:end], num_tokens)
        starts = group_starts[first:last]
        batches.append(
            WorkerBatch(
                worker=int(group_owners[first]),
                positions=np.arange(begin, end),
                token_ids=token_ids,
                row_ids=row_ids,
                slots=replicas[starts],
                experts=entries.experts[starts],
                group_sizes=group_sizes[first:last],
                span=(begin, end),
            )
        )
    return batches


def plan_layer(
    tables: kernels.LayerTables,  # the placement's layer
    replica_ids,  # () -> [num_tokens, top_k] replica ids (the numpy path's; the C path maps them itself)
    topk_ids: torch.Tensor,  # [num_tokens, top_k] logical experts, on the CPU
    topk_weights: torch.Tensor,  # [num_tokens, top_k] gate weights, on the CPU
) -> tuple[SortedEntries, torch.Tensor, list[WorkerBatch]]:
    """(the sorted entries, their gate weights float32 [num_entries], one batch per worker)."""
    num_tokens = topk_ids.shape[0]
    plan = kernels.plan_expert_dispatch(tables, topk_ids.long().contiguous(), topk_weights.float().contiguous())
    if plan is None:  # no C library: the same plan with numpy
        entries = sort_entries(replica_ids().numpy(), topk_ids.numpy(), tables.slot_owner)
        weights = topk_weights.float().reshape(-1)[torch.from_numpy(entries.order)]
        return entries, weights, split_by_worker(entries, tables.slot_owner, num_tokens)
    batches = [
        WorkerBatch(
            worker=worker,
            positions=np.arange(begin, end),
            token_ids=plan.token_ids[first_token:last_token],
            row_ids=plan.rows[begin:end],
            slots=plan.group_slots[first:last],
            experts=plan.group_experts[first:last],
            group_sizes=plan.group_sizes[first:last],
            span=(begin, end),
        )
        for worker, begin, end, first, last, first_token, last_token in plan.batches.tolist()
    ]
    return SortedEntries(plan.replicas, plan.experts, plan.tokens, plan.order), plan.weights, batches


def token_rows(tokens: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct tokens ascending, the row of each entry among them): `np.unique(tokens,
    return_inverse=True)` for tokens in [0, num_tokens), by counting instead of sorting."""
    present = np.bincount(tokens, minlength=num_tokens) > 0
    if present.all():
        return np.arange(num_tokens), tokens
    return np.flatnonzero(present), (np.cumsum(present) - 1)[tokens]


def group_by_worker(
    replicas: np.ndarray,  # [n]
    experts: np.ndarray,  # [n]
    tokens: np.ndarray,  # [n]
    positions: np.ndarray,  # [n] positions in the sorted entry order
    slot_owner: np.ndarray,  # [num_slots] worker index of each slot
) -> list[WorkerBatch]:
    """One batch per worker that owns a replica of some entry, in worker order; within a batch
    entries are grouped by replica (stable: entry order kept inside a group)."""
    order = np.argsort(replicas, kind="stable")
    replicas, experts, tokens, positions = replicas[order], experts[order], tokens[order], positions[order]
    owners = slot_owner[replicas]  # [n]
    batches = []
    for worker in np.unique(owners):
        mine = np.flatnonzero(owners == worker)  # still sorted by replica
        slots, starts, sizes = np.unique(replicas[mine], return_index=True, return_counts=True)
        token_ids, row_ids = np.unique(tokens[mine], return_inverse=True)
        batches.append(
            WorkerBatch(
                worker=int(worker),
                positions=positions[mine],
                token_ids=token_ids,
                row_ids=row_ids.reshape(-1),
                slots=slots,
                experts=experts[mine][starts],
                group_sizes=sizes,
            )
        )
    return batches


def reroute(
    replicas: np.ndarray,  # [n] replica of each entry
    experts: np.ndarray,  # [n] logical expert of each entry
    slot_down: np.ndarray,  # [num_slots] bool: the slot's worker is down
    log2phy: np.ndarray,  # [num_experts, max_replicas] replicas of each expert (-1 padded), this layer
    replica_counts: np.ndarray,  # [num_experts]
) -> tuple[np.ndarray, list[int]]:
    """Entries on down slots moved to live replicas of their expert, round-robin in entry order.
    Returns (new replicas [n], experts that have no live replica: their entries stay put)."""
    moved = replicas.copy()
    stranded = []
    for expert in np.unique(experts[slot_down[replicas]]):
        candidates = log2phy[expert, : replica_counts[expert]]
        alive = candidates[~slot_down[candidates]]
        if alive.size == 0:
            stranded.append(int(expert))
            continue
        entries = np.flatnonzero((experts == expert) & slot_down[replicas])
        moved[entries] = alive[np.arange(entries.size) % alive.size]
    return moved, stranded


def gather_rows(hidden_states: torch.Tensor, token_ids: np.ndarray) -> torch.Tensor:  # [num_tokens_w, hidden]
    return hidden_states.index_select(0, torch.from_numpy(token_ids))
