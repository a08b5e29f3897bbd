"""The operator inside kopf.operator() against KMock plus a real redis-server."""

import copy

import kmock as kmock_lib
import kubernetes_validate
import numpy as np
import pytest
from conftest import eventually

from moemesh.contracts.expert_load_records import publish_expert_load
from moemesh.contracts.placement import PlacementStore
from moemesh.contracts.registry import WorkerRecord, heartbeat
from moemesh.operator.kube import KubeApi
from tests.published_configs import DEEPSEEK_V3

pytestmark = pytest.mark.asyncio

MESHES = "moemesh.io/v1alpha1/inferencemeshes"
MESHES_URL = "/apis/moemesh.io/v1alpha1/namespaces/ns1/inferencemeshes"
MESH = "ns1/m1"
CHILDREN = {
    ("v1/configmaps", "m1-config"),
    *{("v1/services", f"m1-{role}") for role in ("router", "prefill", "decode", "expert")},
    *{("apps/v1/deployments", f"m1-{role}") for role in ("router", "prefill", "decode")},
    ("apps/v1/statefulsets", "m1-expert"),
    *{("policy/v1/poddisruptionbudgets", f"m1-{role}") for role in ("router", "prefill", "decode", "expert")},
}

BASE = {
    "apiVersion": "moemesh.io/v1alpha1",
    "kind": "InferenceMesh",
    "metadata": {"name": "m1", "namespace": "ns1", "uid": "uid-m1", "generation": 1, "resourceVersion": "1"},
    "spec": {
        "model": {
            "name": "tiny-moe",
            "source": {"hostPath": {"path": "/models/tiny"}},
            "numMoeLayers": 2,
            "numExperts": 8,
        },
        "decode": {
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 4,
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16Gi"}},
        },
        "expert": {"replicas": 2},
        "eplb": {"enabled": False},
    },
}


def mesh_body(**spec_changes):
    body = copy.deepcopy(BASE)
    for key, value in spec_changes.items():
        body["spec"][key] = value
    return body


def live(kmock, resource, name, namespace="ns1"):
    key = (kmock_lib.resource(resource), namespace, name)
    return None if key not in kmock.objects or kmock.objects[key].deleted else kmock.objects[key].raw


def status(kmock):
    obj = live(kmock, MESHES, "m1")
    return (obj or {}).get("status") or {}


def role_status(kmock, role, field):
    return ((status(kmock).get("roles") or {}).get(role) or {}).get(field)


def condition(kmock, type_):
    for cond in status(kmock).get("conditions") or []:
        if cond["type"] == type_:
            return cond
    return None


async def create(kmock, body):
    response = await kmock.post(MESHES_URL, json=body)
    assert response.status < 300, await response.text()


def record(worker_id, role, **load):
    return WorkerRecord(worker_id=worker_id, role=role, endpoint=f"{worker_id}:50051", model="tiny-moe", **load)


async def test_created_mesh_gets_every_child_owned_and_valid(kmock, operator):
    await create(kmock, mesh_body())
    await eventually(lambda: all(live(kmock, r, n) for r, n in CHILDREN), message="children")
    for resource, name in CHILDREN:
        manifest = live(kmock, resource, name)
        assert manifest["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "moemesh.io/v1alpha1",
                "kind": "InferenceMesh",
                "name": "m1",
                "uid": "uid-m1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        kubernetes_validate.validate(manifest, "1.30", strict=True)
    decode = live(kmock, "apps/v1/deployments", "m1-decode")
    container = decode["spec"]["template"]["spec"]["containers"][0]
    assert decode["spec"]["replicas"] == 1
    assert container["command"] == [
        "moemesh",
        "serve",
        "--role",
        "decode",
        "--config",
        "/etc/moemesh/mesh.json",
        "--host",
        "$(POD_IP)",
    ]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1, "memory": "16Gi"}
    assert container["startupProbe"]["grpc"] == {"port": 50051, "service": "liveness"}  # alive, not ready
    assert container["readinessProbe"]["grpc"] == {"port": 50051}
    assert live(kmock, "apps/v1/statefulsets", "m1-expert")["spec"]["replicas"] == 2
    not_ready = await eventually(
        lambda: (condition(kmock, "Ready") or {}).get("reason") == "PodsNotReady" and condition(kmock, "Ready"),
        message="Ready=False until pods are ready",
    )
    assert not_ready["status"] == "False" and "decode 0/1" in not_ready["message"]
    for resource, kind in (
        ("deployments", "router"),
        ("deployments", "prefill"),
        ("deployments", "decode"),
        ("statefulsets", "expert"),
    ):  # what the workload controllers report
        replicas = live(kmock, f"apps/v1/{resource}", f"m1-{kind}")["spec"]["replicas"]
        response = await kmock.patch(
            f"/apis/apps/v1/namespaces/ns1/{resource}/m1-{kind}/status",
            json={"status": {"replicas": replicas, "readyReplicas": replicas}},
        )
        assert response.status < 300
    await eventually(lambda: (condition(kmock, "Ready") or {}).get("status") == "True", message="Ready")
    assert status(kmock)["observedGeneration"] == 1
    assert all(c["observedGeneration"] == 1 for c in status(kmock)["conditions"])
    assert role_status(kmock, "decode", "readyReplicas") == 1 and status(kmock)["selector"].endswith("=decode")


