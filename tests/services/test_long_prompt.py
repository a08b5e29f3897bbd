"""Long prompts through the disaggregated path, on a local cluster (its own Redis; SmolLM2, 1
prefill + 1 decode worker, 8192-token context, supervised like `moemesh up`). The prefill worker
computes at most 128 tokens a round, so a long prompt's KV streams to the decode worker over many
rounds: a ~5k-token prompt completes remotely, and a prefill worker SIGKILLed part-way leaves the
decode worker the KV it received, from which it resumes locally with the offline engine's output."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.chaos import metric_total
from moemesh.engine.sampling_params import SamplingParams
from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster
from tests.services.cluster_helpers import ROUTER_ARGS, WORKER_ARGS, generate, wait_until

MESH = "long-prompt"
# the workers hold a ~5k-token prompt (8k context, 400 blocks of 16)
LONG_ARGS = (*WORKER_ARGS, "--max-model-len", "8192", "--num-blocks", "400")
PREFILL_ARGS = ("--max-num-batched-tokens", "128")  # many rounds per prompt: KV streams while it is computed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(
        num_prefill=1,
        num_decode=1,
        http_port=0,
        mesh=MESH,
        num_threads=2,
        worker_args=LONG_ARGS,
        prefill_args=PREFILL_ARGS,
        router_args=(*ROUTER_ARGS, "--max-model-len", "8192"),
        heartbeat_ttl_s=3.0,
        log_dir=str(tmp_path_factory.mktemp("long-prompt")),
        start_timeout_s=240,
        restart_backoff_s=0.5,
    )
    with LocalCluster(spec) as cluster:
        yield cluster


def metrics_url(cluster, name: str) -> str:
    return f"http://127.0.0.1:{cluster.services[name].metrics_port}/metrics"


def test_a_5k_token_prompt_completes_through_the_disaggregated_path(cluster):
    """The remote-prefill wait grows with the prompt: no local fallback, no first-token timeout."""
    prefills = metrics_url(cluster, "prefill-0")
    before = metric_total(prefills, "moemesh:prefills_total")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=900)
    prompt = " ".join(f"item {i} is {i * 7 % 13}." for i in range(520)) + "\nThe last item is"
    response = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=4, temperature=0
    )
    assert response.usage.prompt_tokens > 4500 and response.choices[0].finish_reason == "length"
    assert metric_total(prefills, "moemesh:prefills_total") == before + 1  # prefilled by the prefill worker, once
    assert metric_total(metrics_url(cluster, "decode-0"), "moemesh:kv_transfer_resumed_tokens_total") == 0


def test_a_prefill_worker_killed_part_way_leaves_the_kv_it_sent_and_the_decode_worker_resumes_from_it(
    cluster, offline_llm, tokenizer
):
    prompt = tokenizer.encode(" ".join(f"Entry {i} reads {i * 5 % 11}." for i in range(110)))
    assert 800 < len(prompt) < 1000  # several prefill rounds; within the offline engine's context
    (expected,) = offline_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    decode = metrics_url(cluster, "decode-0")
    bytes_before = metric_total(decode, "moemesh:kv_transfer_bytes_total")
    resumed_before = metric_total(decode, "moemesh:kv_transfer_resumed_tokens_total")
    prefill = cluster.services["prefill-0"]
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, cluster.services["router"], prompt, 8)
        wait_until(
            lambda: metric_total(decode, "moemesh:kv_transfer_bytes_total") > bytes_before,
            interval_s=0.02,
            message="the first KV of the prompt on the decode worker",
        )
        os.kill(prefill.process.pid, signal.SIGKILL)
        token_ids, worker_id, usage = answer.result(timeout=120)
    assert token_ids == expected.token_ids and worker_id == "decode-0"
    resumed = metric_total(decode, "moemesh:kv_transfer_resumed_tokens_total") - resumed_before
    assert 0 < resumed < len(prompt)

    events = []

    def prefill_worker_back() -> bool:
        events.extend(cluster.supervise())
        if not any(e.startswith("prefill-0 restarted") for e in events):
            return False
        with grpc.insecure_channel(prefill.grpc_endpoint) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:  # not listening yet
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING  # its model loaded

    wait_until(prefill_worker_back, message="the supervisor restarts the prefill worker and it serves")
