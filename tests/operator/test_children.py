"""Children are watched (a deleted child comes back, unless the mesh itself goes away) and failed
pods surface on the mesh (PodsHealthy). The pure pod-health decision is tested on Pod dicts shaped
as the kubelet writes them; the rest runs the operator inside kopf.operator() against KMock."""

import copy

import kmock as kmock_lib
import kopf
import pytest
from conftest import eventually
from test_operator import BASE, CHILDREN, MESHES, MESHES_URL, condition, create, live, mesh_body

from moemesh.operator import manifests
from moemesh.operator.handlers import RECONCILE_CONDITIONS, TIMER_CONDITIONS, _record_owned
from moemesh.operator.pod_health import HEALTHY, PodsHealth, pods_health, with_pods_health
from moemesh.operator.status import set_condition

PODS_URL = "/api/v1/namespaces/ns1/pods"
IMAGE = "moemesh/moemesh-services:0.1.0"
SOURCE_ERROR = "moemesh: error: pvc 'models' path 'no-such-model' does not exist (spec.model.source)"


def container(name, state, *, last_state=None, ready=False, restarts=0):
    """One entry of status.containerStatuses / initContainerStatuses, as the kubelet writes it."""
    return {
        "name": name,
        "image": IMAGE,
        "imageID": "",
        "ready": ready,
        "restartCount": restarts,
        "started": "running" in state,
        "state": state,
        "lastState": last_state or {},
    }


def exited(code, message, reason="Error"):
    return {
        "terminated": {
            "exitCode": code,
            "reason": reason,
            "message": message,
            "startedAt": "2025-01-01T00:00:00Z",
            "finishedAt": "2025-01-01T00:00:05Z",
        }
    }


RUNNING = {"running": {"startedAt": "2025-01-01T00:01:00Z"}}


def waiting(reason, message=""):
    return {"waiting": {"reason": reason, "message": message}}


