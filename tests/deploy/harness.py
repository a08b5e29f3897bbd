"""The pieces of a cluster the pods-as-written tests need, without a cluster: the chart rendered
by the Helm SDK, the operator's real handlers under `kopf.operator()` against KMock, a Redis
listening where the chart's Service name points, and a test kubelet (`kubelet.py`) that runs the
operator's pod templates and plays the workload controllers (pod names, readyReplicas).

One host->address map is the whole "DNS": every pod's /etc/hosts, and `getaddrinfo` of this
process (where the operator runs) for the names in it.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import pathlib
import socket
import subprocess

import kmock
import kopf
import yaml

from moemesh.launcher.redis_server import server_command
from moemesh.operator.config import OperatorConfig
from moemesh.operator.handlers import register
from tests.deploy.kubelet import Node, Pod

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "moemesh"
MESHES = "moemesh.io/v1alpha1/inferencemeshes"
WORKLOADS = (("apps/v1/deployments", "Deployment"), ("apps/v1/statefulsets", "StatefulSet"))


def render_chart(values: dict | None, release: str, namespace: str) -> list[dict]:
    import helm_python as helm

    rendered = helm.Chart.load(str(CHART)).render(values, name=release, namespace=namespace)
    return [
        doc for path, text in rendered.items() if not path.endswith(".txt") for doc in yaml.safe_load_all(text) if doc
    ]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def container_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's env as the kubelet would set it (values and secretKeyRefs)."""
    env = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
    return env


class HostMap:
    """DNS name -> loopback address, for the pods (/etc/hosts) and for this process."""

    def __init__(self) -> None:
        self.hosts: dict[str, str] = {}
        self._next = 10

    def new_address(self) -> str:
        self._next += 1
        return f"127.0.0.{self._next}"

    def add_service(self, name: str, namespace: str, address: str) -> None:
        for host in (name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"):
            self.hosts[host] = address

    @contextlib.contextmanager
    def resolving(self):
        original = socket.getaddrinfo

        def getaddrinfo(host, *args, **kwargs):
            return original(self.hosts.get(host, host), *args, **kwargs)

        socket.getaddrinfo = getaddrinfo
        try:
            yield self
        finally:
            socket.getaddrinfo = original


class RedisAt:
    """redis-server bound to one loopback address and port (the Service's), with a password."""

    def __init__(self, address: str, port: int, password: str | None, workdir: pathlib.Path):
        args = server_command(address, port, str(workdir))
        if password:
            args += ["--requirepass", password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.address, self.port = address, port

    async def wait(self, timeout_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            with contextlib.suppress(OSError), socket.create_connection((self.address, self.port), timeout=0.5):
                return
            assert self.process.poll() is None, f"redis-server exited {self.process.returncode}"
            assert asyncio.get_running_loop().time() < deadline, "redis-server did not listen"
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def declare_resources(emulator) -> None:
    emulator.resources.load_bundled()
    emulator.resources[MESHES] = kmock.ResourceInfo(
        kind="InferenceMesh",
        singular="inferencemesh",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
        subresources={"status", "scale"},
    )
    emulator.resources["v1/namespaces"].namespaced = False


@contextlib.asynccontextmanager
async def operator_on(emulator, config: OperatorConfig, namespace: str):
    """The operator's real handlers in kopf.operator() against the emulator, until the block ends."""
    registry = kopf.OperatorRegistry()
    register(registry, config)
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.persistence.consistency_timeout = 0
    settings.posting.enabled = False
    settings.watching.reconnect_backoff = 0.1
    settings.queueing.exit_timeout = 0.1
    ready = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(registry=registry, settings=settings, namespaces=[namespace], standalone=True, ready_flag=ready)
    )
    await asyncio.wait_for(ready.wait(), timeout=120)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=120)


def live(emulator, resource: str, namespace: str, name: str) -> dict | None:
    key = (kmock.resource(resource), namespace, name)
    return None if key not in emulator.objects or emulator.objects[key].deleted else emulator.objects[key].raw


def owned(emulator, resource: str, namespace: str, owner: str) -> list[dict]:
    found = []
    for (res, ns, _), obj in list(emulator.objects.items()):
        if res == kmock.resource(resource) and ns == namespace and not obj.deleted:
            refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("name") == owner for ref in refs):
                found.append(obj.raw)
    return found


