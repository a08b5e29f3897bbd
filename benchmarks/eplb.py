"""EPLB planner benchmark: DeepSeek's policy vs the refined plan, planning time at DeepSeek-V3
scale, and scratch vs migration-aware re-planning.

    python benchmarks/eplb.py [--layers 61] [--experts 256] [--slots 288] [--workers 32]

First table: on Pareto(1.2) loads (heavy-tailed expert popularity) for DeepSeek-V3's 58 MoE
layers x 256 experts -> 288 slots on 32 workers (global, and hierarchical over 4 nodes) and two
other shapes, the imbalance of DeepSeek's policy (`plan_deepseek`, which reproduces DeepSeek's
eplb.py) vs the refined plan the operator publishes (`plan_from_scratch`), each one's planning
time, and the migration-aware re-plan after a log-normal(0.3) drift (time, replica moves).

Load is synthetic: a per-(layer, expert) gamma-distributed popularity (skewed, as measured MoE
routing is) drifted by a log-normal factor between two windows. The table compares the current
placement (planned for the first window), a from-scratch plan and the migration-aware re-plan on
the second window: imbalance = sum over layers of max / mean worker load; moves = replicas that
must be copied to a worker.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import print_table  # noqa: E402

from moemesh.operator.eplb import EplbLayout, plan_deepseek, plan_from_scratch  # noqa: E402
from moemesh.operator.eplb_replan import replan  # noqa: E402

# (name, MoE layers, layout) of the DeepSeek-vs-refined table
SHAPES = [
    ("DeepSeek-V3 global", 58, EplbLayout(256, 288, 32)),
    ("DeepSeek-V3 4 nodes", 58, EplbLayout(256, 288, 32, num_groups=8, num_nodes=4)),
    ("Qwen3-30B-A3B-like", 48, EplbLayout(128, 144, 16)),
    ("DeepSeek-V2-Lite-like", 26, EplbLayout(64, 80, 8)),
]


def compare_with_deepseek(repeats: int, seed: int) -> None:
    rows = []
    for name, num_layers, layout in SHAPES:
        rng = np.random.default_rng(seed)
        load = (rng.pareto(1.2, size=(num_layers, layout.num_experts)) + 1.0) * 100.0
        deepseek, refined = plan_deepseek(load, layout), plan_from_scratch(load, layout)
        drifted = load * rng.lognormal(0.0, 0.3, size=load.shape)
        replanned = replan(drifted, layout, refined.phy2log)
        rows.append(
            [
                name,
                f"{num_layers}x{layout.num_experts}->{layout.num_slots} / {layout.num_workers}w",
                f"{deepseek.imbalance:.4f}",
                f"{refined.imbalance:.4f}",
                f"{100 * (deepseek.imbalance - refined.imbalance) / (deepseek.imbalance - 1):.0f}%",
                f"{best_time_ms(lambda: plan_deepseek(load, layout), repeats):.1f}",
                f"{best_time_ms(lambda: plan_from_scratch(load, layout), repeats):.1f}",
                f"{best_time_ms(lambda: replan(drifted, layout, refined.phy2log), repeats):.1f}",
                f"{replanned.moves} / {replanned.scratch_moves}",
            ]
        )
    print("Pareto(1.2) loads: imbalance = sum over layers of the max worker load / of the mean (1 = perfect)")
    print_table(
        [
            "shape",
            "layers x experts -> slots",
            "DeepSeek",
            "refined",
            "excess removed",
            "DeepSeek ms",
            "refined ms",
            "re-plan ms",
            "re-plan moves / scratch moves",
        ],
        rows,
    )
    print()


def best_time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000.0 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--slots", type=int, default=288)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    compare_with_deepseek(args.repeats, args.seed)

    rng = np.random.default_rng(args.seed)
    first = rng.gamma(0.5, 1000.0, size=(args.layers, args.experts))  # [num_layers, num_experts]
    print(f"EPLB: {args.layers} layers x {args.experts} experts x {args.slots} slots on {args.workers} workers")
    print(f"{'policy':<32} {'drift':>6} {'plan ms':>8} {'imbalance':>10} {'moves':>7}")
    policies = [("global (1 node)", 1, 1), ("hierarchical (8 groups/4 nodes)", 8, 4)]
    for name, num_groups, num_nodes in policies:
        layout = EplbLayout(args.experts, args.slots, args.workers, num_groups, num_nodes)
        scratch_ms = best_time_ms(lambda: plan_from_scratch(first, layout), args.repeats)
        current = plan_from_scratch(first, layout)
        no_replication = EplbLayout(args.experts, args.experts, args.workers, num_groups, num_nodes)
        baseline = plan_from_scratch(first, no_replication).imbalance
        print(f"{name:<32} {'-':>6} {scratch_ms:8.1f} {current.imbalance:10.3f} {'-':>7}   scratch, window 1")
        print(f"{'':<32} {'-':>6} {'-':>8} {baseline:10.3f} {'-':>7}   no redundant slots, window 1")
        for sigma in (0.1, 0.3, 0.6):
            second = first * rng.lognormal(0.0, sigma, size=first.shape)
            replan_ms = best_time_ms(lambda: replan(second, layout, current.phy2log), max(1, args.repeats // 2))
            result = replan(second, layout, current.phy2log)
            print(f"{'  keep current':<32} {sigma:6.1f} {'-':>8} {result.current_imbalance:10.3f} {0:7d}")
            print(
                f"{'  from scratch':<32} {sigma:6.1f} {'-':>8} {result.scratch.imbalance:10.3f} {result.scratch_moves:7d}"
            )
            print(
                f"{'  migration-aware':<32} {sigma:6.1f} {replan_ms:8.1f} {result.plan.imbalance:10.3f} {result.moves:7d}"
            )


if __name__ == "__main__":
    main()
