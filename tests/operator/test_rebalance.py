"""The operator's EPLB step against a real redis-server: after Redis lost the mesh's placements,
the placement it publishes again takes a version above every one the mesh used (from the
mesh's status), never a number expert workers may still hold with another layout."""

from __future__ import annotations

import time

from moemesh.contracts.placement import PlacementStore
from moemesh.operator.eplb import EplbLayout
from moemesh.operator.rebalance import rebalance_step

LAYOUT = EplbLayout(num_experts=4, num_slots=6, num_workers=2)
WORKERS = ["mesh-expert-0", "mesh-expert-1"]


def step(client, last_version: int = 0):
    return rebalance_step(client, "m", LAYOUT, 2, WORKERS, 0.05, False, time.time, last_version)


def test_a_placement_published_after_redis_lost_its_keys_takes_a_version_never_used(redis_client):
    first = step(redis_client)
    assert (first.published_version, first.reason) == (1, "initial placement")
    store = PlacementStore(redis_client, "m")
    for worker in WORKERS:
        store.mark_ready(worker, 1)
    assert step(redis_client).active_version == 1  # activated once every owner is ready
    redis_client.flushall()  # a Redis restart without persistence: the workers still hold placement 1
    again = step(redis_client, last_version=1)
    assert (again.published_version, again.reason, again.active_version) == (2, "initial placement", 0)
    assert store.latest_version() == 2 and store.get(1) is None
    assert step(redis_client, last_version=2).published_version == 0  # pending: nothing new while it waits
