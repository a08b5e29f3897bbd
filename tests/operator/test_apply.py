"""Child updates propagate removals (three-way merge patch) and stay idempotent, against KMock."""

import copy

import kmock as kmock_lib
import kubernetes_validate
import pytest
from conftest import eventually
from test_operator import BASE, MESHES_URL, create, live

from moemesh.operator.merge import merge_patch

TOLERATIONS = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "dedicated", "operator": "Equal", "value": "moe", "effect": "NoSchedule"},
]
ENV = [{"name": "LOG_LEVEL", "value": "debug"}, {"name": "EXTRA", "value": "1"}]


def decode_pod(kmock):
    return (live(kmock, "apps/v1/deployments", "m1-decode") or {}).get("spec", {}).get("template", {}).get("spec", {})


def user_env(pod_spec):
    return [e for e in pod_spec["containers"][0]["env"] if "value" in e]


def deployment_writes(kmock):
    return [r.method for r in kmock[kmock_lib.resource("apps/v1/deployments")] if r.method in ("POST", "PATCH", "PUT")]


@pytest.mark.asyncio
async def test_removing_a_toleration_and_an_env_var_removes_them_from_the_deployment(kmock, operator):
    body = copy.deepcopy(BASE)
    body["spec"]["decode"] = {
        **BASE["spec"]["decode"],
        "tolerations": TOLERATIONS,
        "env": ENV,
        "priorityClassName": "moe-high",
    }
    await create(kmock, body)
    await eventually(lambda: decode_pod(kmock).get("tolerations") == TOLERATIONS, message="tolerations applied")
    assert user_env(decode_pod(kmock)) == ENV
    kubernetes_validate.validate(live(kmock, "apps/v1/deployments", "m1-decode"), "1.30", strict=True)
    decode = {
        **BASE["spec"]["decode"],
        "tolerations": TOLERATIONS[:1],
        "env": ENV[:1],
        "priorityClassName": None,
    }  # a merge patch: null removes it from the CR
    response = await kmock.patch(f"{MESHES_URL}/m1", json={"metadata": {"generation": 2}, "spec": {"decode": decode}})
    assert response.status < 300
    await eventually(lambda: decode_pod(kmock).get("tolerations") == TOLERATIONS[:1], message="toleration removed")
    assert user_env(decode_pod(kmock)) == ENV[:1]
    await eventually(lambda: "priorityClassName" not in decode_pod(kmock), message="priorityClassName removed")
    kubernetes_validate.validate(live(kmock, "apps/v1/deployments", "m1-decode"), "1.30", strict=True)
    # dropping the whole list removes the field
    decode = {**BASE["spec"]["decode"], "tolerations": None, "env": None}
    await kmock.patch(f"{MESHES_URL}/m1", json={"metadata": {"generation": 3}, "spec": {"decode": decode}})
    await eventually(lambda: "tolerations" not in decode_pod(kmock), message="tolerations field removed")
    assert user_env(decode_pod(kmock)) == []


@pytest.mark.asyncio
async def test_apply_writes_nothing_when_nothing_changed(kmock, kubeconfig):
    import kopf

    from moemesh.operator.kube import KubeApi

    kmock.resources.load_bundled()
    api = KubeApi()
    api.use(kopf.ConnectionInfo(server=str(kmock.url)))
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns1"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"tolerations": TOLERATIONS, "containers": [{"name": "c", "image": "i", "env": ENV}]},
            },
        },
    }
    assert await api.apply(manifest) == "created"
    assert await api.apply(manifest) == "unchanged"
    smaller = copy.deepcopy(manifest)
    del smaller["spec"]["template"]["spec"]["tolerations"]
    smaller["spec"]["template"]["spec"]["containers"][0]["env"] = ENV[1:]
    assert await api.apply(smaller) == "patched"
    pod = live(kmock, "apps/v1/deployments", "d")["spec"]["template"]["spec"]
    assert "tolerations" not in pod and pod["containers"][0]["env"] == ENV[1:]
    assert await api.apply(smaller) == "unchanged"
    assert deployment_writes(kmock) == ["POST", "PATCH"]
    await api.close()


def test_merge_patch_keeps_server_set_fields_and_nulls_removed_ones():
    applied = {"spec": {"type": "ClusterIP", "ports": [{"port": 80}], "sessionAffinity": "ClientIP"}}
    live_service = {
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "10.0.0.7",
            "sessionAffinity": "ClientIP",
            "ports": [{"port": 80, "protocol": "TCP"}],
        }
    }
    desired = {"spec": {"type": "ClusterIP", "ports": [{"port": 80}]}}
    assert merge_patch(desired, live_service, applied) == {"spec": {"sessionAffinity": None}}
    assert merge_patch(applied, live_service, applied) == {}
