"""Placement record and its two-phase store against a real redis-server."""

import numpy as np
import pytest

from moemesh.contracts import redis_keys
from moemesh.contracts.placement import (
    Placement,
    PlacementError,
    PlacementNotReadyError,
    PlacementStore,
    make_placement,
)
from moemesh.contracts.placement_apply import even_placement

MESH = "ns1/mesh1"
WORKERS = ("expert-0", "expert-1")


@pytest.fixture()
def store(redis_client):
    return PlacementStore(redis_client, MESH)


def two_layer_placement(version=1):
    # 3 experts, 4 slots, 2 workers with 2 slots each; layer 0 replicates expert 0, layer 1 expert 2.
    return make_placement(version, [[0, 1, 0, 2], [2, 0, 1, 2]], WORKERS, num_experts=3)


def test_derived_replica_counts_and_log2phy():
    placement = two_layer_placement()
    assert placement.replica_counts.tolist() == [[2, 1, 1], [1, 1, 2]]
    assert placement.log2phy.tolist() == [
        [[0, 2], [1, -1], [3, -1]],
        [[1, -1], [2, -1], [0, 3]],
    ]
    assert placement.slot_owner.tolist() == [0, 0, 1, 1]
    assert placement.slots_of("expert-1").tolist() == [2, 3]
    assert (placement.num_layers, placement.num_slots, placement.num_workers) == (2, 4, 2)


def test_arrays_are_read_only_copies():
    phy2log = np.array([[0, 1]])
    placement = make_placement(1, phy2log, ["w"], num_experts=2)
    phy2log[0, 0] = 1
    assert placement.phy2log.tolist() == [[0, 1]]
    with pytest.raises(ValueError):
        placement.phy2log[0, 0] = 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"phy2log": [[0, 0, 0, 2], [2, 0, 1, 2]]}, "expert 1 has no replica in layer 0"),
        ({"slot_owner": [0, 0, 1, 2]}, "slots \\[3\\] reference unknown workers \\[2\\]"),
        ({"slot_owner": [0, 0, 0, 1]}, "unequal slot counts"),
        ({"slot_owner": [0, 0, 1]}, "slot_owner must have shape \\[num_slots\\]=\\(4,\\)"),
        ({"phy2log": [0, 1, 2, 0]}, "phy2log must have 2 dimension"),
        ({"phy2log": [[0, 1, 2, 3], [2, 0, 1, 2]]}, "layer 0 slot 3 holds expert 3, outside 0..2"),
        ({"worker_ids": ("expert-0", "expert-0")}, "worker_ids must be non-empty and unique"),
    ],
)
def test_validation_names_the_problem(kwargs, message):
    fields = {
        "version": 1,
        "num_experts": 3,
        "worker_ids": WORKERS,
        "slot_owner": [0, 0, 1, 1],
        "phy2log": [[0, 1, 0, 2], [2, 0, 1, 2]],
    }
    with pytest.raises(PlacementError, match=message):
        Placement(**{**fields, **kwargs})


def test_unequal_slots_are_allowed_when_not_required():
    placement = Placement(1, 2, ("a", "b"), [0, 0, 1], [[0, 1, 1]], equal_slots=False)
    assert placement.slots_of("a").tolist() == [0, 1]


def test_json_round_trip_preserves_the_layout():
    placement = two_layer_placement(version=7)
    decoded = Placement.from_json(placement.to_json())
    assert decoded.version == 7 and decoded.same_layout(placement)


def test_malformed_json_is_a_placement_error():
    with pytest.raises(PlacementError, match="malformed placement JSON"):
        Placement.from_json('{"version": 1}')


def test_publish_keeps_the_old_version_current_until_activation(store):
    store.publish(two_layer_placement(1))
    assert store.current() is None and store.pending().version == 1
    store.mark_ready("expert-0", 1)
    store.mark_ready("expert-1", 1)
    store.activate(1)
    store.publish(two_layer_placement(2))
    assert store.current_version() == 1 and store.pending().version == 2
    assert store.latest_version() == 2


