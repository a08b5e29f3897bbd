"""The refined EPLB plan (`plan_from_scratch`, what the operator publishes) against DeepSeek's
policy (`plan_deepseek`) on seeded skewed loads: never a higher max/mean worker load in any
layer, the same slots per worker, every expert served, every expert group on one node
(hierarchical layouts); on the benchmark's Pareto(1.2) loads strictly lower."""

import numpy as np
import pytest

from moemesh.operator.eplb import EplbLayout, plan_deepseek, plan_from_scratch

LAYOUTS = [
    EplbLayout(num_experts=16, num_slots=20, num_workers=4),
    EplbLayout(num_experts=32, num_slots=48, num_workers=8, num_groups=4, num_nodes=2),
    EplbLayout(num_experts=64, num_slots=80, num_workers=8),
    EplbLayout(num_experts=64, num_slots=72, num_workers=8, num_groups=8, num_nodes=4),
    EplbLayout(num_experts=256, num_slots=288, num_workers=32, num_groups=8, num_nodes=4),
]


def skewed_load(kind: str, rng, num_layers: int, num_experts: int) -> np.ndarray:
    if kind == "gamma":
        return rng.gamma(0.4, 100.0, size=(num_layers, num_experts)).round()
    return (rng.pareto(1.2, size=(num_layers, num_experts)) + 1.0) * 100.0  # the benchmark's loads


def per_layer_ratio(plan) -> np.ndarray:  # [num_layers] max / mean worker load
    return plan.worker_loads.max(axis=1) / plan.worker_loads.mean(axis=1)


def groups_per_node(phy2log: np.ndarray, layout: EplbLayout) -> list[list[set]]:
    """Per layer, per node: the expert groups whose replicas sit there."""
    group_size = layout.num_experts // layout.num_groups
    per_node = phy2log.reshape(phy2log.shape[0], layout.num_nodes, -1) // group_size
    return [[set(node.tolist()) for node in layer] for layer in per_node]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda l: f"E{l.num_experts}S{l.num_slots}W{l.num_workers}N{l.num_nodes}"
)
@pytest.mark.parametrize("kind", ["gamma", "pareto"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_refined_plan_is_never_worse_than_deepseeks_and_keeps_its_constraints(layout, kind, seed):
    weight = skewed_load(kind, np.random.default_rng(seed), 6, layout.num_experts)
    deepseek, refined = plan_deepseek(weight, layout), plan_from_scratch(weight, layout)
    assert (per_layer_ratio(refined) <= per_layer_ratio(deepseek) * (1 + 1e-9)).all()
    assert refined.imbalance <= deepseek.imbalance * (1 + 1e-9)
    assert refined.phy2log.shape == deepseek.phy2log.shape == (6, layout.num_slots)  # same slots per worker
    assert (refined.replica_counts >= 1).all()  # every expert keeps a replica
    assert (refined.replica_counts.sum(axis=1) == layout.num_slots).all()
    np.testing.assert_allclose(refined.worker_loads.sum(axis=1), weight.sum(axis=1))  # every token lands somewhere
    if layout.hierarchical:
        for layer in groups_per_node(refined.phy2log, layout):
            assert sum(len(groups) for groups in layer) == layout.num_groups  # no group split over nodes
        assert groups_per_node(refined.phy2log, layout) == groups_per_node(deepseek.phy2log, layout)


@pytest.mark.parametrize(
    "layout",
    [EplbLayout(256, 288, 32), EplbLayout(256, 288, 32, num_groups=8, num_nodes=4)],
    ids=["global", "hierarchical"],
)
def test_on_the_benchmark_pareto_loads_the_refined_plan_is_strictly_better(layout):
    weight = skewed_load("pareto", np.random.default_rng(0), 58, 256)  # DeepSeek-V3: 58 MoE layers
    deepseek, refined = plan_deepseek(weight, layout), plan_from_scratch(weight, layout)
    assert refined.imbalance < deepseek.imbalance - 1e-3
    assert (per_layer_ratio(refined) < per_layer_ratio(deepseek) - 1e-9).sum() >= 29  # most layers improve
