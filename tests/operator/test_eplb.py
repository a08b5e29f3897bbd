"""EPLB planner: hand-checkable cases and invariants on random loads."""

import numpy as np
import pytest

from moemesh.operator.eplb import (
    EplbError,
    EplbLayout,
    balanced_packing,
    imbalance,
    plan_from_scratch,
    replicate_experts,
    worker_loads,
)
from moemesh.operator.eplb_replan import count_moves, replan, should_publish


def test_replication_gives_each_extra_slot_to_the_highest_load_per_replica():
    phy2log, rank, counts = replicate_experts(np.array([[90.0, 10.0, 40.0, 10.0]]), 7)
    # extra slots: 90 -> 45 (e0), then 45 vs 40 -> e0 again (30), then 40 (e2)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 0, 2]]
    assert rank.tolist() == [[0, 0, 0, 0, 1, 2, 1]]
    assert counts.tolist() == [[3, 1, 2, 1]]


def test_balanced_packing_fills_packs_equally_heaviest_first():
    pack, rank = balanced_packing(np.array([[5.0, 1.0, 4.0, 2.0]]), 2)
    # 5 -> p0, 4 -> p1, 2 -> p1 (lighter), 1 -> p0
    assert pack.tolist() == [[0, 0, 1, 1]]
    assert rank.tolist() == [[0, 1, 0, 1]]


def test_global_plan_hand_example():
    layout = EplbLayout(num_experts=4, num_slots=6, num_workers=2)
    plan = plan_from_scratch(np.array([[90.0, 10.0, 10.0, 10.0]]), layout)
    # expert 0 gets 3 replicas of 30 tokens; two 30s must share a worker (3 slots each).
    assert plan.replica_counts.tolist() == [[3, 1, 1, 1]]
    assert sorted(plan.worker_loads[0].tolist()) == [50.0, 70.0]
    assert plan.imbalance == pytest.approx(70 / 60)


def test_hierarchical_plan_keeps_each_group_on_one_node():
    # 4 experts in 2 groups of 2, 2 nodes x 1 worker, 3 slots per node.
    layout = EplbLayout(num_experts=4, num_slots=6, num_workers=2, num_groups=2, num_nodes=2)
    assert layout.hierarchical
    plan = plan_from_scratch(np.array([[60.0, 20.0, 30.0, 10.0]]), layout)
    node0, node1 = set(plan.phy2log[0, :3].tolist()), set(plan.phy2log[0, 3:].tolist())
    assert {frozenset(node0), frozenset(node1)} == {frozenset({0, 1}), frozenset({2, 3})}
    # group {0,1} (80 tokens) replicates expert 0; group {2,3} replicates expert 2.
    assert plan.replica_counts.tolist() == [[2, 1, 2, 1]]
    assert sorted(plan.worker_loads[0].tolist()) == [40.0, 80.0]


def test_layout_falls_back_to_global_when_groups_do_not_divide_over_nodes():
    layout = EplbLayout(num_experts=6, num_slots=8, num_workers=4, num_groups=3, num_nodes=2)
    assert not layout.hierarchical
    plan = plan_from_scratch(np.ones((2, 6)), layout)
    assert (plan.replica_counts >= 1).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_slots": 3}, "num_slots 3 must be >= num_experts 4"),
        ({"num_slots": 7}, "must divide evenly over 2 workers"),
        ({"num_nodes": 3}, "num_workers 2 must divide evenly over 3 nodes"),
        ({"num_groups": 3}, "num_experts 4 must divide into 3 groups"),
    ],
)
def test_invalid_layout_is_rejected(kwargs, message):
    with pytest.raises(EplbError, match=message):
        EplbLayout(**{"num_experts": 4, "num_slots": 6, "num_workers": 2, **kwargs})


def test_invalid_load_is_rejected():
    layout = EplbLayout(4, 6, 2)
    with pytest.raises(EplbError, match="load must be \\[num_layers, 4\\]"):
        plan_from_scratch(np.ones((2, 3)), layout)
    with pytest.raises(EplbError, match="finite and non-negative"):
        plan_from_scratch(np.array([[1.0, -1.0, 0.0, 0.0]]), layout)


LAYOUTS = [
    EplbLayout(num_experts=16, num_slots=20, num_workers=4),
    EplbLayout(num_experts=32, num_slots=48, num_workers=8, num_groups=4, num_nodes=2),
    EplbLayout(num_experts=12, num_slots=12, num_workers=3),
    EplbLayout(num_experts=64, num_slots=72, num_workers=8, num_groups=8, num_nodes=4),
]


