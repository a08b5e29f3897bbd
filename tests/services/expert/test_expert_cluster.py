"""A local cluster with three expert workers serving a tiny random Qwen3-MoE model, its data plane
the torch-dist transport (gloo groups; test_transports.py runs every transport on DeepSeek-V3):
outputs equal
the in-process engine (local experts) and Hugging Face; redundant replicas split a hot expert's
tokens; three live rebalances under load fail nothing and release old replicas; bad placements
are rejected; a killed expert worker fails requests fast (or not at all when every expert has a
second replica elsewhere) and the cluster recovers when it returns."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from moemesh.contracts.placement import PlacementError, PlacementStore
from moemesh.contracts.placement_apply import apply_placement, even_placement
from moemesh.contracts.redis_client import connect
from moemesh.contracts.registry import list_workers
from moemesh.engine.sampling_params import SamplingParams
from tests.engine.moe.models import make_prompts
from tests.services.cluster_helpers import WAIT_TIMEOUT_S, generate, wait_until

from .conftest import hf_generate, local_engine
from .expert_helpers import (
    MAX_NEW,
    expert_cluster,
    expert_tokens,
    experts,
    generate_all,
    hosted_mask,
    keyspace_events,
    placement_from_rows,
    replica_tokens,
    status,
    steady_traffic,
    twice_on_different_workers,
    written_keys,
)

MESH = "expert-qwen"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(redis_server, qwen3, tmp_path_factory):
    with expert_cluster(
        redis_server.url, MESH, tmp_path_factory.mktemp("expert-qwen"), qwen3[0], 3, transport="torch-dist"
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(redis_server):
    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def llm(qwen3):
    return local_engine(qwen3[0])


@pytest.fixture(scope="module")
def shape(cluster):
    s = status(experts(cluster)[0])
    return s.num_moe_layers, s.num_experts


def router(cluster):
    return cluster.services["router"]


def expected(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def apply(client, placement):
    return apply_placement(client, MESH, placement, timeout_s=WAIT_TIMEOUT_S)


def wait_dispatching(cluster, version: int) -> None:
    """Send small requests until the attention worker's calls use `version` (it switches at a
    step boundary after it sees the new version). A request may fail meanwhile if an expert
    worker restarted less than gRPC's reconnect backoff (<= 2 s) ago."""

    def dispatched() -> int:
        try:
            generate(router(cluster), [1, 2, 3], 1)
        except grpc.RpcError:
            return 0
        return sum(replica_tokens(cluster, version).values())

    wait_until(dispatched, message=f"dispatch with placement {version}")


def test_greedy_outputs_through_three_expert_workers_equal_local_experts_and_hugging_face(cluster, qwen3, llm, prompts):
    assert [s.name for s in experts(cluster)] == [f"{MESH}-expert-{i}" for i in range(3)]
    ours = generate_all(router(cluster), prompts)
    assert ours == expected(llm, prompts)
    assert ours == hf_generate(qwen3[1], prompts, MAX_NEW)
    assert all(status(s).serving and status(s).active_version == 1 for s in experts(cluster))


def test_each_expert_worker_reports_its_share_of_the_load_to_redis(cluster, redis_server, client, shape):
    """Under steady traffic every expert worker publishes a window (0.5 s in this cluster) with
    tokens only on the experts it hosts; the windows are awaited by keyspace notification."""
    from moemesh.contracts.expert_load_records import read_expert_load
    from moemesh.contracts.redis_keys import expert_load_key_prefix

    prefix = expert_load_key_prefix(MESH)
    hosted = {s.worker_id: hosted_mask(s) for s in map(status, experts(cluster))}
    assert not any(mask.all() for mask in hosted.values())  # each worker hosts only a share of the experts
    windows: dict[str, np.ndarray] = {}  # worker id -> its first window with tokens, [num_layers, num_experts]
    notifier = redis_server.client()
    with keyspace_events(notifier, prefix + "*") as events, steady_traffic(router(cluster), [1, 2, 3, 4, 5, 6, 7, 8]):
        for key in written_keys(events):
            shape_field, dtype, payload, window_s = client.hmget(key, ["shape", "dtype", "counts", "window_s"])
            if payload is None:  # replaced or expired since the notification
                continue
            assert (shape_field, dtype, float(window_s)) == (f"{shape[0]},{shape[1]}".encode(), b"<i8", 0.5)
            counts = np.frombuffer(payload, dtype="<i8").reshape(shape)
            if counts.any():
                windows.setdefault(key.removeprefix(prefix), counts)
            if len(windows) == len(hosted):
                break
    notifier.close()
    assert sorted(windows) == sorted(hosted)
    for worker_id, counts in windows.items():
        assert not counts[~hosted[worker_id]].any(), f"{worker_id} counted tokens of experts it does not host"
    load = read_expert_load(client, MESH, *shape)
    assert load.num_workers == 3 and load.counts.shape == shape and load.max_window_s == 0.5