def test_activate_requires_every_owning_worker_ready(store):
    store.publish(two_layer_placement(1))
    store.mark_ready("expert-1", 1)
    assert store.ready_workers(1) == {"expert-1"}
    assert store.missing_workers(1) == ("expert-0",)
    with pytest.raises(PlacementNotReadyError, match="not ready on workers \\['expert-0'\\]"):
        store.activate(1)
    assert store.current_version() == 0
    store.mark_ready("expert-0", 1)
    store.activate(1)
    assert store.current_version() == 1 and store.current().same_layout(two_layer_placement())
    assert store.pending() is None and store.missing_workers(1) == ()


def test_activation_keeps_the_previous_version_and_deletes_older_ones(store, redis_client):
    for version in (1, 2, 3):
        store.publish(two_layer_placement(version))
        for worker in WORKERS:
            store.mark_ready(worker, version)
        store.activate(version)
    assert store.get(1) is None and store.get(2).version == 2 and store.current().version == 3
    ready_keys = [k for k in redis_client.keys("*") if k.endswith(b":ready")]
    assert ready_keys == []


def test_publish_rejects_a_version_not_above_the_latest(store):
    store.publish(two_layer_placement(3))
    with pytest.raises(PlacementError, match="version 3 must exceed the latest published 3"):
        store.publish(two_layer_placement(3))


def test_unknown_worker_or_version_cannot_mark_ready(store):
    store.publish(two_layer_placement(1))
    with pytest.raises(PlacementError, match="owns no slot"):
        store.mark_ready("expert-9", 1)
    with pytest.raises(PlacementError, match="never published"):
        store.mark_ready("expert-0", 5)


def test_activating_an_older_version_than_current_is_rejected(store):
    for version in (1, 2):
        store.publish(two_layer_placement(version))
        for worker in WORKERS:
            store.mark_ready(worker, version)
        store.activate(version)
    with pytest.raises(PlacementError, match="not newer than the current 2"):
        store.activate(1)


def test_a_superseded_pending_version_is_deleted_when_a_newer_one_activates(store):
    store.publish(two_layer_placement(1))
    store.publish(two_layer_placement(2))
    for worker in WORKERS:
        store.mark_ready(worker, 2)
    store.activate(2)
    assert store.get(1) is None and store.current_version() == 2


def test_keys_follow_the_documented_schema(store, redis_client):
    store.publish(two_layer_placement(1))
    store.mark_ready("expert-0", 1)
    assert sorted(redis_client.keys("*")) == sorted(
        key.encode()
        for key in (
            redis_keys.placement_key(MESH, 1),
            redis_keys.placement_ready_key(MESH, 1),
            redis_keys.placement_latest_key(MESH),
            redis_keys.placement_versions_key(MESH),
        )
    )


def test_restore_puts_back_the_held_version_only_into_an_empty_store(store, redis_client):
    assert store.restore(two_layer_placement(4))  # Redis lost the mesh's keys; the workers hold version 4
    assert store.current_version() == store.latest_version() == 4 and store.pending() is None
    assert store.current().same_layout(two_layer_placement())
    store.publish(two_layer_placement(5))  # the two-phase apply goes on from there
    assert not store.restore(two_layer_placement(9))  # some placement is stored: nothing changes
    assert (store.current_version(), store.latest_version()) == (4, 5)
    for worker in WORKERS:
        store.mark_ready(worker, 5)
    store.activate(5)
    assert store.current_version() == 5 and store.get(4).version == 4


@pytest.mark.parametrize(
    "num_experts, num_workers, replicas, slots_per_worker", [(16, 2, 2, 16), (5, 3, 2, 4), (4, 4, 3, 3), (3, 2, 1, 2)]
)
def test_even_placement_puts_each_replica_of_an_expert_on_another_worker(
    num_experts, num_workers, replicas, slots_per_worker
):
    workers = [f"expert-{w}" for w in range(num_workers)]
    placement = even_placement(2, num_experts, workers, replicas=replicas)
    assert placement.num_slots == slots_per_worker * num_workers
    for worker in workers:
        held = placement.phy2log[:, placement.slots_of(worker)]  # [num_layers, slots_per_worker]
        assert all(len(set(row)) == len(row) for row in held.tolist())  # no expert twice on one worker
    assert (placement.replica_counts >= replicas).all()


def test_even_placement_needs_a_worker_per_replica():
    with pytest.raises(PlacementError, match="3 replicas of each expert need as many expert workers, not 2"):
        even_placement(1, 4, ["expert-0", "expert-1"], replicas=3)