def pod(name, containers=(), init_containers=(), *, mesh="m1", role="decode", phase="Running", deleting=False):
    metadata = {"name": name, "namespace": "ns1", "labels": manifests.labels(mesh, role)}
    if deleting:
        metadata["deletionTimestamp"] = "2025-01-01T00:02:00Z"
    status = {"phase": phase, "containerStatuses": list(containers)}
    if init_containers:
        status["initContainerStatuses"] = list(init_containers)
    spec = {"containers": [{"name": role, "image": IMAGE}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": status}


# --- the decision, without Kubernetes ---------------------------------------------------------


def test_a_failed_init_container_names_the_pod_the_container_and_the_last_line_of_its_log():
    fetch = container("fetch-model", exited(2, f"INFO fetching the snapshot\n{SOURCE_ERROR}\n"))
    decode = container("decode", waiting("PodInitializing"))
    health = pods_health([pod("m1-decode-7d9f-abcde", [decode], [fetch], phase="Pending")])
    assert health == PodsHealth(False, "ContainerFailed", f"m1-decode-7d9f-abcde/fetch-model exited 2: {SOURCE_ERROR}")


def test_a_crash_looping_container_reports_its_last_exit_and_termination_message():
    decode = container(
        "decode",
        waiting("CrashLoopBackOff", "back-off 40s restarting failed container=decode pod=m1-decode-0"),
        last_state=exited(1, f"{SOURCE_ERROR}\n"),
        restarts=3,
    )
    assert pods_health([pod("m1-decode-0", [decode])]) == PodsHealth(
        False, "ContainerFailed", f"m1-decode-0/decode exited 1: {SOURCE_ERROR}"
    )


def test_a_running_ready_pod_after_a_completed_init_container_is_healthy():
    fetch = container("fetch-model", exited(0, "", reason="Completed"), ready=True)
    decode = container("decode", RUNNING, ready=True)
    assert pods_health([pod("m1-decode-0", [decode], [fetch])]) == HEALTHY
    assert HEALTHY == PodsHealth(True, "NoFailures", "no container of the mesh has failed")


def test_a_container_that_crashed_once_and_serves_again_is_healthy_but_not_while_it_restarts():
    last = exited(137, "", reason="OOMKilled")
    recovered = container("decode", RUNNING, last_state=last, ready=True, restarts=1)
    assert pods_health([pod("m1-decode-0", [recovered])]) == HEALTHY
    restarting = container("decode", RUNNING, last_state=last, ready=False, restarts=1)
    assert pods_health([pod("m1-decode-0", [restarting])]).message == "m1-decode-0/decode exited 137: OOMKilled"


def test_an_image_that_cannot_be_pulled_reports_the_waiting_reason_and_message():
    router = container("router", waiting("ImagePullBackOff", 'Back-off pulling image "moemesh/nope:1"'))
    assert pods_health([pod("m1-router-0", [router], role="router")]) == PodsHealth(
        False, "ContainerFailed", 'm1-router-0/router ImagePullBackOff: Back-off pulling image "moemesh/nope:1"'
    )


def test_several_failed_pods_name_the_first_by_name_and_count_the_rest():
    crashed = [container("decode", exited(1, f"{SOURCE_ERROR}\n"))]
    pods = [
        pod("m1-decode-c", crashed),
        pod("m1-decode-a", crashed),
        pod("m1-decode-b", [container("decode", RUNNING, ready=True)]),
        pod("m1-decode-d", crashed),
    ]
    assert pods_health(pods).message == f"m1-decode-a/decode exited 1: {SOURCE_ERROR} (and 2 more failed pods)"
    assert pods_health(pods[:2]).message.endswith(" (and 1 more failed pod)")


def test_terminating_pods_are_not_failures_and_long_messages_are_cut():
    stopped = container("decode", exited(143, "shutting down\n"))
    assert pods_health([pod("m1-decode-old", [stopped], deleting=True)]) == HEALTHY
    long_line = "x" * 5000
    health = pods_health([pod("m1-decode-0", [container("decode", exited(1, long_line))])])
    assert health.message == f"m1-decode-0/decode exited 1: {'x' * 800}" and len(health.message) < 1000


def test_ready_stays_false_while_pods_fail_and_says_why():
    failed = PodsHealth(False, "ContainerFailed", "m1-decode-0/decode exited 1: boom")
    serving = (True, "Serving", "every role has its ready pods")
    assert with_pods_health(serving, failed) == (
        False,
        "PodsFailing",
        "pods failing: m1-decode-0/decode exited 1: boom",
    )
    waiting_for_pods = (False, "PodsNotReady", "waiting for ready pods: decode 0/1")
    assert with_pods_health(waiting_for_pods, failed) == (
        False,
        "PodsNotReady",
        "waiting for ready pods: decode 0/1; pods failing: m1-decode-0/decode exited 1: boom",
    )
    assert with_pods_health(serving, HEALTHY) == serving
    assert with_pods_health(serving, PodsHealth(None, "Forbidden", "no RBAC")) == serving


def test_a_stale_reconcile_keeps_the_ticks_pods_healthy():
    memo = kopf.Memo()
    stale = []  # what the reconcile read: the status before the tick's patch landed
    tick = set_condition(stale, "PodsHealthy", False, "ContainerFailed", "m1-decode-0/decode exited 1: boom")
    _record_owned(memo, tick, TIMER_CONDITIONS)
    written_by_reconcile = _record_owned(
        memo, set_condition(stale, "SpecValid", True, "Valid", "ok"), RECONCILE_CONDITIONS
    )
    assert {c["type"]: c["status"] for c in written_by_reconcile} == {"SpecValid": "True", "PodsHealthy": "False"}


# --- the operator against KMock ---------------------------------------------------------------


def mesh_reads(kmock, name):
    """How often one mesh was read by name (only the child handler does: kopf lists and watches)."""
    return sum(1 for r in kmock["fetch", kmock_lib.resource(MESHES)] if r.name == name)


def pod_listings(kmock):
    """How often the mesh's pods were listed (once per tick)."""
    return sum(1 for _ in kmock["list", kmock_lib.resource("v1/pods")])


async def delete_and_wait_for_return(kmock, resource, url, name):
    response = await kmock.delete(f"{url}/{name}")
    assert response.status < 300, await response.text()
    assert live(kmock, resource, name) is None
    await eventually(lambda: live(kmock, resource, name), message=f"{resource} {name} recreated")


@pytest.mark.asyncio
async def test_a_deleted_service_and_deployment_come_back_as_they_were(kmock, operator):
    await create(kmock, mesh_body())
    await eventually(lambda: all(live(kmock, r, n) for r, n in CHILDREN), message="children")
    await eventually(lambda: condition(kmock, "Applied"), message="reconciled")
    before = {key: copy.deepcopy(live(kmock, *key)) for key in CHILDREN}
    # the Service first: only the watch brings it back (the timer re-applies when a workload is missing)
    await delete_and_wait_for_return(kmock, "v1/services", "/api/v1/namespaces/ns1/services", "m1-router")
    await delete_and_wait_for_return(
        kmock, "apps/v1/deployments", "/apis/apps/v1/namespaces/ns1/deployments", "m1-decode"
    )
    for key in (("v1/services", "m1-router"), ("apps/v1/deployments", "m1-decode")):
        again = live(kmock, *key)
        assert again["spec"] == before[key]["spec"]
        assert again["metadata"]["labels"] == before[key]["metadata"]["labels"]
        assert again["metadata"]["ownerReferences"] == [manifests.owner_reference("m1", "uid-m1")]
    for key in CHILDREN:  # the watch puts nothing of kopf's on the children
        meta = live(kmock, *key)["metadata"]
        assert not meta.get("finalizers") and not any("kopf" in a for a in meta.get("annotations") or {}), key


@pytest.mark.asyncio
async def test_deleting_the_mesh_does_not_bring_its_children_back(kmock, operator):
    await create(kmock, mesh_body())
    await eventually(lambda: all(live(kmock, r, n) for r, n in CHILDREN), message="children")
    await eventually(lambda: live(kmock, MESHES, "m1")["metadata"].get("finalizers"), message="finalizer")
    response = await kmock.delete(f"{MESHES_URL}/m1")
    assert response.status < 300
    await eventually(lambda: live(kmock, MESHES, "m1") is None, message="mesh gone")
    # every child's DELETED event was handled: the handler read the mesh once per child
    await eventually(lambda: mesh_reads(kmock, "m1") >= len(CHILDREN), message="child events handled")
    # and a later mesh's deleted child is recreated, so the operator has handled what came before
    await create(kmock, {**copy.deepcopy(BASE), "metadata": {**BASE["metadata"], "name": "m2", "uid": "uid-m2"}})
    await eventually(lambda: live(kmock, "apps/v1/deployments", "m2-decode"), message="m2 decode")
    response = await kmock.delete("/apis/apps/v1/namespaces/ns1/deployments/m2-decode")
    assert response.status < 300
    await eventually(lambda: live(kmock, "apps/v1/deployments", "m2-decode"), message="m2 decode recreated")
    assert not any(live(kmock, r, n) for r, n in CHILDREN)


@pytest.mark.asyncio
async def test_a_pod_that_cannot_start_makes_pods_healthy_false_until_it_serves(kmock, operator):
    await create(kmock, mesh_body())
    await eventually(lambda: (condition(kmock, "PodsHealthy") or {}).get("status") == "True", message="no pods yet")
    crashed = pod("m1-decode-7d9f-abcde", [container("decode", waiting("PodInitializing"))], phase="Pending")
    response = await kmock.post(PODS_URL, json=crashed)
    assert response.status < 300, await response.text()
    failed = {
        "status": {
            "phase": "Running",
            "containerStatuses": [
                container(
                    "decode",
                    waiting("CrashLoopBackOff", "back-off 10s restarting failed container"),
                    last_state=exited(2, f"{SOURCE_ERROR}\n"),
                    restarts=1,
                )
            ],
        }
    }
    response = await kmock.patch(f"{PODS_URL}/m1-decode-7d9f-abcde/status", json=failed)
    assert response.status < 300, await response.text()
    unhealthy = await eventually(
        lambda: (condition(kmock, "PodsHealthy") or {}).get("status") == "False" and condition(kmock, "PodsHealthy"),
        message="PodsHealthy=False",
    )
    assert unhealthy["reason"] == "ContainerFailed"
    assert unhealthy["message"] == f"m1-decode-7d9f-abcde/decode exited 2: {SOURCE_ERROR}"
    ready = condition(kmock, "Ready")
    assert ready["status"] == "False" and f"pods failing: {unhealthy['message']}" in ready["message"]

    serving = {
        "status": {
            "phase": "Running",
            "containerStatuses": [
                container("decode", RUNNING, last_state=exited(2, f"{SOURCE_ERROR}\n"), ready=True, restarts=2)
            ],
        }
    }
    response = await kmock.patch(f"{PODS_URL}/m1-decode-7d9f-abcde/status", json=serving)
    assert response.status < 300, await response.text()
    healthy = await eventually(
        lambda: (condition(kmock, "PodsHealthy") or {}).get("status") == "True" and condition(kmock, "PodsHealthy"),
        message="PodsHealthy=True",
    )
    assert healthy["reason"] == "NoFailures"
    assert "pods failing" not in condition(kmock, "Ready")["message"]


@pytest.mark.asyncio
async def test_a_pod_of_another_mesh_is_not_this_meshs_failure(kmock, operator):
    await create(kmock, mesh_body())
    await eventually(lambda: condition(kmock, "PodsHealthy"), message="PodsHealthy")
    other = pod("m9-decode-0", [container("decode", exited(1, "not m1's\n"))], mesh="m9")
    response = await kmock.post(PODS_URL, json=other)
    assert response.status < 300, await response.text()
    listed = pod_listings(kmock)
    # a tick listed the pods after the post, and the next one started after its status patch
    await eventually(lambda: pod_listings(kmock) >= listed + 2, message="two more ticks")
    assert condition(kmock, "PodsHealthy")["status"] == "True"
    selectors = {r.params.get("labelSelector") for r in kmock["list", kmock_lib.resource("v1/pods")]}
    assert selectors == {"app.kubernetes.io/instance=m1,app.kubernetes.io/managed-by=moemesh-operator"}


@pytest.mark.asyncio
async def test_forbidden_pod_listing_leaves_pods_healthy_unknown_and_the_tick_running(kmock, operator, caplog):
    forbidden = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "reason": "Forbidden",
        "code": 403,
        "message": 'pods is forbidden: User "system:serviceaccount:moemesh:op" cannot list',
    }
    kmock["list", kmock_lib.resource("v1/pods")] << 403 << forbidden
    await create(kmock, mesh_body())
    unknown = await eventually(lambda: condition(kmock, "PodsHealthy"), message="PodsHealthy")
    assert (unknown["status"], unknown["reason"]) == ("Unknown", "Forbidden")
    # the rest of the tick ran: telemetry, roles, and Ready from the workloads
    await eventually(lambda: (condition(kmock, "Ready") or {}).get("reason") == "PodsNotReady", message="Ready")
    assert condition(kmock, "TelemetryAvailable")["status"] == "True"
    assert live(kmock, MESHES, "m1")["status"]["roles"]["decode"]["replicas"] == 1
    assert condition(kmock, "PodsHealthy")["reason"] == "Forbidden"
    warnings = [r.getMessage() for r in caplog.records if "pod failures are not reported" in r.getMessage()]
    assert warnings == [f"pod failures are not reported: {unknown['message']}"]  # once, not every tick