def test_two_replicas_of_hot_experts_keep_outputs_identical_and_split_their_tokens(cluster, client, llm, shape):
    prompts = make_prompts(seed=2)
    local_before = llm.engine.model.expert_load.counts().clone()
    want = expected(llm, prompts)
    local_counts = (llm.engine.model.expert_load.counts() - local_before).numpy()  # [layers, experts]
    num_layers, num_experts = shape
    hot = np.argsort(-local_counts, axis=1, kind="stable")[:, :2]  # the two busiest experts per layer
    phy2log = np.concatenate([np.tile(np.arange(num_experts), (num_layers, 1)), hot], axis=1)  # 18 slots
    placement = apply(client, placement_from_rows(phy2log, [s.name for s in experts(cluster)], num_experts))
    wait_dispatching(cluster, placement.version)
    before, replicas_before = expert_tokens(cluster), replica_tokens(cluster, placement.version)
    assert generate_all(router(cluster), prompts) == want
    assert (expert_tokens(cluster) - before == local_counts).all()  # every routed entry ran exactly once
    served = replica_tokens(cluster, placement.version)
    for layer in range(num_layers):
        for expert in hot[layer]:
            slots = placement.log2phy[layer, expert, :2]
            a, b = (served[(layer, int(s))] - replicas_before.get((layer, int(s)), 0) for s in slots)
            assert a + b == local_counts[layer, expert]
            assert min(a, b) >= 0.25 * (a + b), (layer, expert, a, b)


def test_three_live_rebalances_under_load_fail_nothing_and_release_old_replicas(cluster, client, llm, shape):
    num_layers, num_experts = shape
    workers = [s.name for s in experts(cluster)]
    prompts = make_prompts(seed=3)
    want = expected(llm, prompts)
    gen = np.random.default_rng(0)
    placements = [
        placement_from_rows(np.tile(np.roll(np.arange(18) % num_experts, 5), (num_layers, 1)), workers, num_experts),
        placement_from_rows(
            np.stack([gen.permutation(np.arange(18) % num_experts) for _ in range(num_layers)]), workers, num_experts
        ),
        twice_on_different_workers(num_layers, num_experts, workers),
    ]
    results, errors, rebalanced = [], [], threading.Event()

    def stream():
        try:
            rounds = 0
            while not rebalanced.is_set() or rounds < 2:  # keep going until the last switch, then twice more
                results.append(generate_all(router(cluster), prompts[:4]) + generate_all(router(cluster), prompts[4:]))
                rounds = rounds + 1 if rebalanced.is_set() else 0
        except Exception as e:  # noqa: BLE001 - the test asserts there is none
            errors.append(e)

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        wait_until(lambda: results or errors, message="the first round of the stream")
        versions = [apply(client, p).version for p in placements]
    finally:
        rebalanced.set()
        thread.join(120)
    assert errors == [] and len(results) >= 3
    assert all(r == want for r in results)
    final = PlacementStore(client, MESH).current()
    assert final.version == versions[-1] and final.same_layout(placements[-1])

    def released():
        for service in experts(cluster):
            s = status(service)
            hosted = {(e.layer, e.expert) for e in s.hosted_experts}
            mine = final.phy2log[:, final.slots_of(service.name)]
            if list(s.loaded_versions) != [final.version] or hosted != {
                (layer, int(e)) for layer in range(num_layers) for e in mine[layer]
            }:
                return False
        return True

    wait_until(released, message="old replicas released")

    def heartbeats_count_the_weights_held():  # what the operator's scale-down waits on (0: drained)
        held = {r.worker_id: r.num_experts_held for r in list_workers(client, MESH, role="expert")}
        return held == {service.name: len(status(service).hosted_experts) for service in experts(cluster)}

    wait_until(heartbeats_count_the_weights_held, message="heartbeats with the weights held")


