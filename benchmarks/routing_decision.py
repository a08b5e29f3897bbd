"""Routing decision latency: kv_aware scoring of an 8k-token prompt over 64 decode workers.

    python benchmarks/routing_decision.py

Prints median and p99 of the router's decision (prefix lookup in its recent-routes view merged
with index hits, then scoring) next to the 1 ms target.
"""

from __future__ import annotations

import os
import sys
import time

import redis

sys.path.insert(0, os.path.dirname(__file__))
from common import print_table  # noqa: E402

from moemesh.contracts import registry  # noqa: E402
from moemesh.contracts.block_hash import HashExtra, hash_block_chain  # noqa: E402
from moemesh.router.policy import KVAware  # noqa: E402
from moemesh.router.worker_pool import WorkerPool  # noqa: E402


def make_pool(num_workers: int) -> WorkerPool:
    pool = WorkerPool(
        client=redis.Redis(port=1),
        mesh="bench",
        policy=KVAware(),
        prefill_policy=KVAware(queue_weight=0),
        block_size=16,
        disaggregated=True,
    )
    records = [
        registry.WorkerRecord(f"d{i}", "decode", f"127.0.0.1:{10000 + i}", "m", num_queued=i % 3, num_blocks_used=i * 7)
        for i in range(num_workers)
    ]
    records += [registry.WorkerRecord(f"p{i}", "prefill", f"127.0.0.1:{20000 + i}", "m") for i in range(4)]
    pool._apply_records(records)
    return pool


def main() -> None:
    rows = []
    for num_workers, num_tokens in [(8, 1024), (64, 8192)]:
        pool = make_pool(num_workers)
        prompt = list(range(num_tokens))
        chain = hash_block_chain(prompt, 16, HashExtra("m"))
        for i in range(0, num_workers, 2):
            pool.recent.add(chain[: 8 * i], f"d{i}", now=time.monotonic())
        cached = {f"d{i}": 4 * i for i in range(num_workers)}

        def decide():
            merged = pool.recent.longest_prefixes(chain, time.monotonic())
            for worker_id, count in cached.items():
                merged[worker_id] = max(count, merged.get(worker_id, 0))
            return pool.choose(chain, len(prompt), merged)

        decide()
        timings = []
        for _ in range(200):
            start = time.perf_counter()
            decide()
            timings.append(time.perf_counter() - start)
        timings.sort()
        rows.append([num_workers, num_tokens, f"{timings[100] * 1e3:.3f}", f"{timings[198] * 1e3:.3f}", "1.000"])
    print_table(["decode workers", "prompt tokens", "median ms", "p99 ms", "target ms"], rows)


if __name__ == "__main__":
    main()
