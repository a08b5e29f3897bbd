"""The Redis prefix index against a real redis-server: batches with sequence numbers, resync on a
gap / new epoch / reset, longest consecutive prefix per worker, cleanup of dead workers."""

from __future__ import annotations

import asyncio

import pytest

from moemesh.contracts import redis_keys
from moemesh.contracts.block_hash import HashExtra, hash_block_chain
from moemesh.contracts.prefix_index import PrefixIndex
from moemesh.worker.prefix_publisher import PrefixIndexPublisher

MESH = "test-index"
EXTRA = HashExtra("model")


def chain(num_blocks: int, start: int = 0) -> list[bytes]:
    return hash_block_chain(list(range(start, start + 4 * num_blocks)), 4, EXTRA)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def index(redis_client, clock):
    return PrefixIndex(redis_client, MESH, clock=clock)


def mesh_keys(client) -> list[str]:
    return sorted(k.decode() for k in client.keys(redis_keys.mesh_prefix(MESH) + ":*"))


def test_longest_prefix_counts_only_consecutive_blocks_from_the_start(index):
    blocks = chain(6)
    index.resync("w1", "e1", blocks[:4], 4, "model", ttl_s=10)
    index.resync("w2", "e2", blocks[:2] + blocks[3:6], 4, "model", ttl_s=10)  # hole at block 2
    index.resync("w3", "e3", blocks[1:6], 4, "model", ttl_s=10)  # lacks block 0
    assert index.longest_prefixes(blocks) == {"w1": 4, "w2": 2}
    assert index.longest_prefixes(chain(3, start=500)) == {}


def test_batches_apply_in_sequence_and_a_gap_asks_for_a_resync(index):
    blocks = chain(5)
    index.resync("w", "e", [], 4, "model", ttl_s=10)
    assert index.apply_batch("w", "e", 1, blocks[:3], [], ttl_s=10)
    assert index.apply_batch("w", "e", 2, blocks[3:5], [blocks[2]], ttl_s=10)
    assert index.worker_blocks("w") == {blocks[0], blocks[1], blocks[3], blocks[4]}
    assert index.longest_prefixes(blocks) == {"w": 2}
    # batch 3 was lost: batch 4 is refused and changes nothing
    assert not index.apply_batch("w", "e", 4, [blocks[2]], [], ttl_s=10)
    assert index.longest_prefixes(blocks) == {"w": 2}
    index.resync("w", "e", blocks, 4, "model", ttl_s=10)
    assert index.longest_prefixes(blocks) == {"w": 5}
    assert index.apply_batch("w", "e", 1, [], [blocks[0]], ttl_s=10)
    assert index.longest_prefixes(blocks) == {}


def test_a_new_epoch_or_an_index_reset_asks_for_a_resync(index, redis_client):
    index.resync("w", "old-epoch", chain(2), 4, "model", ttl_s=10)
    assert not index.apply_batch("w", "new-epoch", 1, chain(3), [], ttl_s=10)  # the worker restarted
    assert index.touch("w", "old-epoch", ttl_s=10)
    redis_client.flushdb()  # Redis lost its data
    assert not index.apply_batch("w", "old-epoch", 1, chain(3), [], ttl_s=10)
    assert not index.touch("w", "old-epoch", ttl_s=10)


def test_resync_replaces_everything_a_worker_had(index):
    old, new = chain(3), chain(2, start=100)
    index.resync("w", "e", old, 4, "model", ttl_s=10)
    index.resync("w", "e", new, 4, "model", ttl_s=10)
    assert index.worker_blocks("w") == set(new)
    assert index.longest_prefixes(old) == {}


def test_expired_and_removed_workers_leave_no_keys_behind(index, redis_client, clock):
    shared = chain(3)
    index.resync("dead", "e1", shared, 4, "model", ttl_s=10)
    index.resync("alive", "e2", shared[:2], 4, "model", ttl_s=30)
    clock.now += 11
    assert index.reap_expired() == ["dead"]
    assert index.longest_prefixes(shared) == {"alive": 2}
    assert index.indexed_workers() == ["alive"]
    index.remove_worker("alive")
    assert mesh_keys(redis_client) == []


class FakeEvents:
    def __init__(self, changes: dict, cleared: bool = False):
        self.changes, self.cleared = changes, cleared


def make_publisher(index, cache: set) -> PrefixIndexPublisher:
    async def snapshot():
        return sorted(cache)

    return PrefixIndexPublisher(index, "w", 4, "model", snapshot, ttl_s=10, flush_interval_s=0)


def test_publisher_resyncs_at_start_then_sends_numbered_batches(index):
    async def scenario():
        blocks = chain(4)
        cache = set(blocks[:2])
        publisher = make_publisher(index, cache)
        await publisher.flush()
        assert (publisher.num_resyncs, publisher.seq) == (1, 0)
        assert index.longest_prefixes(blocks) == {"w": 2}
        publisher.add(FakeEvents({blocks[2]: True, blocks[3]: True}))
        publisher.add(FakeEvents({blocks[3]: False}))  # stored then evicted: net removed
        await publisher.flush()
        assert (publisher.num_resyncs, publisher.seq) == (1, 1)
        assert index.longest_prefixes(blocks) == {"w": 3}

    asyncio.run(scenario())


def test_publisher_resyncs_after_a_sequence_gap(index, redis_client):
    async def scenario():
        blocks = chain(4)
        cache = set(blocks[:2])
        publisher = make_publisher(index, cache)
        await publisher.flush()
        publisher.seq += 1  # batch 1 never reached Redis
        cache.update(blocks[2:])
        publisher.add(FakeEvents({blocks[2]: True, blocks[3]: True}))
        await publisher.flush()  # batch 2 refused
        assert index.longest_prefixes(blocks) == {"w": 2}
        await publisher.flush()  # resync from the snapshot
        assert publisher.num_resyncs == 2 and publisher.seq == 0
        assert index.longest_prefixes(blocks) == {"w": 4}

    asyncio.run(scenario())


def test_publisher_rebuilds_the_index_after_redis_lost_its_data(index, redis_client):
    async def scenario():
        blocks = chain(3)
        publisher = make_publisher(index, set(blocks))
        await publisher.flush()
        redis_client.flushdb()
        await publisher.heartbeat()  # notices the entries are gone
        await publisher.flush()
        assert index.longest_prefixes(blocks) == {"w": 3}
        await publisher.close()
        assert mesh_keys(redis_client) == []

    asyncio.run(scenario())


def test_publisher_survives_an_unreachable_redis(redis_server, clock):
    from moemesh.contracts.redis_client import connect

    unreachable = connect("redis://127.0.0.1:1/0", timeout_s=0.2)

    async def scenario():
        publisher = make_publisher(PrefixIndex(unreachable, MESH, clock=clock), set(chain(2)))
        await publisher.flush()  # logs, does not raise
        publisher.add(FakeEvents({chain(3)[2]: True}))
        await publisher.flush()
        assert publisher.num_resyncs == 0

    asyncio.run(scenario())
