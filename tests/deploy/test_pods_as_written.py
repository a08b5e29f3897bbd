"""The deployed path, run as written: the chart's default InferenceMesh (builtin SmolLM2) and a
1 prefill + 2 decode + 2 expert mesh on a tiny random DeepSeek-V3 from a PersistentVolumeClaim
(expert data plane: torch-dist, gloo groups bound to each pod's own IP), plus a mesh whose PVC path is wrong: its pod exits non-zero naming the source, and the mesh says so.

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
from tests.engine.moe.models import VOCAB, build_deepseek_v3, save_tiny

pytestmark = pytest.mark.asyncio

NAMESPACE, RELEASE = "moemesh", "mm"
RESOURCE_OF = {"Deployment": "deployments", "StatefulSet": "statefulsets"}
METRIC_OF_ROLE = {
    "router": b"moemesh:router_requests",
    "prefill": b"vllm:num_requests_running",
    "decode": b"vllm:num_requests_running",
    "expert": b"moemesh:expert_calls",
}


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
    # the workers compute in float32 (the chart's model.dtype), as the float32 oracles here do:
    # "auto" would be bf16 on a CPU with native bf16, whose greedy tokens depend on the batch
    docs = render_chart({"mesh": {"model": {"dtype": "float32"}}}, RELEASE, NAMESPACE)
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
            + owned(emulator, "apps/v1/statefulsets", NAMESPACE, mesh_name)
        ),
        message="the mesh's workloads",
    )
    node.add_objects(owned(emulator, "v1/configmaps", NAMESPACE, mesh_name))
    return workloads


async def serve_as_written(emulator, hosts: HostMap, node: Node, mesh_name: str) -> tuple[Kubelet, list[dict]]:
    workloads = await children_of(emulator, mesh_name, node)
    kubelet = Kubelet(emulator, node, hosts)
    kubelet.schedule([w for w in workloads if w["spec"].get("replicas", 1) > 0])
    (router,) = kubelet.pods_of("router")
    hosts.add_service(f"{mesh_name}-router", NAMESPACE, router.ip)  # the router Service -> its pod
    try:
        await kubelet.start_all()
    except BaseException:
        await asyncio.to_thread(kubelet.stop_all)  # no pod outlives a failed start
        raise
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
    await eventually(
        lambda: (condition(live(emulator, MESHES, NAMESPACE, mesh_name), "Ready") or {}).get("status") == "True",
        message="Ready=True",
    )
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
        reply = await asyncio.to_thread(
            client.chat.completions.create,
            model=mesh["spec"]["model"]["name"],
            messages=messages,
            max_tokens=16,
            temperature=0,
        )
        expected = smollm.chat(messages, SamplingParams(temperature=0, max_tokens=16))[0].text
        assert reply.choices[0].message.content == expected
        assert [m.id for m in client.models.list().data] == [mesh["spec"]["model"]["name"]]
        scrape_every_pod(kubelet)
        await ready_only_after_the_workloads_report(emulator, kubelet, workloads, name)
    finally:
        await asyncio.to_thread(kubelet.stop_all)


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A real Hugging Face tokenizer for a tiny random model: word `w<i>` is token i, and the chat
    template joins the messages' contents, so chat requests reach it as token ids it knows."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(f"{path}/tokenizer.json")
    template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"chat_template": template, "add_bos_token": False}, f)


def deepseek_mesh(docs: list[dict], name: str, claim: str, path: str) -> dict:
    """The chart's mesh, renamed, on a tiny DeepSeek-V3 from a PVC: 1 prefill, 2 decode, 2 expert pods,
    the torch-dist expert transport; engine settings for the mesh (float32, the router's and workers'
    context length) and the decode pods' own."""
    mesh = json.loads(json.dumps(one(docs, "InferenceMesh")))
    mesh["metadata"].update(name=name, uid=f"uid-{name}", generation=1, resourceVersion="1")
    spec = mesh["spec"]
    spec["model"] = {
        "name": "tiny-deepseek",
        "source": {"pvc": {"claimName": claim, "path": path}},
        "numMoeLayers": 2,
        "numExperts": 16,
        "numExpertGroups": 4,
    }
    spec["engine"] = {"dtype": "float32", "maxModelLen": 256}
    spec["prefill"] = {**spec["prefill"], "replicas": 1}
    spec["decode"] = {**spec["decode"], "replicas": 2, "minReplicas": 2, "engine": {"maxNumSeqs": 8}}
    spec["expert"] = {"replicas": 2}
    spec["expertTransport"] = "torch-dist"
    return mesh