async def test_spec_change_patches_only_what_changed(kmock, operator):
    await create(kmock, mesh_body())
    await eventually(lambda: live(kmock, "apps/v1/deployments", "m1-decode"), message="decode")
    await eventually(lambda: condition(kmock, "Ready"), message="Ready")
    patched = {"decode": {**BASE["spec"]["decode"], "replicas": 3}}
    response = await kmock.patch(f"{MESHES_URL}/m1", json={"metadata": {"generation": 2}, "spec": patched})
    assert response.status < 300
    await eventually(
        lambda: live(kmock, "apps/v1/deployments", "m1-decode")["spec"]["replicas"] == 3, message="decode replicas 3"
    )
    # the unchanged config map was created and never patched
    configmap_writes = [r.method for r in kmock[kmock_lib.resource("v1/configmaps")] if r.method in ("POST", "PATCH")]
    assert configmap_writes == ["POST"]


async def test_invalid_spec_sets_a_condition_and_creates_nothing(kmock, operator):
    await create(kmock, mesh_body(decode={"replicas": 1, "minReplicas": 3, "maxReplicas": 4}))
    spec_valid = await eventually(lambda: condition(kmock, "SpecValid"), message="SpecValid")
    assert spec_valid["status"] == "False" and spec_valid["reason"] == "InvalidSpec"
    assert "spec.decode: need minReplicas <= replicas <= maxReplicas, got 3 <= 1 <= 4" in spec_valid["message"]
    assert condition(kmock, "Ready")["status"] == "False"
    assert not any(live(kmock, r, n) for r, n in CHILDREN)


async def test_expert_pods_too_small_for_every_replica_get_a_condition_and_nothing_is_scheduled(kmock, operator):
    """DeepSeek-V3 (FP8) on 141 GiB pods: 256 experts + 32 redundant need 6 expert pods; 4 are refused
    with the memory plan's reason, and raising spec.expert.replicas to 6 lets the mesh be applied."""
    model = {
        **BASE["spec"]["model"],
        "numMoeLayers": 58,
        "numExperts": 256,
        "numExpertGroups": 8,
        "config": DEEPSEEK_V3,
        "gpuMemory": "141GiB",
    }
    eplb = {"enabled": False, "redundantSlots": 32}
    await create(kmock, mesh_body(model=model, expert={"replicas": 4}, eplb=eplb))
    spec_valid = await eventually(lambda: condition(kmock, "SpecValid"), message="SpecValid")
    assert spec_valid["status"] == "False" and spec_valid["reason"] == "ExpertPodsTooFew"
    assert "4 expert pods would hold 72 slots" in spec_valid["message"]
    assert "at least 6 expert pods are needed" in spec_valid["message"]
    assert condition(kmock, "Ready")["reason"] == "ExpertPodsTooFew"
    assert not any(live(kmock, r, n) for r, n in CHILDREN)

    response = await kmock.patch(
        f"{MESHES_URL}/m1", json={"metadata": {"generation": 2}, "spec": {"expert": {"replicas": 6}}}
    )
    assert response.status < 300, await response.text()
    await eventually(lambda: all(live(kmock, r, n) for r, n in CHILDREN), message="children after the fix")
    assert live(kmock, "apps/v1/statefulsets", "m1-expert")["spec"]["replicas"] == 6
    await eventually(lambda: (condition(kmock, "SpecValid") or {}).get("status") == "True", message="SpecValid")


