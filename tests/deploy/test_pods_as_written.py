"""The deployed path, run as written: the chart's default InferenceMesh (builtin SmolLM2) and a
1 prefill + 2 decode + 2 expert mesh on a tiny random DeepSeek-V3 from a PersistentVolumeClaim.

The operator's real handlers run in kopf.operator() on KMock; the children are read back from
KMock; every pod template is started by the test kubelet exactly as written (command, args, env
with downward-API values, ConfigMap / Secret files at their mountPath, init containers first) and
gated on its own probes. Then the router Service answers an OpenAI chat request with the offline
engine's greedy output, every pod's `metrics` port answers /metrics as a ServiceMonitor scrapes
it, and the mesh's Ready condition turns true only after the workloads report ready pods.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import kmock
import openai
import pytest
import pytest_asyncio

from moemesh.operator.config import OperatorConfig
from tests.deploy.harness import (
    MESHES,
    HostMap,
    Kubelet,
    RedisAt,
    container_env,
    declare_resources,
    live,
    one,
    operator_on,
    owned,
    render_chart,
)
from tests.deploy.kubelet import Node

pytestmark = pytest.mark.asyncio

NAMESPACE, RELEASE = "moemesh", "mm"
RESOURCE_OF = {"Deployment": "deployments", "StatefulSet": "statefulsets"}
METRIC_OF_ROLE = {"router": b"moemesh:router_requests", "prefill": b"vllm:num_requests_running",
                  "decode": b"vllm:num_requests_running", "expert": b"moemesh:expert_calls"}  # fmt: skip


def condition(mesh: dict | None, kind: str) -> dict | None:
    for cond in ((mesh or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return None


async def eventually(predicate, timeout_s: float = 300.0, message: str = "condition"):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {message}"
        await asyncio.sleep(0.1)


@pytest_asyncio.fixture()
async def cluster(tmp_path, monkeypatch):
    """KMock + the chart's Redis (at its Service name) + the operator configured as the chart's
    operator Deployment says; yields (emulator, hosts, node, docs)."""
    docs = render_chart(None, RELEASE, NAMESPACE)
    secret = one(docs, "Secret")  # the chart's Redis password
    secrets = {secret["metadata"]["name"]: secret["data"]}
    operator_pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    env = container_env(operator_pod["containers"][0], secrets)
    hosts = HostMap()
    redis_address = hosts.new_address()
    hosts.add_service(one(docs, "Service")["metadata"]["name"], NAMESPACE, redis_address)  # the chart's Redis
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    redis = RedisAt(redis_address, 6379, env.get("MOEMESH_REDIS_PASSWORD"), redis_dir)
    try:
        await redis.wait()
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
            declare_resources(emulator)
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(
                "kind: Config\ncurrent-context: mock\n"
                f"clusters: [{{name: mock, cluster: {{server: '{emulator.url!s}'}}}}]\n"
                "users: [{name: mock, user: {}}]\ncontexts: [{name: mock, context: {cluster: mock, user: mock}}]\n"
            )
            monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
            node = Node(namespace=NAMESPACE, workdir=tmp_path / "node")
            node.add_objects([secret])
            response = await emulator.post(f"/api/v1/namespaces/{NAMESPACE}/secrets", json=secret)
            assert response.status < 300, await response.text()
            with hosts.resolving():
                config = OperatorConfig.from_env({**env, "MOEMESH_TICK_SECONDS": "0.2"})
                async with operator_on(emulator, config, NAMESPACE):
                    yield emulator, hosts, node, docs
    finally:
        redis.stop()


async def children_of(emulator, mesh_name: str, node: Node) -> list[dict]:
    workloads = await eventually(
        lambda: (lambda w: w if len(w) == 4 else None)(
            owned(emulator, "apps/v1/deployments", NAMESPACE, mesh_name)
            + owned(emulator, "apps/v1/statefulsets", NAMESPACE, mesh_name)),
        message="the mesh's workloads",
    )  # fmt: skip
    node.add_objects(owned(emulator, "v1/configmaps", NAMESPACE, mesh_name))
    return workloads


async def serve_as_written(emulator, hosts: HostMap, node: Node, mesh_name: str) -> tuple[Kubelet, list[dict]]:
    workloads = await children_of(emulator, mesh_name, node)
    kubelet = Kubelet(emulator, node, hosts)
    kubelet.schedule([w for w in workloads if w["spec"].get("replicas", 1) > 0])
    (router,) = kubelet.pods_of("router")
    hosts.add_service(f"{mesh_name}-router", NAMESPACE, router.ip)  # the router Service -> its pod
    await kubelet.start_all()
    return kubelet, workloads


def scrape_every_pod(kubelet: Kubelet) -> None:
    for name, pod in kubelet.pods.items():
        with urllib.request.urlopen(f"http://{pod.ip}:{pod.port('metrics')}/metrics", timeout=10) as reply:
            text = reply.read()
        assert reply.status == 200 and METRIC_OF_ROLE[kubelet.role_of[name]] in text, name


async def ready_only_after_the_workloads_report(emulator, kubelet: Kubelet, workloads: list[dict], mesh_name: str):
    mesh = live(emulator, MESHES, NAMESPACE, mesh_name)
    assert (condition(mesh, "Ready") or {}).get("status") != "True", "Ready before any pod was ready"
    await kubelet.report_ready(workloads, RESOURCE_OF)
    await eventually(lambda: (condition(live(emulator, MESHES, NAMESPACE, mesh_name), "Ready") or {}).get("status")
                     == "True", message="Ready=True")  # fmt: skip
    ready = condition(live(emulator, MESHES, NAMESPACE, mesh_name), "Ready")
    assert ready["observedGeneration"] == live(emulator, MESHES, NAMESPACE, mesh_name)["metadata"]["generation"]


async def test_the_charts_default_mesh_serves_smollm2_as_the_offline_engine_does(cluster, smollm):
    from moemesh.engine.sampling_params import SamplingParams

    emulator, hosts, node, docs = cluster
    mesh = one(docs, "InferenceMesh")
    mesh["metadata"].update(uid="uid-default", generation=1, resourceVersion="1")  # what the API server adds
    name = mesh["metadata"]["name"]
    response = await emulator.post(f"/apis/moemesh.io/v1alpha1/namespaces/{NAMESPACE}/inferencemeshes", json=mesh)
    assert response.status < 300, await response.text()
    kubelet, workloads = await serve_as_written(emulator, hosts, node, name)
    try:
        (router,) = kubelet.pods_of("router")
        messages = [{"role": "user", "content": "Name two planets."}]
        client = openai.OpenAI(base_url=f"http://{router.ip}:{router.port('http')}/v1", api_key="unused")
        reply = await asyncio.to_thread(client.chat.completions.create, model=mesh["spec"]["model"]["name"],
                                        messages=messages, max_tokens=16, temperature=0)  # fmt: skip
        expected = smollm.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0].text
        assert reply.choices[0].message.content == expected
        assert [m.id for m in client.models.list().data] == [mesh["spec"]["model"]["name"]]
        scrape_every_pod(kubelet)
        await ready_only_after_the_workloads_report(emulator, kubelet, workloads, name)
    finally:
        await asyncio.to_thread(kubelet.stop_all)


def _dump(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)[:3000]
