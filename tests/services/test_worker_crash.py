"""A worker whose engine thread crashes serves nothing more, so it exits non-zero (for its
supervisor or kubelet to restart it) instead of living on unregistered: a real worker process
(the CLI's serve path) whose engine step raises once a request arrives."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from moemesh.contracts import registry
from moemesh.launcher.local_cluster import free_port
from moemesh.proto.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.services.cluster_helpers import wait_until

CRASHING_WORKER = """
import sys
from moemesh.cli import main
from moemesh.engine.llm_engine import LLMEngine

def step(self):
    raise RuntimeError("injected engine fault")

LLMEngine.step = step
sys.exit(main(sys.argv[1:]))
"""


def test_a_worker_whose_engine_thread_crashes_exits_1_and_leaves_the_registry(redis_server, redis_client):
    port = free_port()
    command = [
        sys.executable,
        "-c",
        CRASHING_WORKER,
        "serve",
        "--role",
        "decode",
        "--worker-id",
        "crashy",
        "--host",
        "127.0.0.1",
        "--grpc-port",
        str(port),
        "--metrics-port",
        "0",
        "--dtype",
        "float32",
        "--num-blocks",
        "64",
        "--redis-url",
        redis_server.url,
        "--mesh",
        "crash",
        "--heartbeat-ttl",
        "60",
    ]
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(
            lambda: worker.poll() is not None or [r.worker_id for r in registry.list_workers(redis_client, "crash")],
            message="the worker registered",
        )
        assert worker.poll() is None, worker.stdout.read()
        request = decode_pb2.WorkerGenerateRequest(
            request_id="r1", prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=2)
        )
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError):
            list(decode_pb2_grpc.DecodeWorkerStub(channel).Generate(request, timeout=60))
        assert worker.wait(timeout=60) == 1
        log = worker.stdout.read()
        assert "injected engine fault" in log and "the engine thread crashed; exiting with status 1" in log
        assert registry.list_workers(redis_client, "crash") == []  # deregistered on the way out
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
