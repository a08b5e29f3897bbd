"""Helpers for tests against a local cluster (real processes, gRPC on loopback, real Redis)."""

from __future__ import annotations

import time

import grpc

from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster, Service
from moemesh.proto.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, telemetry_pb2

MAX_MODEL_LEN = 1024
# small pools, one thread, remote prefill from 8 uncached tokens on; float32 like the offline oracle
WORKER_ARGS = (
    "--dtype",
    "float32",
    "--num-blocks",
    "256",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--min-remote-prefill-tokens",
    "8",
    "--kv-transfer-timeout",
    "20",
)
ROUTER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN))


def test_cluster(redis_url: str, mesh: str, log_dir, num_decode: int = 2, **overrides) -> LocalCluster:
    spec = ClusterSpec(
        num_prefill=1,
        num_decode=num_decode,
        http_port=0,
        redis_url=redis_url,
        mesh=mesh,
        num_threads=1,
        worker_args=WORKER_ARGS,
        router_args=ROUTER_ARGS,
        heartbeat_ttl_s=3.0,
        log_dir=str(log_dir),
        trace_dir=str(log_dir),
        start_timeout_s=240,
        **overrides,
    )
    return LocalCluster(spec)


test_cluster.__test__ = False  # a factory, not a test


def decode_workers(cluster: LocalCluster) -> list[Service]:
    return [s for s in cluster.services.values() if s.role in ("decode", "both")]


def workers(cluster: LocalCluster) -> list[Service]:
    return [s for s in cluster.services.values() if s.role != "router"]


def load(service: Service) -> telemetry_pb2.LoadReport:
    with grpc.insecure_channel(service.grpc_endpoint) as channel:
        return decode_pb2_grpc.DecodeWorkerStub(channel).GetLoad(telemetry_pb2.LoadRequest(), timeout=RPC_TIMEOUT_S)


def load_any(service: Service) -> telemetry_pb2.LoadReport:
    """GetLoad of a decode or prefill worker (same message on both services)."""
    from moemesh.proto.v1 import prefill_pb2_grpc

    with grpc.insecure_channel(service.grpc_endpoint) as channel:
        if service.role == "prefill":
            stub = prefill_pb2_grpc.PrefillWorkerStub(channel)
        else:
            stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        return stub.GetLoad(telemetry_pb2.LoadRequest(), timeout=RPC_TIMEOUT_S)


def metrics_port(service: Service) -> int:
    return service.metrics_port


WAIT_TIMEOUT_S = 120.0  # an upper bound for a loaded 2-core machine; waits end as soon as the condition holds
RPC_TIMEOUT_S = 30.0


def wait_until(predicate, timeout_s: float = WAIT_TIMEOUT_S, interval_s: float = 0.1, message: str = "condition"):
    """Poll `predicate` until it returns a truthy value (returned); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {message}")
        time.sleep(interval_s)


def generate(router: Service, prompt_token_ids: list[int], max_tokens: int = 8, **sampling):
    """Through the router's gRPC Generate API: (token ids, serving worker id, final usage)."""
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt_token_ids),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling),
    )
    token_ids, worker_id, usage = [], "", None
    with grpc.insecure_channel(router.grpc_endpoint) as channel:
        for message in generate_pb2_grpc.GenerateStub(channel).Generate(request, timeout=120):
            token_ids += message.token_ids
            worker_id = worker_id or message.worker_id
            if message.HasField("usage"):
                usage = message.usage
    return token_ids, worker_id, usage
