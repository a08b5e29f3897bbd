"""kernels/csrc/moe_dispatch.c against oracles written here: plan_dispatch's replicas against a plain
loop of the round-robin rule and its batches against a per-worker brute force (sorted by
(owner, replica), tokens by `np.unique`); check_groups against the same conditions evaluated one by
one, each refusal with the index it names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moemesh.kernels import moe_dispatch

lib = moe_dispatch.library()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler")


def round_robin(topk_ids: np.ndarray, log2phy: np.ndarray | None, counts: np.ndarray) -> np.ndarray:
    """The n-th entry (token order) of an expert takes its replica n % count."""
    if log2phy is None:
        return topk_ids.reshape(-1).copy()
    seen: dict[int, int] = {}
    out = []
    for e in topk_ids.reshape(-1).tolist():
        out.append(int(log2phy[e, seen.get(e, 0) % counts[e]]))
        seen[e] = seen.get(e, 0) + 1
    return np.array(out)


def random_layer(rng, num_experts: int, num_workers: int, identity: bool):
    """(log2phy or None, replica counts, slot owner): each expert on 1-3 slots, slots spread over
    the workers in no particular order (some workers may own nothing)."""
    if identity:
        return None, np.ones(num_experts, dtype=np.int64), rng.integers(0, num_workers, num_experts)
    counts = rng.integers(1, 4, num_experts)
    phy2log = rng.permutation(np.repeat(np.arange(num_experts), counts))
    log2phy = np.full((num_experts, counts.max()), -1)
    for e in range(num_experts):
        log2phy[e, : counts[e]] = np.flatnonzero(phy2log == e)
    return log2phy, counts, rng.integers(0, num_workers, phy2log.size)


@pytest.mark.parametrize("seed", range(24))
def test_plan_matches_the_round_robin_rule_and_a_per_worker_brute_force(seed):
    rng = np.random.default_rng(seed)
    num_experts, top_k = int(rng.integers(2, 20)), int(rng.integers(1, 5))
    top_k = min(top_k, num_experts)
    num_tokens, num_workers = int(rng.integers(1, 40)), int(rng.integers(1, 5))
    log2phy, counts, owner = random_layer(rng, num_experts, num_workers, identity=seed % 3 == 0)
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)])
    weights = torch.from_numpy(rng.random((num_tokens, top_k), dtype=np.float32))
    plan = moe_dispatch.plan_dispatch(
        lib, moe_dispatch.LayerTables.build(log2phy, counts, owner), torch.from_numpy(ids), weights
    )

    flat = round_robin(ids, log2phy, counts)
    n = flat.size
    expected_order = sorted(range(n), key=lambda i: (owner[flat[i]], flat[i], i))  # stable by construction
    assert plan.order.tolist() == expected_order
    assert plan.replicas.tolist() == flat[expected_order].tolist()
    assert plan.experts.tolist() == ids.reshape(-1)[expected_order].tolist()
    assert plan.tokens.tolist() == [i // top_k for i in expected_order]
    assert torch.equal(plan.weights, weights.reshape(-1)[expected_order])

    workers = sorted(set(owner[flat].tolist()))
    assert plan.batches[:, 0].tolist() == workers
    for worker, begin, end, g0, g1, t0, t1 in plan.batches.tolist():
        mine = [p for p in range(n) if owner[plan.replicas[p]] == worker]
        assert (begin, end) == (mine[0], mine[-1] + 1) and mine == list(range(begin, end))
        tokens = np.unique(plan.tokens[begin:end])
        assert plan.token_ids[t0:t1].tolist() == tokens.tolist()
        assert plan.token_ids[t0:t1][plan.rows[begin:end]].tolist() == plan.tokens[begin:end].tolist()
        slots, first, sizes = np.unique(plan.replicas[begin:end], return_index=True, return_counts=True)
        assert plan.group_slots[g0:g1].tolist() == slots.tolist()
        assert plan.group_sizes[g0:g1].tolist() == sizes.tolist()
        assert plan.group_experts[g0:g1].tolist() == plan.experts[begin:end][first].tolist()


def test_plan_refuses_ids_the_placement_has_no_replica_of():
    tables = moe_dispatch.LayerTables.build(np.array([[0, 1], [2, -1]]), np.array([2, 1]), np.array([0, 0, 1]))
    weights = torch.ones(1, 2)
    with pytest.raises(ValueError, match="expert ids \\[0, 5\\] are not all in the placement"):
        moe_dispatch.plan_dispatch(lib, tables, torch.tensor([[0, 5]]), weights)
    broken = moe_dispatch.LayerTables.build(np.array([[0, 1], [7, -1]]), np.array([2, 1]), np.array([0, 0, 1]))
    with pytest.raises(ValueError, match="a replica outside the slots"):
        moe_dispatch.plan_dispatch(lib, broken, torch.tensor([[1, 0]]), weights)
    empty = moe_dispatch.LayerTables.build(np.array([[0, 1], [2, -1]]), np.array([2, 0]), np.array([0, 0, 1]))
    with pytest.raises(ValueError, match="without a replica"):
        moe_dispatch.plan_dispatch(lib, empty, torch.tensor([[1, 0]]), weights)


def test_plan_refuses_tensors_it_cannot_read():
    tables = moe_dispatch.LayerTables.build(None, np.ones(4), np.zeros(4))
    ids = torch.tensor([[0, 1], [2, 3]])
    for bad_ids, bad_weights in (
        (ids.int(), torch.ones(2, 2)),
        (ids, torch.ones(2, 2, dtype=torch.bfloat16)),
        (ids.t(), torch.ones(2, 2)),
        (ids, torch.ones(2, 3)),
    ):
        with pytest.raises(TypeError, match="contiguous CPU int64 ids and float32 weights"):
            moe_dispatch.plan_dispatch(lib, tables, bad_ids, bad_weights)


def test_an_empty_round_plans_no_batches():
    tables = moe_dispatch.LayerTables.build(None, np.ones(4), np.zeros(4))
    plan = moe_dispatch.plan_dispatch(lib, tables, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    assert plan.batches.shape == (0, 7) and plan.order.size == 0


# a worker holding slots 1 and 3 of 5; slot s holds expert 10 + s in this layer
LOCAL_INDEX = np.array([-1, 0, -1, 1, -1])
PHY2LOG = np.array([10, 11, 12, 13, 14])


def check(slots, experts, sizes, row_ids, num_rows=4):
    i32 = lambda v: np.array(v, dtype=np.int32)  # noqa: E731
    return moe_dispatch.check_groups(
        lib, i32(slots), i32(experts), i32(sizes), i32(row_ids), num_rows, LOCAL_INDEX, PHY2LOG
    )


def test_check_groups_returns_the_local_replicas_and_int64_rows():
    local, sizes, rows = check([1, 3], [11, 13], [2, 1], [0, 3, 2])
    assert local.tolist() == [0, 1] and sizes.tolist() == [2, 1] and rows.tolist() == [0, 3, 2]
    assert local.dtype == sizes.dtype == rows.dtype == np.int64
    local, sizes, rows = check([], [], [], [])
    assert local.size == sizes.size == rows.size == 0


@pytest.mark.parametrize(
    "case, expected",
    [
        (([1, 5], [11, 15], [1, 1], [0, 1]), ("bad_slot", 1)),
        (([1, -1], [11, 0], [1, 1], [0, 1]), ("bad_slot", 1)),
        (([3, 1], [13, 11], [1, -2], [0]), ("bad_size", 1)),
        (([1, 2], [11, 12], [1, 1], [0, 1]), ("not_local", 1)),
        (([1, 3], [11, 12], [1, 1], [0, 1]), ("wrong_expert", 1)),
        (([1, 3], [11, 13], [1, 2], [0, 1]), ("row_count", 3)),
        (([1, 3], [11, 13], [1, 2], [0, 1, 4]), ("bad_row", 2)),
        (([1], [11], [2], [-1, 0]), ("bad_row", 0)),
    ],
)
def test_check_groups_names_the_first_bad_group_or_row(case, expected):
    assert check(*case) == expected