def test_bad_placements_are_rejected_and_the_active_one_stays(cluster, client, llm, prompts, shape, tmp_path):
    num_layers, num_experts = shape
    store = PlacementStore(client, MESH)
    active, latest = store.current_version(), store.latest_version()
    workers = [s.name for s in experts(cluster)]
    with pytest.raises(PlacementError, match=r"not running: \['expert-qwen-expert-9'\]"):
        apply(client, even_placement(num_layers, num_experts, [*workers[:2], f"{MESH}-expert-9"]))
    with pytest.raises(PlacementError, match="covers 2 MoE layers x 16 experts; the active placement"):
        apply(client, even_placement(2, num_experts, workers))
    data = json.loads(even_placement(num_layers, num_experts, workers).to_json())
    data["phy2log"][0] = [1] * len(data["phy2log"][0])  # expert 0 lost in layer 0
    bad_file = tmp_path / "bad.json"
    bad_file.write_text(json.dumps(data))
    port = client.connection_pool.connection_kwargs["port"]
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "moemesh.cli",
            "placement",
            "apply",
            str(bad_file),
            "--redis-url",
            f"redis://127.0.0.1:{port}/0",
            "--mesh",
            MESH,
        ],
        capture_output=True,
        text=True,
        timeout=WAIT_TIMEOUT_S,
    )
    assert cli.returncode == 2
    assert "expert 0 has no replica in layer 0" in cli.stderr, cli.stderr
    assert (store.current_version(), store.latest_version()) == (active, latest)  # nothing published
    assert generate_all(router(cluster), prompts[:2]) == expected(llm, prompts[:2])


def test_placement_apply_cli_applies_a_good_placement(cluster, client, shape, tmp_path):
    num_layers, num_experts = shape
    good = tmp_path / "good.json"
    good.write_text(even_placement(num_layers, num_experts, [s.name for s in experts(cluster)]).to_json())
    port = client.connection_pool.connection_kwargs["port"]
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "moemesh.cli",
            "placement",
            "apply",
            str(good),
            "--redis-url",
            f"redis://127.0.0.1:{port}/0",
            "--mesh",
            MESH,
        ],
        capture_output=True,
        text=True,
        timeout=WAIT_TIMEOUT_S,
    )
    assert cli.returncode == 0, cli.stderr
    version = PlacementStore(client, MESH).current_version()
    assert cli.stdout.strip() == f"placement {version} is active on 3 expert workers"


def kill_and_restart_port(cluster, name: str) -> int:
    port = int(cluster.services[name].grpc_endpoint.rsplit(":", 1)[1])
    assert cluster.stop_service(name, sig=signal.SIGKILL) == -signal.SIGKILL
    return port


def test_a_killed_expert_worker_is_routed_around_when_every_expert_has_another_replica(cluster, client, llm, shape):
    num_layers, num_experts = shape
    workers = [s.name for s in experts(cluster)]
    placement = apply(client, twice_on_different_workers(num_layers, num_experts, workers))
    wait_dispatching(cluster, placement.version)
    prompts = make_prompts(seed=4)
    port = kill_and_restart_port(cluster, workers[1])
    assert generate_all(router(cluster), prompts) == expected(llm, prompts)
    cluster.add_expert(workers[1], port)
    wait_until(
        lambda: status(cluster.services[workers[1]]).active_version == placement.version,
        message="the restarted worker serving the active placement",
    )


def test_a_killed_expert_worker_without_replicas_fails_requests_fast_and_the_cluster_recovers(
    cluster, client, llm, shape, prompts
):
    num_layers, num_experts = shape
    workers = [s.name for s in experts(cluster)]
    placement = apply(client, even_placement(num_layers, num_experts, workers))
    wait_dispatching(cluster, placement.version)
    port = kill_and_restart_port(cluster, workers[2])
    with pytest.raises(grpc.RpcError) as info:
        generate(router(cluster), prompts[0], MAX_NEW, ignore_eos=True)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"expert worker {workers[2]}" in info.value.details()
    assert "have no replica on a live expert worker" in info.value.details()
    cluster.add_expert(workers[2], port)

    def serves():
        try:
            return generate_all(router(cluster), prompts)
        except grpc.RpcError:
            return None

    assert wait_until(serves, message="requests succeeding again") == expected(llm, prompts)
