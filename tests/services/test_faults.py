"""Faults against a local cluster with its own redis-server: a prefix-index sequence gap, Redis
stopped and restarted, decode workers killed mid-stream (the streams migrate: HTTP greedy and
gRPC seeded sampling, each identical to an uninterrupted run), and the Redis state of stopped
workers."""

from __future__ import annotations

import signal
import time

import grpc
import openai
import pytest

from benchmarks.chaos import metric_total
from moemesh.contracts import registry
from moemesh.contracts.prefix_index import PrefixIndex, meta_key
from moemesh.contracts.redis_client import connect
from moemesh.proto.v1 import common_pb2, decode_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc
from tests.redis_process import RedisServer
from tests.services.cluster_helpers import decode_workers, generate, load, test_cluster, wait_until

MESH = "faults"


@pytest.fixture(scope="module")
def redis_server():
    """This module's own redis-server (a test stops and restarts it), not the session's."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory):
    with test_cluster(redis_server.url, MESH, tmp_path_factory.mktemp("cluster-faults")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def redis_client(redis_server):
    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def killed() -> list[str]:
    """Names of workers a test killed (later tests check what they left behind)."""
    return []


def generate_on(worker, prompt_token_ids: list[int], request_id: str) -> list[int]:
    request = decode_pb2.WorkerGenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2),
    )
    with grpc.insecure_channel(worker.grpc_endpoint) as channel:
        return [t for m in decode_pb2_grpc.DecodeWorkerStub(channel).Generate(request, timeout=60) for t in m.token_ids]


def test_a_sequence_gap_makes_the_worker_resync_its_index_entry(cluster, redis_client, tokenizer):
    from moemesh.contracts.block_hash import HashExtra, hash_block_chain
    from moemesh.engine.loader import default_model_path, open_checkpoint

    worker = decode_workers(cluster)[0]
    index = PrefixIndex(redis_client, MESH)
    redis_client.hset(meta_key(MESH, worker.name), "seq", 1000)  # as if batches 1..1000 were applied elsewhere
    prompt = tokenizer.encode("A gap in the event sequence forces a full resync of this worker. " * 4)
    generate_on(worker, prompt, "gap-1")
    chain = hash_block_chain(prompt, 16, HashExtra(open_checkpoint(default_model_path()).model_id))
    wait_until(lambda: set(chain) <= index.worker_blocks(worker.name), message="the resynced index entry")
    assert int(redis_client.hget(meta_key(MESH, worker.name), "seq")) < 1000
    assert "not applied (gap, restart or reset); resyncing" in open(worker.log_path).read()


def test_requests_succeed_while_redis_is_down_and_the_index_is_rebuilt_when_it_returns(
    cluster, redis_server, redis_client, client, model
):
    index = PrefixIndex(redis_client, MESH)
    worker_names = sorted(s.name for s in cluster.services.values() if s.role != "router")
    wait_until(lambda: index.indexed_workers() == worker_names, message="every worker in the index")
    log_path = cluster.services["router"].log_path
    redis_server.stop()
    try:
        for i in range(4):
            response = client.completions.create(model=model, prompt=f"Redis is down, request {i}:", max_tokens=3)
            assert response.choices[0].finish_reason in ("length", "stop")
        streamed = client.completions.create(model=model, prompt="Streaming without Redis:", max_tokens=3, stream=True)
        assert len([c for c in streamed]) >= 1
        # the router notices at its next refresh, which quick requests may not have waited for
        wait_until(lambda: "Redis unreachable" in open(log_path).read(), message="the router saw Redis go")
    finally:
        redis_server.start()
    wait_until(
        lambda: sorted(w.worker_id for w in registry.list_workers(redis_client, MESH) if w.role != "router")
        == worker_names,
        message="registry rebuilt",
    )
    wait_until(lambda: index.indexed_workers() == worker_names, message="prefix index rebuilt")
    decode = decode_workers(cluster)[0]
    assert wait_until(lambda: index.worker_blocks(decode.name), message="the decode worker's blocks re-indexed")
    # the router notices on its own next Redis call, which may come after the workers re-indexed
    router_log = wait_until(
        lambda: (lambda text: text if "Redis is back" in text else None)(open(log_path).read()),
        message="the router saw Redis return",
    )
    assert router_log.count("Redis unreachable") == 1  # logged once per outage
    response = client.completions.create(model=model, prompt="And with Redis back:", max_tokens=3)
    assert response.choices[0].text is not None


PROMPT = "Count slowly from one to one hundred:"


def test_a_decode_worker_killed_mid_stream_is_migrated_and_the_stream_equals_an_uninterrupted_run(
    cluster, client, model, killed
):
    params = {"model": model, "prompt": PROMPT, "max_tokens": 96, "temperature": 0, "extra_body": {"ignore_eos": True}}
    expected = client.completions.create(**params).choices[0].text
    migrations_before = metric_total(cluster.url + "/metrics", "moemesh:router_migrations_total")
    stream = iter(client.completions.create(**params, stream=True))
    text = "".join(next(stream).choices[0].text for _ in range(8))
    serving = wait_until(
        lambda: [w for w in decode_workers(cluster) if load(w).num_running == 1], message="the serving worker"
    )
    (victim,) = serving
    cluster.stop_service(victim.name, signal.SIGKILL)
    killed.append(victim.name)
    chunks = list(stream)  # the stream goes on, on the other decode worker
    text += "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert text == expected  # no token repeated or missing
    assert metric_total(cluster.url + "/metrics", "moemesh:router_migrations_total") == migrations_before + 1


def test_a_seeded_grpc_stream_migrates_with_its_sampler_fast_forwarded(cluster, tokenizer, killed):
    """gRPC clients get the same; a sampled stream continues the same random stream elsewhere."""
    cluster.add_worker("decode-2", "decode")  # the previous test killed one: two decode workers again
    router = cluster.services["router"]
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=tokenizer.encode(PROMPT)),
        sampling=common_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=96, ignore_eos=True),
    )
    with grpc.insecure_channel(router.grpc_endpoint) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        expected = [t for message in stub.Generate(request, timeout=300) for t in message.token_ids]
        messages = stub.Generate(request, timeout=300)
        first = next(messages)
        token_ids = list(first.token_ids)
        while len(token_ids) < 8:
            token_ids += next(messages).token_ids
        victim = cluster.services[first.worker_id]
        cluster.stop_service(victim.name, signal.SIGKILL)
        killed.append(victim.name)
        rest = list(messages)
    token_ids += [t for message in rest for t in message.token_ids]
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert token_ids == expected and len(expected) == 96


def keys_mentioning(client, worker_id: str) -> list[str]:
    found = [k.decode() for k in client.scan_iter(f"moemesh:{MESH}:*") if worker_id in k.decode()]
    for key in client.scan_iter(f"moemesh:{MESH}:kv:block:*"):
        if client.sismember(key, worker_id):
            found.append(key.decode())
    for key in (f"moemesh:{MESH}:workers", f"moemesh:{MESH}:kv:workers"):
        if client.zscore(key, worker_id) is not None:
            found.append(f"{key} member")
    return found


def test_stopped_workers_leave_no_redis_state_behind(cluster, redis_client, killed):
    if not killed:  # run alone: kill one now
        killed.append(decode_workers(cluster)[0].name)
        cluster.stop_service(killed[0], signal.SIGKILL)
    victim = killed[0]
    # killed: its entries expire after the TTL (3 s) and the router's reaper removes them
    wait_until(lambda: not keys_mentioning(redis_client, victim), message=f"no keys for {victim}")
    # stopped gracefully: gone as soon as it exits
    assert keys_mentioning(redis_client, "prefill-0")
    assert cluster.stop_service("prefill-0", signal.SIGTERM) == 0
    assert keys_mentioning(redis_client, "prefill-0") == []


def test_a_new_worker_is_not_serving_until_its_model_is_loaded_then_joins_the_registry(cluster, redis_client):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service = cluster.worker_service("decode-late", "decode")
    cluster._launch(service)
    seen = []
    # reconnect at once while the process starts: with gRPC's default back-off (1 s, growing) the
    # first answer can come only after the model has loaded, and NOT_SERVING is never seen
    fast_reconnect = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 50)]
    with grpc.insecure_channel(service.grpc_endpoint, options=fast_reconnect) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                return False
            if not seen or seen[-1] != status:
                seen.append(status)
            return status == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, timeout_s=120, interval_s=0.05, message="decode-late serving")
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
    assert "decode-late" in [w.worker_id for w in registry.list_workers(redis_client, MESH)]


def test_sigterm_drains_a_decode_worker_its_streams_finish_and_new_requests_go_elsewhere(
    cluster, redis_client, tokenizer
):
    (victim,) = [w for w in decode_workers(cluster) if w.alive and w.name != "decode-late"]
    prompt = tokenizer.encode(PROMPT)
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with grpc.insecure_channel(victim.grpc_endpoint) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        calls = [
            stub.Generate(
                decode_pb2.WorkerGenerateRequest(request_id=f"drain-{i}", prompt_token_ids=prompt, sampling=sampling),
                timeout=300,
            )
            for i in range(4)
        ]
        firsts = [next(call) for call in calls]  # all four in flight
        victim.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(
            lambda: victim.name not in [w.worker_id for w in registry.list_workers(redis_client, MESH)],
            message=f"{victim.name} deregistered",
        )
        with pytest.raises(grpc.RpcError) as refused:  # a router with a stale view is told to go elsewhere
            generate_on(victim, prompt, "drain-new")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        served = []

        def served_elsewhere() -> bool:  # until the router's view holds decode-late (refreshed every 0.5 s)
            try:
                served.append(generate(cluster.services["router"], prompt, max_tokens=2)[1])
            except grpc.RpcError as e:  # no routable worker yet: the draining one refuses new calls
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                return False
            return True

        wait_until(served_elsewhere, message="a new request served")
        assert served == ["decode-late"]  # never the draining worker
        for first, call in zip(firsts, calls):
            rest = list(call)
            assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 48
            assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert victim.process.wait(120) == 0
    assert time.monotonic() - signalled < 30  # the drain period (mesh default): the streams ended it early
    assert cluster.stop_service("decode-late", signal.SIGTERM) == 0
    assert keys_mentioning(redis_client, "decode-late") == []
