"""Helpers for expert-service tests: a local cluster with expert workers on a tiny MoE
checkpoint, their GetStatus, concurrent generation through the router, placement factories."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import redis

from moemesh.contracts.placement import Placement, contiguous_slot_owner
from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster, Service
from moemesh.proto.v1 import expert_pb2, expert_pb2_grpc
from tests.services.cluster_helpers import RPC_TIMEOUT_S, WAIT_TIMEOUT_S, generate

MAX_NEW = 12
WORKER_ARGS = (
    "--dtype",
    "float32",
    "--num-blocks",
    "256",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "256",
    "--placement-poll",
    "0.05",
    "--expert-timeout",
    "10",
)
EXPERT_ARGS = (
    "--dtype",
    "float32",
    "--placement-poll",
    "0.05",
    "--expert-load-window",
    "0.5",
    "--replica-release-grace",
    "0.3",
)


def expert_cluster(
    redis_url: str, mesh: str, log_dir, model: str, num_experts: int, transport: str = "grpc-stream"
) -> LocalCluster:
    spec = ClusterSpec(
        num_decode=1,
        aggregated=True,
        http_port=0,
        redis_url=redis_url,
        mesh=mesh,
        model=model,
        num_threads=1,
        worker_args=WORKER_ARGS,
        router_args=("--max-model-len", "256"),
        heartbeat_ttl_s=3.0,
        log_dir=str(log_dir),
        start_timeout_s=240,
        num_experts=num_experts,
        expert_args=EXPERT_ARGS,
        expert_transport=transport,
    )
    return LocalCluster(spec)


def experts(cluster: LocalCluster) -> list[Service]:
    return [s for s in cluster.services.values() if s.role == "expert"]


def status(service: Service) -> expert_pb2.ExpertStatus:
    with grpc.insecure_channel(service.grpc_endpoint) as channel:
        stub = expert_pb2_grpc.ExpertWorkerStub(channel)
        return stub.GetStatus(expert_pb2.ExpertStatusRequest(), timeout=RPC_TIMEOUT_S)


def hosted_mask(s: expert_pb2.ExpertStatus) -> np.ndarray:  # [num_layers, num_experts] bool
    """The (layer, logical expert) weights a worker holds."""
    mask = np.zeros((s.num_moe_layers, s.num_experts), dtype=bool)
    for e in s.hosted_experts:
        mask[e.layer, e.expert] = True
    return mask


def expert_tokens(cluster: LocalCluster) -> np.ndarray:  # [num_layers, num_experts] summed over the workers
    total = None
    for service in experts(cluster):
        s = status(service)
        counts = np.array(s.expert_tokens, dtype=np.int64).reshape(s.num_moe_layers, s.num_experts)
        total = counts if total is None else total + counts
    return total


def replica_tokens(cluster: LocalCluster, version: int) -> dict[tuple[int, int], int]:
    """(layer, slot) -> tokens served under `version`, over every worker."""
    return {
        (r.layer, r.slot): r.num_tokens
        for service in experts(cluster)
        for r in status(service).replicas
        if r.version == version
    }


def generate_all(router: Service, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    """Every prompt through the router's gRPC API at once; greedy token ids in prompt order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return [ids for ids, _, _ in pool.map(lambda p: generate(router, p, max_tokens, ignore_eos=True), prompts)]


def placement_from_rows(phy2log: np.ndarray, worker_ids: list[str], num_experts: int) -> Placement:
    return Placement(
        version=1,
        num_experts=num_experts,
        worker_ids=tuple(worker_ids),
        slot_owner=contiguous_slot_owner(phy2log.shape[1], len(worker_ids)),
        phy2log=phy2log,
    )


def twice_on_different_workers(num_layers: int, num_experts: int, worker_ids: list[str]) -> Placement:
    """Every expert on two different workers (slots per worker: ceil(2E / W); leftovers repeat
    expert 0, 1, ... where they are not yet held)."""
    num_workers = len(worker_ids)
    per_worker = -(-2 * num_experts // num_workers)
    held: list[list[int]] = [[] for _ in range(num_workers)]
    for _copy in range(2):
        for expert in range(num_experts):
            choices = [w for w in range(num_workers) if expert not in held[w] and len(held[w]) < per_worker]
            held[min(choices, key=lambda w: len(held[w]))].append(expert)
    extra = iter(range(num_experts))
    for w in range(num_workers):
        while len(held[w]) < per_worker:
            e = next(extra)
            if e not in held[w]:
                held[w].append(e)
    row = np.array([e for w in range(num_workers) for e in held[w]])
    return placement_from_rows(np.tile(row, (num_layers, 1)), worker_ids, num_experts)


@contextlib.contextmanager
def keyspace_events(client: redis.Redis, key_pattern: str, events: str = "Kh"):
    """A pubsub of the server's keyspace notifications (hash writes by default) for keys matching
    `key_pattern` in db 0; the server's notify-keyspace-events setting is restored on exit."""
    previous = client.config_get("notify-keyspace-events")["notify-keyspace-events"]
    client.config_set("notify-keyspace-events", events)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe(f"__keyspace@0__:{key_pattern}")
    try:
        yield pubsub
    finally:
        pubsub.close()
        client.config_set("notify-keyspace-events", previous)


def written_keys(pubsub, event: bytes = b"hset", timeout_s: float = WAIT_TIMEOUT_S):
    """Yield the name of each key written by `event` until the caller stops; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1.0)
        if message is not None and message["data"] == event:
            yield message["channel"].split(b":", 1)[1].decode()  # b"__keyspace@0__:{key}"
    raise AssertionError(f"timed out after {timeout_s} s waiting for {event.decode()} notifications")


@contextlib.contextmanager
def steady_traffic(router: Service, prompt_token_ids: list[int], max_tokens: int = 4):
    """Greedy requests through the router one after another until the block exits; a failed
    request fails the block."""
    stop, errors = threading.Event(), []

    def loop():
        try:
            while not stop.is_set():
                generate(router, prompt_token_ids, max_tokens, ignore_eos=True)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(WAIT_TIMEOUT_S)
    assert not thread.is_alive() and errors == [], errors
