"""EPLB planner benchmark: planning time at DeepSeek-V3 scale, and scratch vs migration-aware.

    python benchmarks/eplb.py [--layers 61] [--experts 256] [--slots 288] [--workers 32]

Load is synthetic: a per-(layer, expert) gamma-distributed popularity (skewed, as measured MoE
routing is) drifted by a log-normal factor between two windows. The table compares the current
placement (planned for the first window), a from-scratch plan and the migration-aware re-plan on
the second window: imbalance = sum over layers of max / mean worker load; moves = replicas that
must be copied to a worker.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from moemesh.operator.eplb import EplbLayout, plan_from_scratch
from moemesh.operator.eplb_replan import replan


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
