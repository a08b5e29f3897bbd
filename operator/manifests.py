"""Child manifests of an InferenceMesh (pure: spec + owner in, Kubernetes objects out).

Children, all named ``{mesh}-{suffix}`` in the mesh's namespace and owned by it:

- ConfigMap ``{mesh}-config`` with ``mesh.json``, the settings every worker reads at start-up;
- Deployments ``{mesh}-router``, ``{mesh}-prefill``, ``{mesh}-decode`` and a StatefulSet
  ``{mesh}-expert`` (stable pod names = expert worker ids of the placement);
- Services: ``{mesh}-router`` (ClusterIP, HTTP + gRPC), headless ``{mesh}-prefill``,
  ``{mesh}-decode``, ``{mesh}-expert``;
- a PodDisruptionBudget per role (maxUnavailable 1: voluntary evictions go one pod at a time).

Every worker container runs ``moemesh serve --role ROLE --config /etc/moemesh/mesh.json`` and
gets POD_NAME / POD_NAMESPACE / POD_IP and MOEMESH_REDIS_PASSWORD (from a Secret) in env. The
engine settings (spec.engine, spec.<role>.engine) reach the workers through mesh.json's `engine`
and `roles.<role>.engine` sections, the router as flags.
"""

from __future__ import annotations

import json
import math
from typing import Any

from moemesh.operator.spec import MeshSpec

GROUP = "moemesh.io"
VERSION = "v1alpha1"
KIND = "InferenceMesh"
PLURAL = "inferencemeshes"

GRPC_PORT = 50051
DATA_PORT = 50052  # expert pods: the socket transport's data connections
HTTP_PORT = 8000
METRICS_PORT = 9090
CONFIG_PATH = "/etc/moemesh/mesh.json"
# A deleted router pod keeps serving this long before SIGTERM (preStop), while its endpoint leaves
# the Service; workers need none (they deregister from the registry the routers follow).
ROUTER_PRESTOP_S = 5
SHUTDOWN_MARGIN_S = 10  # after the drain: closing channels, the engine, Redis

Manifest = dict[str, Any]
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def mesh_id(namespace: str, name: str) -> str:
    """The Redis namespace of a mesh (see ``moemesh.contracts.redis_keys``)."""
    return f"{namespace}/{name}"


def expert_worker_ids(name: str, num_workers: int) -> list[str]:
    """Expert worker ids = StatefulSet pod names, in slot-owner order."""
    return [f"{name}-expert-{index}" for index in range(num_workers)]


def labels(name: str, role: str | None = None) -> dict[str, str]:
    result = {
        "app.kubernetes.io/name": "moemesh",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "moemesh-operator",
    }
    if role is not None:
        result["app.kubernetes.io/component"] = role
    return result


def selector(name: str, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": role}


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(name: str, namespace: str, uid: str, child: str, role: str | None) -> dict[str, Any]:
    return {
        "name": f"{name}-{child}",
        "namespace": namespace,
        "labels": labels(name, role),
        "ownerReferences": [owner_reference(name, uid)],
    }


def config_map(spec: MeshSpec, name: str, namespace: str, uid: str, redis_url: str) -> Manifest:
    settings = {
        "mesh": mesh_id(namespace, name),
        "model": {
            "name": spec.model.name,
            "source": spec.model.source.resolved(),
            "num_moe_layers": spec.model.num_moe_layers,
            "num_experts": spec.model.num_experts,
        },
        "redis_url": redis_url,
        "ports": {"grpc": GRPC_PORT, "data": DATA_PORT, "http": HTTP_PORT, "metrics": METRICS_PORT},
        "services": {
            role: f"{name}-{role}.{namespace}.svc:{GRPC_PORT}" for role in ("router", "prefill", "decode", "expert")
        },
        "expert_worker_ids": expert_worker_ids(name, spec.roles["expert"].replicas),
        "expert_transport": spec.expert_transport,
        "drain_seconds": spec.drain_s,
        **spec.engine.mesh_config(),  # engine, roles.<role>.engine: spec.engine, spec.<role>.engine
    }
    if spec.otlp_endpoint:
        settings["otlp_endpoint"] = spec.otlp_endpoint
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(name, namespace, uid, "config", None),
        "data": {"mesh.json": json.dumps(settings, indent=2, sort_keys=True)},
    }


