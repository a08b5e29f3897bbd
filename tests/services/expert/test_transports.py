"""The streaming expert transports (`--expert-transport grpc-stream | torch-dist | socket`) through a local
cluster with two expert workers on a tiny random DeepSeek-V3 checkpoint (MLA, grouped routing, a
shared expert): greedy outputs equal the in-process engine with local experts and Hugging Face; a live placement change and a
killed expert worker (every expert replicated on both workers) fail no request. One cluster per
transport, shared by the module's tests."""

from __future__ import annotations

import signal

import pytest

from moemesh.contracts.placement_apply import apply_placement
from moemesh.contracts.redis_client import connect
from moemesh.engine.sampling_params import SamplingParams
from tests.engine.moe.models import make_prompts
from tests.services.cluster_helpers import WAIT_TIMEOUT_S, wait_until

from .conftest import hf_generate, local_engine
from .expert_helpers import (
    MAX_NEW,
    expert_cluster,
    experts,
    generate_all,
    status,
    steady_traffic,
    twice_on_different_workers,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# the streaming data planes; the unary `grpc` transport meets the same contract in
# test_transport_contract.py (a third cluster here would cost a minute of the suite)
TRANSPORTS = ["grpc-stream", "torch-dist", "socket"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request, redis_server, deepseek, tmp_path_factory):
    mesh = f"transport-{request.param}"
    with expert_cluster(
        redis_server.url, mesh, tmp_path_factory.mktemp(mesh), deepseek[0], 2, transport=request.param
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(redis_server):
    client = connect(redis_server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def llm(deepseek):
    return local_engine(deepseek[0])


def expected(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def shape(cluster) -> tuple[int, int]:
    s = status(experts(cluster)[0])
    return s.num_moe_layers, s.num_experts


def test_greedy_outputs_equal_local_experts_and_hugging_face(cluster, deepseek, llm, prompts):
    ours = generate_all(cluster.services["router"], prompts)
    assert ours == expected(llm, prompts)
    assert ours == hf_generate(deepseek[1], prompts, MAX_NEW)


def test_a_live_placement_change_under_load_fails_nothing(cluster, client, llm):
    num_layers, num_experts = shape(cluster)
    workers = [s.name for s in experts(cluster)]
    prompts = make_prompts(seed=5)[:4]
    with steady_traffic(cluster.services["router"], prompts[0]):
        placement = apply_placement(
            client, cluster.spec.mesh, twice_on_different_workers(num_layers, num_experts, workers), WAIT_TIMEOUT_S
        )
        wait_until(
            lambda: all(status(s).active_version == placement.version for s in experts(cluster)),
            message="the new placement active",
        )
        assert generate_all(cluster.services["router"], prompts) == expected(llm, prompts)


def test_a_killed_expert_worker_with_replicas_elsewhere_fails_nothing(cluster, client, llm):
    num_layers, num_experts = shape(cluster)
    workers = [s.name for s in experts(cluster)]
    placement = apply_placement(
        client, cluster.spec.mesh, twice_on_different_workers(num_layers, num_experts, workers), WAIT_TIMEOUT_S
    )
    router = cluster.services["router"]
    generate_all(router, make_prompts(seed=6)[:1])  # the worker dispatches with `placement` from here on
    prompts = make_prompts(seed=7)
    port = int(cluster.services[workers[1]].grpc_endpoint.rsplit(":", 1)[1])
    with steady_traffic(router, prompts[0]):
        assert cluster.stop_service(workers[1], sig=signal.SIGKILL) == -signal.SIGKILL
        assert generate_all(router, prompts) == expected(llm, prompts)
    cluster.add_expert(workers[1], port)
    wait_until(
        lambda: status(cluster.services[workers[1]]).active_version == placement.version,
        message="the restarted worker serving the active placement",
    )
