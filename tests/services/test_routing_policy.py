"""Routing policies (pure) and the router's pool decision, including its speed: < 1 ms for an
8k-token prompt over 64 workers."""

from __future__ import annotations

import redis

from moemesh.contracts import registry
from moemesh.contracts.block_hash import HashExtra, hash_block_chain
from moemesh.router.policy import Candidate, KVAware, LeastLoaded, RoundRobin
from moemesh.router.worker_pool import RecentRoutes, WorkerPool


def candidate(
    worker_id: str, cached: int = 0, active: int = 0, queued: int = 0, in_flight: int = 0, pending: int = 0
) -> Candidate:
    return Candidate(worker_id, cached, active, queued, in_flight, pending)


def test_kv_aware_prefers_the_longest_cached_prefix_at_equal_load():
    workers = [candidate("a", cached=2), candidate("b", cached=60), candidate("c", cached=10)]
    assert KVAware().choose(workers, num_prompt_blocks=64).worker_id == "b"


def test_kv_aware_trades_cache_overlap_against_decode_load():
    # cost(a) = 1 * (64 - 60) + 100 = 104; cost(b) = 1 * 64 + 10 = 74
    workers = [candidate("a", cached=60, active=100), candidate("b", cached=0, active=10)]
    assert KVAware(prefill_weight=1.0).choose(workers, 64).worker_id == "b"
    # prefill_weight 2: cost(a) = 108, cost(b) = 138
    assert KVAware(prefill_weight=2.0).choose(workers, 64).worker_id == "a"


def test_kv_aware_counts_the_prefills_a_worker_still_has_to_do():
    # cost(a) = (64 - 60) + 100 pending = 104 (+ 0 decode); cost(b) = 64 + 0 + 20 decode = 84
    workers = [candidate("a", cached=60, pending=100), candidate("b", active=20)]
    assert KVAware().choose(workers, 64).worker_id == "b"


def test_kv_aware_counts_queued_requests_with_their_weight():
    workers = [candidate("a", cached=8, queued=3), candidate("b", cached=0)]
    assert KVAware(prefill_weight=1.0, queue_weight=4.0).choose(workers, 16).worker_id == "b"  # 8 + 12 > 16
    assert KVAware(prefill_weight=1.0, queue_weight=0.0).choose(workers, 16).worker_id == "a"


def test_round_robin_cycles_and_ignores_the_cache():
    workers = [candidate("a", cached=50), candidate("b"), candidate("c")]
    policy = RoundRobin()
    assert [policy.choose(workers, 64).worker_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_picks_fewest_requests_then_rotates_ties():
    policy = LeastLoaded()
    assert policy.choose([candidate("a", in_flight=2), candidate("b", queued=1)], 8).worker_id == "b"
    tied = [candidate("a", in_flight=1), candidate("b", in_flight=1)]
    assert {policy.choose(tied, 8).worker_id for _ in range(2)} == {"a", "b"}


def test_recent_routes_give_the_consecutive_prefix_within_their_ttl():
    extra = HashExtra("m")
    chain = hash_block_chain(list(range(40)), 4, extra)
    recent = RecentRoutes(ttl_s=10)
    recent.add(chain[:6], "a", now=100.0)
    recent.add(chain[:3], "b", now=105.0)
    assert recent.longest_prefixes(chain, now=106.0) == {"a": 6, "b": 3}
    assert recent.longest_prefixes(chain, now=112.0) == {"b": 3}  # a's entries are older than 10 s
    recent.forget("b")
    assert recent.longest_prefixes(chain, now=106.0) == {"a": 6}


def make_pool(num_workers: int, loaded: bool = True) -> WorkerPool:
    pool = WorkerPool(
        client=redis.Redis(port=1),
        mesh="bench",
        policy=KVAware(),
        prefill_policy=KVAware(queue_weight=0),
        block_size=16,
        disaggregated=True,
    )
    records = [
        registry.WorkerRecord(
            f"d{i}",
            "decode",
            f"127.0.0.1:{10000 + i}",
            "m",
            num_queued=(i % 3) * loaded,
            num_blocks_used=i * 7 * loaded,
        )
        for i in range(num_workers)
    ]
    records += [registry.WorkerRecord(f"p{i}", "prefill", f"127.0.0.1:{20000 + i}", "m") for i in range(4)]
    pool._apply_records(records)
    return pool


def test_pool_routes_to_the_cached_worker_and_picks_a_prefill_worker():
    pool = make_pool(4, loaded=False)
    chain = hash_block_chain(list(range(320)), 16, HashExtra("m"))
    route = pool.choose(chain, 320, cached={"d2": 20, "d1": 3, "p1": 20})
    assert route.decode.worker_id == "d2" and route.prefill.worker_id == "p1" and route.cached_blocks == 20
    charge = pool.begin(route, chain, 320, cached={"d2": 20, "p1": 15})
    assert (route.decode.active_blocks, route.prefill.pending_prefill_blocks, route.prefill.in_flight) == (20, 5, 1)
    pool.end_prefill(route, charge)
    assert (route.prefill.pending_prefill_blocks, route.prefill.in_flight, route.decode.in_flight) == (0, 0, 1)
    pool.end(route, charge)
    assert (route.decode.active_blocks, route.decode.in_flight, route.prefill.in_flight) == (0, 0, 0)


def test_a_failed_static_worker_the_registry_lists_stays_down_until_it_heartbeats_again():
    now = [100.0]
    pool = WorkerPool(
        client=redis.Redis(port=1),
        mesh="m",
        policy=KVAware(),
        prefill_policy=KVAware(),
        block_size=16,
        disaggregated=False,
        static_decode=["127.0.0.1:7001", "127.0.0.1:7002"],
        down_s=5.0,
        clock=lambda: now[0],
    )
    pool._apply_records([registry.WorkerRecord("decode-0", "decode", "127.0.0.1:7001", "m", updated_at=50.0)])
    listed = pool.workers["decode-0"]
    unlisted = pool.workers["static-127.0.0.1-7002"]
    assert listed.static and unlisted.static
    pool.mark_down(listed)
    pool.mark_down(unlisted)
    now[0] += 6.0  # past down_s: a worker never listed by the registry is tried again
    assert [w.worker_id for w in pool.live(("decode",))] == ["static-127.0.0.1-7002"]
    pool._apply_records([])  # its record expired: still down (and still known, being static)
    assert "decode-0" in pool.workers and [w.worker_id for w in pool.live(("decode",))] == ["static-127.0.0.1-7002"]
    pool._apply_records([registry.WorkerRecord("decode-0", "decode", "127.0.0.1:7001", "m", updated_at=60.0)])
    assert sorted(w.worker_id for w in pool.live(("decode",))) == ["decode-0", "static-127.0.0.1-7002"]