def pod_names(workload: dict) -> list[str]:
    """The names the workload controllers give pods: `{sts}-{i}`; `{deploy}-{hash}-{suffix}`."""
    name, replicas = workload["metadata"]["name"], workload["spec"].get("replicas", 1)
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(replicas)]
    template_hash = hashlib.sha256(repr(workload["spec"]["template"]).encode()).hexdigest()[:10]
    return [f"{name}-{template_hash}-{i:05d}" for i in range(replicas)]


class Kubelet:
    """Runs every pod of the mesh's workloads on a Node; plays the controllers' status writes."""

    def __init__(self, emulator, node: Node, hosts: HostMap):
        self.emulator, self.node, self.hosts = emulator, node, hosts
        self.pods: dict[str, Pod] = {}  # pod name -> pod
        self.role_of: dict[str, str] = {}

    def schedule(self, workloads: list[dict]) -> None:
        self.node.hosts = self.hosts.hosts
        for workload in workloads:
            role = workload["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component", "")
            for name in pod_names(workload):
                self.pods[name] = Pod(name, workload["spec"]["template"], self.hosts.new_address(), self.node)
                self.role_of[name] = role

    def pods_of(self, role: str) -> list[Pod]:
        return [p for n, p in self.pods.items() if self.role_of[n] == role]

    async def start_all(self, timeout_s: float = 600.0) -> None:
        """Start every pod, then wait on their probes, each in a thread of its own: the loop's
        default executor (cores + 4 threads) is the operator's too, and pods blocking it would
        starve the timer that activates their expert placement."""
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.pods) or 1) as probes:
            for pod in self.pods.values():
                await loop.run_in_executor(probes, pod.start)
            await asyncio.gather(
                *(loop.run_in_executor(probes, pod.wait_ready, timeout_s) for pod in self.pods.values())
            )

    async def publish_pods(self) -> None:
        """The Pod objects the workload controllers create, labelled as their templates."""
        for name, pod in self.pods.items():
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": self.node.namespace,
                    "labels": dict(pod.template["metadata"]["labels"]),
                },
                "spec": pod.spec,
                "status": {"phase": "Pending", "podIP": pod.ip},
            }
            response = await self.emulator.post(f"/api/v1/namespaces/{self.node.namespace}/pods", json=body)
            assert response.status < 300, await response.text()

    async def report_exit(self, pod: Pod) -> None:
        """What the kubelet writes when a container of the pod failed: its terminated state, with the
        termination message (FallbackToLogsOnError) and the pod phase."""
        assert pod.terminated is not None, f"{pod.name} has not failed"
        state = {
            "terminated": {
                "exitCode": pod.terminated["exitCode"],
                "reason": "Error",
                "message": pod.terminated["message"],
            }
        }
        statuses = [
            {
                "name": pod.terminated["container"],
                "ready": False,
                "restartCount": 0,
                "state": state,
                "image": "moemesh",
                "imageID": "",
            }
        ]
        key = "initContainerStatuses" if pod.terminated["init"] else "containerStatuses"
        body = {"status": {"phase": "Failed", "podIP": pod.ip, key: statuses}}
        response = await self.emulator.patch(
            f"/api/v1/namespaces/{self.node.namespace}/pods/{pod.name}/status",
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert response.status < 300, await response.text()

    async def report_ready(self, workloads: list[dict], resource_of: dict[str, str]) -> None:
        """What the Deployment / StatefulSet controllers write once their pods are ready."""
        for workload in workloads:
            meta = workload["metadata"]
            replicas = workload["spec"].get("replicas", 1)
            url = f"/apis/apps/v1/namespaces/{meta['namespace']}/{resource_of[workload['kind']]}/{meta['name']}/status"
            body = {
                "status": {
                    "replicas": replicas,
                    "readyReplicas": replicas,
                    "availableReplicas": replicas,
                    "observedGeneration": meta.get("generation", 1),
                }
            }
            response = await self.emulator.patch(
                url, json=body, headers={"Content-Type": "application/merge-patch+json"}
            )
            assert response.status < 300, await response.text()

    def stop_all(self) -> None:
        for pod in self.pods.values():
            pod.stop()
        self.node.cleanup()