def random_load(rng, num_layers, num_experts):
    return rng.gamma(0.4, 100.0, size=(num_layers, num_experts)).round()


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda l: f"E{l.num_experts}S{l.num_slots}W{l.num_workers}N{l.num_nodes}"
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scratch_plan_invariants_on_random_loads(layout, seed):
    rng = np.random.default_rng(seed)
    weight = random_load(rng, 5, layout.num_experts)
    plan = plan_from_scratch(weight, layout)
    assert plan.phy2log.shape == (5, layout.num_slots)
    assert (plan.replica_counts >= 1).all()
    assert (plan.replica_counts.sum(axis=1) == layout.num_slots).all()
    # loads conserve: every token lands on some worker
    np.testing.assert_allclose(plan.worker_loads.sum(axis=1), weight.sum(axis=1))
    np.testing.assert_allclose(plan.worker_loads, worker_loads(weight, plan.phy2log, layout))
    # never worse than serving without replication (expert e on worker e // experts_per_worker)
    if layout.num_experts % layout.num_workers == 0:
        baseline = np.repeat(np.arange(layout.num_experts), 1)[None, :].repeat(5, axis=0)
        base_layout = EplbLayout(layout.num_experts, layout.num_experts, layout.num_workers)
        assert plan.imbalance <= imbalance(worker_loads(weight, baseline, base_layout)) + 1e-9
    if layout.hierarchical:
        group_size = layout.num_experts // layout.num_groups
        slots_per_node = layout.num_slots // layout.num_nodes
        for layer in range(5):
            groups_per_node = [
                set((plan.phy2log[layer, n * slots_per_node : (n + 1) * slots_per_node] // group_size).tolist())
                for n in range(layout.num_nodes)
            ]
            assert sum(len(g) for g in groups_per_node) == layout.num_groups  # no group split


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda l: f"E{l.num_experts}S{l.num_slots}W{l.num_workers}N{l.num_nodes}"
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_migration_aware_replan_moves_no_more_and_balances_as_well(layout, seed):
    rng = np.random.default_rng(seed)
    before = random_load(rng, 4, layout.num_experts)
    current = plan_from_scratch(before, layout).phy2log
    after = before * rng.lognormal(0.0, 0.4, size=before.shape)
    result = replan(after, layout, current)
    assert result.moves <= result.scratch_moves
    assert result.moves == count_moves(current, result.plan.phy2log, layout)
    assert (result.plan.replica_counts >= 1).all()
    assert result.plan.imbalance <= result.scratch.imbalance * 1.02
    np.testing.assert_allclose(result.plan.worker_loads.sum(axis=1), after.sum(axis=1))


def test_replan_of_an_unchanged_load_moves_nothing():
    layout = LAYOUTS[0]
    weight = random_load(np.random.default_rng(3), 3, layout.num_experts)
    current = plan_from_scratch(weight, layout).phy2log
    result = replan(weight, layout, current)
    assert result.moves == 0
    np.testing.assert_array_equal(result.plan.phy2log, current)


def test_replan_hand_example_keeps_wanted_replicas_and_adds_two():
    # 4 experts, 6 slots, 2 workers; the hot expert changes from 0 to 3.
    layout = EplbLayout(num_experts=4, num_slots=6, num_workers=2)
    current = np.array([[0, 0, 1, 0, 2, 3]])  # e0 has 3 replicas
    result = replan(np.array([[30.0, 10.0, 10.0, 90.0]]), layout, current)
    # scratch wants e3 x3 and e0 x1: keep slots 0 (e0), 2 (e1), 4 (e2), 5 (e3); the two freed
    # slots (1 and 3) each take an e3 replica: loads 30+30+10 and 30+10+30.
    assert result.plan.replica_counts.tolist() == [[1, 1, 1, 3]]
    assert result.moves == 2
    assert result.moves <= result.scratch_moves
    assert result.plan.phy2log.tolist() == [[0, 3, 1, 3, 2, 3]]
    assert result.plan.worker_loads[0].tolist() == [70.0, 70.0]


def test_count_moves_ignores_slot_order_inside_a_worker():
    layout = EplbLayout(num_experts=4, num_slots=4, num_workers=2)
    assert count_moves(np.array([[0, 1, 2, 3]]), np.array([[1, 0, 3, 2]]), layout) == 0
    assert count_moves(np.array([[0, 1, 2, 3]]), np.array([[2, 1, 0, 3]]), layout) == 2


@pytest.mark.parametrize(
    "current, new, threshold, expected",
    [(1.5, 1.2, 0.1, True), (1.5, 1.4, 0.1, False), (1.0, 1.0, 0.0, False), (1.2, 1.3, 0.0, False)],
)
def test_publish_rule_needs_a_relative_improvement_above_the_threshold(current, new, threshold, expected):
    assert should_publish(current, new, threshold) is expected