async def create_mesh(emulator, mesh: dict) -> None:
    response = await emulator.post(f"/apis/moemesh.io/v1alpha1/namespaces/{NAMESPACE}/inferencemeshes", json=mesh)
    assert response.status < 300, await response.text()


async def test_a_deepseek_v3_mesh_with_expert_pods_from_a_pvc_serves_as_the_offline_engine_does(cluster, tmp_path):
    from moemesh import LLM
    from moemesh.engine.sampling_params import SamplingParams

    emulator, hosts, node, docs = cluster
    checkpoint = tmp_path / "claim-models" / "tiny-deepseek"
    checkpoint.mkdir(parents=True)
    save_tiny(build_deepseek_v3, str(checkpoint))
    save_word_tokenizer(str(checkpoint), VOCAB)
    node.claims["models"] = tmp_path / "claim-models"
    mesh = deepseek_mesh(docs, "ds", "models", "tiny-deepseek")
    await create_mesh(emulator, mesh)
    kubelet, workloads = await serve_as_written(emulator, hosts, node, "ds")
    try:
        assert {role: len(kubelet.pods_of(role)) for role in ("router", "prefill", "decode", "expert")} == {
            "router": 1,
            "prefill": 1,
            "decode": 2,
            "expert": 2,
        }
        (router,) = kubelet.pods_of("router")
        client = openai.OpenAI(base_url=f"http://{router.ip}:{router.port('http')}/v1", api_key="unused")
        offline = LLM(str(checkpoint), dtype="float32", num_blocks=256, max_model_len=256, show_progress=False)
        conversations = [
            [{"role": "user", "content": " ".join(f"w{(7 * i + j) % VOCAB}" for j in range(3 + 2 * i))}]
            for i in range(4)
        ]
        for messages in conversations:  # the requests spread over both decode pods and the prefill pod
            reply = await asyncio.to_thread(
                client.chat.completions.create, model="tiny-deepseek", messages=messages, max_tokens=8, temperature=0
            )
            expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text
            assert reply.choices[0].message.content == expected
        scrape_every_pod(kubelet)
        await ready_only_after_the_workloads_report(emulator, kubelet, workloads, "ds")
    finally:
        await asyncio.to_thread(kubelet.stop_all)


async def test_a_wrong_pvc_path_makes_the_pod_exit_naming_the_source_and_the_mesh_reports_it(cluster, tmp_path):
    emulator, hosts, node, docs = cluster
    (tmp_path / "claim-models").mkdir()
    node.claims["models"] = tmp_path / "claim-models"
    await create_mesh(emulator, deepseek_mesh(docs, "bad", "models", "no-such-model"))
    workloads = await children_of(emulator, "bad", node)
    kubelet = Kubelet(emulator, node, hosts)
    kubelet.schedule([w for w in workloads if w["metadata"]["name"] == "bad-prefill"])
    await kubelet.publish_pods()
    (pod,) = kubelet.pods.values()
    try:
        await asyncio.to_thread(pod.start)
        assert await asyncio.to_thread(pod.wait_exit) != 0
        message = pod.terminated["message"].strip()
        assert len(message.splitlines()) == 1, message
        assert "pvc 'models' path 'no-such-model'" in message and "does not exist" in message
        await kubelet.report_exit(pod)
        healthy = await eventually(
            lambda: (lambda c: c if c and c["status"] == "False" else None)(
                condition(live(emulator, MESHES, NAMESPACE, "bad"), "PodsHealthy")
            ),
            message="PodsHealthy=False",
        )
        assert pod.name in healthy["message"] and "no-such-model" in healthy["message"]
        assert (condition(live(emulator, MESHES, NAMESPACE, "bad"), "Ready") or {}).get("status") != "True"
    finally:
        await asyncio.to_thread(kubelet.stop_all)