def _container(spec: MeshSpec, name: str, role: str, secret: tuple[str, str] | None) -> dict[str, Any]:
    ports = [
        {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    if role == "router":
        ports.insert(0, {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"})
    if role == "expert":
        ports.insert(1, {"name": "data", "containerPort": DATA_PORT, "protocol": "TCP"})
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if secret is not None:
        env.append(
            {
                "name": "MOEMESH_REDIS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": secret[0], "key": secret[1]}},
            }
        )
    if role == "router":
        container_lifecycle = {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_S}}}
    else:
        container_lifecycle = None
    if role == "router" and spec.api_key_secret is not None:  # the keys clients must send (comma-separated)
        name_, key = spec.api_key_secret
        env.append({"name": "MOEMESH_API_KEY", "valueFrom": {"secretKeyRef": {"name": name_, "key": key}}})
    live: dict[str, Any]
    ready: dict[str, Any]
    if role == "router":  # alive while the process serves HTTP; ready once a decode worker is routable
        live, ready = {"httpGet": {"path": "/live", "port": "http"}}, {"httpGet": {"path": "/health", "port": "http"}}
    else:  # alive while loading / waiting for a placement; ready when it serves
        live, ready = {"grpc": {"port": GRPC_PORT, "service": "liveness"}}, {"grpc": {"port": GRPC_PORT}}
    container: dict[str, Any] = {
        "name": role,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        # every pod binds its own IP (what Services, probes and Prometheus reach)
        "command": ["moemesh", "serve", "--role", role, "--config", CONFIG_PATH, "--host", "$(POD_IP)"],
        "ports": ports,
        "env": env,
        # model loading can take minutes: the startup probe allows up to 30 min
        "startupProbe": {**live, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**live, "periodSeconds": 10, "failureThreshold": 6},
        # a failed start (e.g. an unresolvable model source) shows its last log line in the pod status
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/moemesh", "readOnly": True},
            {"name": "cache", "mountPath": "/var/cache/moemesh"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *spec.model.source.mounts(),
        ],
    }
    if container_lifecycle:
        container["lifecycle"] = container_lifecycle
    role_spec = spec.roles[role]
    if role_spec.resources:
        container["resources"] = role_spec.resources
    container["env"] += list(role_spec.env)
    container["volumeMounts"] += list(role_spec.volume_mounts)
    return container


def _pod_template(spec: MeshSpec, name: str, role: str, secret: tuple[str, str] | None) -> dict[str, Any]:
    role_spec = spec.roles[role]
    pod_spec: dict[str, Any] = {
        "enableServiceLinks": False,
        # SIGTERM: the process drains for spec.drainSeconds (after the router's preStop pause), then exits
        "terminationGracePeriodSeconds": math.ceil(spec.drain_s)
        + (ROUTER_PRESTOP_S if role == "router" else 0)
        + SHUTDOWN_MARGIN_S,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(spec, name, role, secret)],
        "volumes": [
            {"name": "config", "configMap": {"name": f"{name}-config"}},
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            *spec.model.source.volumes(),
        ],
    }
    init = spec.model.source.init_containers(spec.image, spec.image_pull_policy, CONFIG_PATH, CONTAINER_SECURITY)
    if init:
        pod_spec["initContainers"] = init
    if role_spec.node_selector:
        pod_spec["nodeSelector"] = role_spec.node_selector
    if role_spec.tolerations:
        pod_spec["tolerations"] = list(role_spec.tolerations)
    pod_spec["volumes"] += list(role_spec.volumes)
    pod_spec.update(role_spec.pod_fields)
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in spec.image_pull_secrets]
    return {"metadata": {"labels": labels(name, role)}, "spec": pod_spec}


def workload(
    spec: MeshSpec,
    name: str,
    namespace: str,
    uid: str,
    role: str,
    replicas: int,
    secret: tuple[str, str] | None,
) -> Manifest:
    """Deployment (router/prefill/decode) or StatefulSet (expert) of one role."""
    body: dict[str, Any] = {
        "metadata": _metadata(name, namespace, uid, role, role),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(name, role)},
            "template": _pod_template(spec, name, role, secret),
        },
    }
    if role == "expert":
        body["spec"]["serviceName"] = f"{name}-expert"
        body["spec"]["podManagementPolicy"] = "Parallel"
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", **body}
    body["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", **body}


def service(name: str, namespace: str, uid: str, role: str) -> Manifest:
    ports = [
        {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
    ]
    service_spec: dict[str, Any] = {"selector": selector(name, role), "ports": ports}
    if role == "router":
        ports.insert(0, {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"})
        service_spec["type"] = "ClusterIP"
    else:  # workers are addressed one by one through the registry
        service_spec["clusterIP"] = "None"
        service_spec["publishNotReadyAddresses"] = role == "expert"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, uid, role, role),
        "spec": service_spec,
    }


def disruption_budget(name: str, namespace: str, uid: str, role: str) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, uid, role, role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name, role)}},
    }


def children(
    spec: MeshSpec,
    name: str,
    namespace: str,
    uid: str,
    replicas: dict[str, int],
    redis_url: str,
    secret: tuple[str, str] | None,
) -> list[Manifest]:
    """Every child of the mesh in apply order (config first, so pods can mount it)."""
    result = [config_map(spec, name, namespace, uid, redis_url)]
    for role in ("router", "prefill", "decode", "expert"):
        result.append(service(name, namespace, uid, role))
        result.append(workload(spec, name, namespace, uid, role, replicas[role], secret))
        result.append(disruption_budget(name, namespace, uid, role))
    return result