async def test_overload_scales_decode_up_then_down_after_the_window(kmock, operator, redis_client):
    clock = operator
    autoscaling = {
        "enabled": True,
        "targetRequestsPerReplica": 10,
        "targetKvUsage": 0,
        "scaleDownWindowSeconds": 60,
        "scaleDownPeriodSeconds": 60,
        "maxStepUp": 4,
    }
    for role in ("router", "prefill"):
        heartbeat(redis_client, MESH, record(f"{role}-0", role))
    heartbeat(redis_client, MESH, record("decode-0", "decode", num_queued=30, num_running=10))
    await create(kmock, mesh_body(autoscaling=autoscaling))

    def decode_replicas():
        return (live(kmock, "apps/v1/deployments", "m1-decode") or {}).get("spec", {}).get("replicas")

    await eventually(lambda: decode_replicas() == 4, message="decode scaled up to 4")
    await eventually(lambda: role_status(kmock, "decode", "desiredReplicas") == 4, message="status 4")
    for index in range(4):  # the new pods registered; load is gone
        heartbeat(redis_client, MESH, record(f"decode-{index}", "decode"))
    await eventually(lambda: role_status(kmock, "decode", "registeredReplicas") == 4, message="4 registered")
    assert decode_replicas() == 4  # still inside the scale-down window
    clock.now += 61
    await eventually(lambda: decode_replicas() == 3, message="decode scaled down to 3")
    assert live(kmock, "apps/v1/deployments", "m1-router")["spec"]["replicas"] == 1


async def test_skewed_expert_load_publishes_a_new_placement(kmock, operator, redis_client):
    eplb = {"enabled": True, "redundantSlots": 2, "intervalSeconds": 0, "imbalanceThreshold": 0.05}
    await create(kmock, mesh_body(eplb=eplb))
    store = PlacementStore(redis_client, MESH)
    await eventually(lambda: store.latest_version() == 1, message="initial placement")
    assert store.current_version() == 0  # not active before the workers are ready
    for worker in ("m1-expert-0", "m1-expert-1"):
        store.mark_ready(worker, 1)
    await eventually(lambda: status(kmock).get("placementVersion") == 1, message="placement 1 active")
    counts = np.array([[800, 10, 10, 10, 10, 10, 10, 10], [10, 10, 10, 10, 10, 10, 10, 600]])
    publish_expert_load(redis_client, MESH, "m1-expert-0", counts, window_s=60.0)
    await eventually(lambda: store.latest_version() == 2, message="placement 2 published")
    placement = store.get(2)
    assert placement.replica_counts[0, 0] == 3 and placement.replica_counts[1, 7] == 3
    assert placement.worker_ids == ("m1-expert-0", "m1-expert-1")
    await eventually(lambda: status(kmock).get("pendingPlacementVersion") == 2, message="status pending 2")
    imbalance = status(kmock)["imbalance"]
    assert imbalance["before"] > imbalance["after"] >= 1.0
    assert store.current_version() == 1


async def test_deleting_the_mesh_removes_children_and_placements(kmock, operator, redis_client):
    eplb = {"enabled": True, "redundantSlots": 2, "intervalSeconds": 0}
    await create(kmock, mesh_body(eplb=eplb))
    store = PlacementStore(redis_client, MESH)
    await eventually(
        lambda: store.latest_version() == 1 and live(kmock, "apps/v1/statefulsets", "m1-expert"),
        message="placement and children",
    )
    await eventually(lambda: live(kmock, MESHES, "m1")["metadata"].get("finalizers"), message="finalizer")
    response = await kmock.delete(f"{MESHES_URL}/m1")
    assert response.status < 300
    await eventually(lambda: live(kmock, MESHES, "m1") is None, message="mesh gone")
    assert not any(live(kmock, r, n) for r, n in CHILDREN)
    assert redis_client.keys("moemesh:ns1/m1:placement*") == []


async def test_apply_creates_once_then_leaves_an_equal_object_alone(kmock, kubeconfig):
    import kopf

    kmock.resources.load_bundled()
    api = KubeApi()
    api.use(kopf.ConnectionInfo(server=str(kmock.url)))
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ns1"},
        "data": {"a": "1"},
    }
    assert await api.apply(manifest) == "created"
    assert await api.apply(manifest) == "unchanged"
    assert await api.apply({**manifest, "data": {"a": "2"}}) == "patched"
    assert live(kmock, "v1/configmaps", "c")["data"] == {"a": "2"}
    await api.close()
