"""A MoE layer's expert dispatch in C (csrc/moe_dispatch.c), one ctypes call per side.

`plan_dispatch` (the attention worker's remote executor): replicas by the round-robin rule, the
entries sorted by (owning worker, replica) and cut into per-worker batches, in one call instead
of ~25 numpy calls. `check_groups` (the expert worker): a request's replica groups and row ids
checked against its placement in one pass. Between two calls of a MoE layer the expert side
streams the experts' weights through the caches (~100 MB a layer at DeepSeek-like shapes), so
every small numpy call on this path runs from cold caches, several times slower than in a
microbenchmark; fewer calls is what makes dispatch cheap (benchmarks/expert_dispatch.py).

No compiler: `library()` is None, moemesh.kernels' plan_expert_dispatch / check_expert_groups say None
and the callers use their numpy paths (services/expert/client/dispatch_plan.py,
services/expert/server/servicer.py parse_call), which compute the same.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from moemesh.kernels.c_library import CSRC, compile_library

SOURCE = CSRC / "moe_dispatch.c"
BAD_EXPERT, BAD_SLOT, NO_MEMORY = -1, -2, -3  # plan_dispatch's codes
GROUP_ERRORS = {-1: "bad_slot", -2: "bad_size", -3: "not_local", -4: "wrong_expert", -5: "row_count", -6: "bad_row"}
BATCH_FIELDS = 7  # worker, entries [begin, end), groups [begin, end), tokens [begin, end)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    lib = compile_library(SOURCE, (), "dispatch plans with numpy")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.plan_dispatch.argtypes = [ptr, ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ptr]
    lib.check_groups.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr]
    lib.plan_dispatch.restype = lib.check_groups.restype = i64
    return lib


@dataclass(frozen=True)
class LayerTables:
    """One layer of a placement as plan_dispatch reads it (int64, contiguous, kept alive here)."""

    log2phy: np.ndarray | None  # [num_experts, max_replicas]; None: slot i holds expert i (identity)
    replica_counts: np.ndarray  # [num_experts]
    slot_owner: np.ndarray  # [num_slots]
    slot_rank: np.ndarray  # [num_slots] rank of each slot in (owner, slot) order
    args: tuple  # the tables' ctypes arguments

    @classmethod
    def build(cls, log2phy: np.ndarray | None, replica_counts: np.ndarray, slot_owner: np.ndarray) -> LayerTables:
        i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
        counts, owner = i64(replica_counts), i64(slot_owner)
        table = None if log2phy is None else i64(log2phy)
        rank = np.empty_like(owner)
        rank[np.argsort(owner, kind="stable")] = np.arange(owner.size)
        args = (
            None if table is None else table.ctypes.data,
            counts.ctypes.data,
            counts.size,
            1 if table is None else table.shape[1],
            owner.ctypes.data,
            rank.ctypes.data,
            owner.size,
        )
        return cls(table, counts, owner, rank, args)


@dataclass(frozen=True)
class DispatchPlan:
    """plan_dispatch's outputs: views of one int32 buffer (moe_dispatch.c names the layout)."""

    order: np.ndarray  # [n] flat entry index of each sorted entry
    replicas: np.ndarray  # [n]
    experts: np.ndarray  # [n]
    tokens: np.ndarray  # [n]
    rows: np.ndarray  # [n] row among its worker's tokens
    group_slots: np.ndarray  # [n] (the batches' group ranges index these four)
    group_experts: np.ndarray
    group_sizes: np.ndarray
    token_ids: np.ndarray  # [n] (the batches' token ranges)
    batches: np.ndarray  # [num_batches, 7]
    weights: torch.Tensor  # [n] float32 gate weight of each sorted entry


def plan_dispatch(
    lib: ctypes.CDLL, tables: LayerTables, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> DispatchPlan:
    """`topk_ids` int64 and `topk_weights` float32 [num_tokens, top_k], contiguous on the CPU
    (TypeError otherwise). ValueError naming the ids when some id has no replica in `tables`."""
    if (
        topk_ids.dtype != torch.int64
        or topk_weights.dtype != torch.float32
        or topk_ids.dim() != 2
        or topk_ids.shape != topk_weights.shape
        or not topk_ids.is_contiguous()
        or not topk_weights.is_contiguous()
        or not topk_ids.is_cpu
        or not topk_weights.is_cpu
    ):
        raise TypeError(
            f"plan_dispatch reads contiguous CPU int64 ids and float32 weights of one 2-d shape, got "
            f"{topk_ids.dtype} {list(topk_ids.shape)} and {topk_weights.dtype} {list(topk_weights.shape)}"
        )
    num_tokens, top_k = topk_ids.shape
    n = num_tokens * top_k
    out = np.empty(9 * n + BATCH_FIELDS * tables.slot_owner.size, dtype=np.int32)
    weights = torch.empty(n, dtype=torch.float32)
    num = lib.plan_dispatch(
        topk_ids.data_ptr(),
        topk_weights.data_ptr(),
        num_tokens,
        top_k,
        *tables.args,
        out.ctypes.data,
        weights.data_ptr(),
    )
    if num == NO_MEMORY:
        raise MemoryError("plan_dispatch: out of memory")
    if num < 0:
        why = "a replica outside the slots" if num == BAD_SLOT else "an id out of range or without a replica"
        raise ValueError(
            f"expert ids {sorted(set(topk_ids.view(-1).tolist()))} are not all in the placement "
            f"({tables.replica_counts.size} experts): {why}"
        )
    parts = out[: 9 * n].reshape(9, n)
    return DispatchPlan(*parts, out[9 * n : 9 * n + BATCH_FIELDS * num].reshape(num, BATCH_FIELDS), weights)


def check_groups(
    lib: ctypes.CDLL,
    slots: np.ndarray,
    experts: np.ndarray,
    sizes: np.ndarray,
    row_ids: np.ndarray,
    num_rows: int,
    local_index: np.ndarray,
    phy2log: np.ndarray,
):
    """(group_local int64 [G], group_rows int64 [G], row ids int64 [n]), or (error name, index):
    moe_dispatch.c's check_groups over int32 group/row arrays of equal group counts and int64
    tables (phy2log: the layer's row)."""
    if not slots.size == experts.size == sizes.size or phy2log.size != local_index.size:
        raise ValueError("check_groups: one slot, expert and size per group, and tables of one slot count")
    slots, experts, sizes, row_ids = (np.ascontiguousarray(a, dtype=np.int32) for a in (slots, experts, sizes, row_ids))
    local_index, phy2log = (np.ascontiguousarray(a, dtype=np.int64) for a in (local_index, phy2log))
    num_groups = slots.size
    out = np.empty(2 * num_groups + row_ids.size + 1, dtype=np.int64)  # moe_dispatch.c names the layout
    code = lib.check_groups(
        slots.ctypes.data,
        experts.ctypes.data,
        sizes.ctypes.data,
        num_groups,
        row_ids.ctypes.data,
        row_ids.size,
        num_rows,
        local_index.ctypes.data,
        phy2log.ctypes.data,
        local_index.size,
        out.ctypes.data,
    )
    if code:
        return GROUP_ERRORS[code], int(out[-1])
    return out[:num_groups], out[num_groups : 2 * num_groups], out[2 * num_groups : -1]
